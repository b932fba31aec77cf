"""Shared by the benchmarks: the benchmark model folder and machine facts (bandwidth
and matmul measurements live in tandem.plan.measure, which `tandem plan --measure` uses)."""

from __future__ import annotations

import platform
from pathlib import Path

import torch

from tandem.models.random_gguf import SHAPES

BENCH_DIR = Path("/tmp/tandem-bench")

# The ~125M-parameter Llama the issue specifies (random weights).
LLAMA_125M = dict(
    hidden_size=768,
    num_hidden_layers=12,
    num_attention_heads=12,
    num_key_value_heads=4,
    intermediate_size=2048,
    vocab_size=32000,
    max_position_embeddings=2048,
    tie_word_embeddings=False,
)


# A random-weight Llama of SmolLM2-135M's shape (30 layers, hidden 576, tied): deep and
# narrow, where per-layer overheads show. The shape is random_gguf's; these benchmarks'
# folders were made with a 2,048-token context.
SMOLLM2_SHAPE = {
    **SHAPES["smollm2-135m"].raw_config(),
    "max_position_embeddings": 2048,
}


def random_llama_folder(name: str, config: dict) -> Path:
    """Save (once) a random-weight Llama with transformers, so tandem and transformers
    load the very same checkpoint."""
    folder = BENCH_DIR / name
    if not (folder / "model.safetensors").is_file():
        import transformers

        torch.manual_seed(0)
        transformers.LlamaForCausalLM(transformers.LlamaConfig(**config)).save_pretrained(folder)
    return folder


def llama_125m_folder() -> Path:
    return random_llama_folder("llama-125m", LLAMA_125M)


def smollm2_shaped_folder() -> Path:
    return random_llama_folder("smollm2-135m-shape", SMOLLM2_SHAPE)


# The instruction sets CPU kernels dispatch on; a figure is only comparable with
# figures from a CPU with the same ones.
ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "avx_vnni", "amx_bf16")


def machine() -> str:
    """The CPU model, its vector extensions, threads and torch version."""
    cpu, flags = None, None
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and cpu is None:
                cpu = value.strip()
            elif key.strip() == "flags" and flags is None:
                flags = [flag for flag in ISA_FLAGS if flag in value.split()]
    except OSError:
        pass
    cpu = cpu or platform.processor() or platform.machine()
    isa = " ".join(flags or []) or "flags unknown"
    return f"{cpu} ({isa}), {torch.get_num_threads()} threads, torch {torch.__version__}"


def kernel_at(revision: str, source: str, functions: list[str]):
    """tandem/kernels/``source`` as it was at a git ``revision``, built alone (a module
    of its own, exposing ``functions``): the old kernel of an A/B against the working
    tree's (``--against`` in the kernel benchmarks)."""
    import hashlib
    import subprocess

    from torch.utils.cpp_extension import load_inline

    from tandem.kernels import cpu as cpu_kernels

    text = subprocess.run(
        ["git", "show", f"{revision}:tandem/kernels/{source}"],
        cwd=Path(__file__).parent, check=True, capture_output=True, text=True,
    ).stdout  # fmt: skip
    name = f"tandem_{Path(source).stem}_" + hashlib.sha1(text.encode()).hexdigest()[:10]
    directory = cpu_kernels.build_directory(name)
    directory.mkdir(parents=True, exist_ok=True)
    return load_inline(
        name=name,
        cpp_sources=[text],
        functions=functions,
        extra_cflags=list(cpu_kernels.COMPILE_FLAGS),
        extra_ldflags=list(cpu_kernels.LINK_FLAGS),
        build_directory=str(directory),
    )
