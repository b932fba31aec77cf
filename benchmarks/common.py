"""Shared by the benchmarks: the benchmark model folder and machine facts (bandwidth
and matmul measurements live in tandem.plan.measure, which `tandem plan --measure` uses)."""

from __future__ import annotations

import json
import platform
import statistics
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


def smollm2_shaped_with_tokenizer() -> Path:
    """The SmolLM2-shaped folder with the bundled SmolLM2's tokenizer, so that other
    programs (sentence-transformers, huggingface_hub) load it as a whole model folder."""
    folder = smollm2_shaped_folder()
    if not (folder / "tokenizer.json").is_file():
        from tandem import LLM
        from tandem.models.catalog import default_model

        tokenizer = LLM(default_model()).get_tokenizer()
        (folder / "tokenizer.json").write_text(tokenizer.backend_json())
        special = {k: v for k, v in tokenizer.special_tokens.items() if v is not None}
        config = {"tokenizer_class": "PreTrainedTokenizerFast", **special}
        (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


# The instruction sets CPU kernels dispatch on; a figure is only comparable with
# figures from a CPU with the same ones.
ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "avx_vnni", "amx_bf16")


def machine() -> str:
    """The CPU model (with its family and model numbers: VMs name several generations
    alike, "AMD EPYC" for Zen 3, 4 and 5), its vector extensions, threads and torch
    version."""
    cpu, flags, family, model = None, None, None, None
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            key, value = key.strip(), value.strip()
            if key == "model name" and cpu is None:
                cpu = value
            elif key == "cpu family" and family is None:
                family = value
            elif key == "model" and model is None:
                model = value
            elif key == "flags" and flags is None:
                flags = [flag for flag in ISA_FLAGS if flag in value.split()]
    except OSError:
        pass
    cpu = cpu or platform.processor() or platform.machine()
    if family is not None and model is not None:
        cpu = f"{cpu}, family {family} model {model}"
    isa = " ".join(flags or []) or "flags unknown"
    return f"{cpu} ({isa}), {torch.get_num_threads()} threads, torch {torch.__version__}"


def kernel_at(
    revision: str | None, source: str, functions: list[str], extra_cflags: tuple[str, ...] = ()
):
    """tandem/kernels/``source`` as it was at a git ``revision`` (None: the working
    tree's), built alone (a module of its own, exposing ``functions``) with the
    project's flags and ``extra_cflags`` (``-mno-avx512f -mno-avxvnni``: the AVX2 path
    on an AVX-512 machine): a side of an A/B (``--against`` in the kernel benchmarks).
    parallel.cpp, where the revision has it, goes in front, as in the module."""
    import hashlib
    import subprocess

    from torch.utils.cpp_extension import load_inline

    from tandem.kernels import cpu as cpu_kernels

    def read(name: str) -> str:
        if revision is None:
            path = Path(cpu_kernels.__file__).parent / name
            return path.read_text() if path.exists() else ""
        shown = subprocess.run(
            ["git", "show", f"{revision}:tandem/kernels/{name}"],
            cwd=Path(__file__).parent, capture_output=True, text=True,
        )  # fmt: skip
        return shown.stdout if shown.returncode == 0 else ""

    text = read(source)
    if not text:
        raise FileNotFoundError(f"tandem/kernels/{source} at {revision or 'the working tree'}")
    text = read("parallel.cpp") + text
    key = hashlib.sha1((text + " ".join(extra_cflags)).encode()).hexdigest()[:10]
    name = f"tandem_{Path(source).stem}_{key}"
    directory = cpu_kernels.build_directory(name)
    directory.mkdir(parents=True, exist_ok=True)
    return load_inline(
        name=name,
        cpp_sources=[text],
        functions=functions,
        extra_cflags=[*cpu_kernels.COMPILE_FLAGS, *extra_cflags],
        extra_ldflags=list(cpu_kernels.LINK_FLAGS),
        build_directory=str(directory),
    )


def kernel_sides(args, source: str, functions: list[str]):
    """(old, new) kernel modules for ``--against REVISION`` (and ``--cflags``): the
    revision's build and the working tree's, both with the extra flags; (None, None)
    without --against."""
    if not args.against:
        return None, None
    from tandem.kernels import cpu as cpu_kernels

    flags = tuple(args.cflags.split())
    old = kernel_at(args.against, source, functions, flags)
    new = kernel_at(None, source, functions, flags) if flags else cpu_kernels.load()
    return old, new


def add_against_arguments(parser) -> None:
    parser.add_argument("--against", metavar="REVISION", help="the kernel at a git revision")
    parser.add_argument(
        "--cflags", default="", metavar="FLAGS",
        help="extra compiler flags for both sides of --against (\"-mno-avx512f -mno-avxvnni\": "
        "the AVX2 path on an AVX-512 machine)",
    )  # fmt: skip


def alternating(run_old, run_new, rounds: int) -> tuple[float, float, float]:
    """Seconds of the old and the new side (each a call returning its seconds), run in
    turn ``rounds`` times: (old median, new median, median of the rounds' old / new)."""
    times = [(run_old(), run_new()) for _ in range(rounds)]
    return (
        statistics.median(a for a, _ in times),
        statistics.median(b for _, b in times),
        statistics.median(a / b for a, b in times),
    )
