"""Shared by the benchmarks: the benchmark model folder, machine facts, timing."""

from __future__ import annotations

import platform
import statistics
import time
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


def median_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def memory_bandwidth_gbs(size_mb: int = 1024, repeats: int = 5) -> float:
    """Read bandwidth this process gets: time to sum a large float32 tensor."""
    data = torch.ones(size_mb * (1 << 20) // 4)
    data.sum()
    seconds = median_time(data.sum, repeats)
    return data.numel() * 4 / seconds / 1e9


def matmul_tflops(dtype: torch.dtype, size: int = 1024, repeats: int = 5) -> float:
    """Peak-ish matmul throughput this process gets in ``dtype`` (TFLOP/s)."""
    a = torch.randn(size, size).to(dtype)
    a @ a
    seconds = median_time(lambda: a @ a, repeats)
    return 2 * size**3 / seconds / 1e12
