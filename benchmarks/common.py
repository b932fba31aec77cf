"""Shared by the benchmarks: the benchmark model folder and machine facts (bandwidth
and matmul measurements live in tandem.plan.measure, which `tandem plan --measure` uses)."""

from __future__ import annotations

import platform
from pathlib import Path

import torch

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


def llama_125m_folder() -> Path:
    """Save (once) a random-weight Llama with transformers, so tandem and transformers
    load the very same checkpoint."""
    folder = BENCH_DIR / "llama-125m"
    if not (folder / "model.safetensors").is_file():
        import transformers

        torch.manual_seed(0)
        config = transformers.LlamaConfig(**LLAMA_125M)
        transformers.LlamaForCausalLM(config).save_pretrained(folder)
    return folder


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{cpu}, {torch.get_num_threads()} threads, torch {torch.__version__}"
