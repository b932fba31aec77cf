"""What this machine actually does: read bandwidth, matmul throughput, and tandem's own
prefill and decode step on a model (``tandem plan --measure`` and the benchmarks)."""

from __future__ import annotations

import json
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from tandem.errors import InvalidParameterError
from tandem.models.random_weights import random_model
from tandem.plan.hardware import Hardware

if TYPE_CHECKING:
    from tandem.models.config import ModelConfig
from tandem.quant.blocks import GGMLType
from tandem.quant.packed import packed_nbytes
from tandem.runner.static_batch import stream_with_cache


def median_time(fn: Callable[[], object], repeats: int, warmup: int = 0) -> float:
    """Median seconds of ``repeats`` calls of ``fn``, after ``warmup`` untimed ones."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def memory_bandwidth_gbs(size_mb: int = 1024, repeats: int = 5) -> float:
    """Read bandwidth this process gets: the faster of summing a large float32 tensor
    and, where the CPU kernels are built, reading it as they stream their weights
    (read_probe.cpp), medians of ``repeats``. The decode floors divide by it, so it is
    the best read this process is known to reach, not the first one tried."""
    from tandem.kernels import cpu as cpu_kernels

    data = torch.ones(size_mb * (1 << 20) // 4)
    readers = [data.sum]
    module = cpu_kernels.load()
    if module is not None:
        readers.append(lambda: module.read_stream(data))
    best = 0.0
    for read in readers:
        read()
        best = max(best, data.numel() * 4 / median_time(read, repeats) / 1e9)
    return best


def matmul_tflops(dtype: torch.dtype, size: int = 1024, repeats: int = 5) -> float:
    """Peak-ish matmul throughput this process gets in ``dtype`` (TFLOP/s)."""
    a = torch.randn(size, size).to(dtype)
    a @ a
    seconds = median_time(lambda: a @ a, repeats)
    return 2 * size**3 / seconds / 1e12


def _random_packed(code: GGMLType, rows: int, columns: int):
    from tandem.models.random_gguf import random_blocks
    from tandem.quant.packed import PackedWeight

    raw = torch.from_numpy(random_blocks(code, rows, columns, np.random.default_rng(0)))
    return PackedWeight.from_ggml(code, raw, columns)


def quant_kernel_tflops(
    code: GGMLType, shapes: list[tuple[int, int]] | None = None, tokens: int = 512
) -> float:
    """Throughput of the integer-dot kernel (kernels/quant_ops.cpp) on ``code``
    matrices of ``shapes`` ([rows, columns]: a model's own; one [4096, 4096] if not
    given) at prefill's shape, ``tokens`` activation rows: their FLOPs over their time."""
    flops = seconds = 0.0
    for rows, columns in shapes or [(4096, 4096)]:
        weight = _random_packed(code, rows, columns)
        x = torch.randn(tokens, columns)
        out = torch.empty(tokens, rows)
        seconds += median_time(lambda w=weight, x=x, o=out: w.matmul(x, o), 3, warmup=1)
        flops += 2 * tokens * rows * columns
    return flops / seconds / 1e12


def quant_kernel_read_gbs(code: GGMLType, megabytes: int = 256, columns: int = 4096) -> float:
    """The rate at which the integer-dot kernel streams a ``code`` matrix for one
    activation row (a batch-1 decode step's matmuls): its bytes over its time, on a
    matrix far larger than the caches."""
    tile = packed_nbytes(code, 16, columns)  # 16 rows: the packed layout's unit
    rows = megabytes * (1 << 20) // tile * 16
    weight = _random_packed(code, rows, columns)
    x = torch.randn(1, columns)
    out = torch.empty(1, rows)
    seconds = median_time(lambda: weight.matmul(x, out), 5, warmup=1)
    return weight.nbytes / seconds / 1e9


def attention_tflops(config: ModelConfig, tokens: int, dtype: torch.dtype) -> float:
    """Throughput of the engine's prompt attention (torch_sdpa.causal_attention, the
    kernel fresh prompts run) on ``config``'s heads for a causal prompt of ``tokens``
    (capped at a default chunk's length): its FLOPs (calculator.attention_flops' count) over
    its time. It depends on the length: short prompts run well below the rate of long
    ones."""
    from tandem.config import SchedulerConfig
    from tandem.plan.calculator import attended_pairs
    from tandem.runner.attention.torch_sdpa import causal_attention

    # The engine's prompt chunks are at most its default step's token budget long.
    tokens = max(16, min(tokens, SchedulerConfig().max_num_batched_tokens))
    generator = torch.Generator().manual_seed(0)
    d, heads, kv_heads = config.head_dim, config.num_heads, config.num_kv_heads
    q = torch.randn(tokens, heads, d, generator=generator).to(dtype)
    k = torch.randn(tokens, kv_heads, d, generator=generator).to(dtype)
    v = torch.randn(tokens, kv_heads, d, generator=generator).to(dtype)
    seconds = median_time(lambda: causal_attention(q, k, v, 1, tokens, d**-0.5), 5, warmup=1)
    return 4 * heads * d * attended_pairs(tokens, None) / seconds / 1e12


KV_MEASURED_BYTES = 256 << 20  # the caches decode attention is timed over: past L3


def paged_caches(kv_dtype: str, depth: int, kv_heads: int, head_dim: int, layers: int):
    """``layers`` caches [2, blocks, block size, Hkv, width] of random rows in
    ``kv_dtype`` (the engine's names: "auto" is float32) holding one sequence of
    ``depth`` tokens, its blocks scattered in a pool twice as large (as in a serving
    cache, so nothing stays cached between layers); -> (caches, block table [1, n],
    the bytes one layer's decode attention reads)."""
    from tandem.config import CacheConfig
    from tandem.runner.kv_cache import SCALE_BYTES, STORED_DTYPES

    block_size = CacheConfig().block_size  # the engine's default
    used = -(-depth // block_size)
    blocks = 2 * used
    width = head_dim + (SCALE_BYTES if kv_dtype == "int8" else 0)
    caches = []
    for _ in range(layers):
        if kv_dtype == "int8":
            shape = (2, blocks, block_size, kv_heads, width)
            cache = torch.randint(0, 255, shape, dtype=torch.uint8)
            cache[..., head_dim:] = 0
            cache[..., head_dim:].view(torch.float32).fill_(0.01)
        else:
            cache = torch.randn(2, blocks, block_size, kv_heads, width)
            cache = cache.to(STORED_DTYPES.get(kv_dtype, torch.float32))
        caches.append(cache)
    table = torch.randperm(blocks)[:used][None].contiguous()
    return caches, table, caches[0].element_size() * width * kv_heads * 2 * depth


def decode_attention_seconds(caches, q, table, lens, scale: float) -> float:
    """Median seconds of one decode step's attention: every layer's kernel call."""
    from tandem.kernels import cpu as cpu_kernels

    def step() -> None:
        for cache in caches:
            cpu_kernels.decode_attention(q, cache[0], cache[1], table, lens, scale, None)

    return median_time(step, repeats=7, warmup=1)


def decode_attention_read_gbs(
    config: ModelConfig, kv_dtype: str, dtype: torch.dtype = torch.float32, depth: int = 4096
) -> float:
    """The rate the CPU decode-attention kernel reads K/V for one sequence ``depth``
    tokens deep on ``config``'s heads, queries in ``dtype``: bytes over time, over
    enough layers to hold KV_MEASURED_BYTES (so the caches do not fit the CPU's)."""
    per_layer = 2 * 2 * depth * config.num_kv_heads * config.head_dim * 4  # pool, float32
    layers = max(2, min(config.num_layers, KV_MEASURED_BYTES // per_layer))
    caches, table, layer_bytes = paged_caches(
        kv_dtype, depth, config.num_kv_heads, config.head_dim, layers
    )
    q = torch.randn(1, config.num_heads, config.head_dim).to(dtype)
    lens = torch.tensor([depth])
    seconds = decode_attention_seconds(caches, q, table, lens, config.head_dim**-0.5)
    return layer_bytes * layers / seconds / 1e9


def this_machine(
    dtype: str = "fp32",
    gguf: Path | None = None,
    config: ModelConfig | None = None,
    prompt_len: int = 512,
    kv_dtype: str | None = None,
    batch: int = 1,
) -> Hardware:
    """The CPU this runs on, measured (memory: physical RAM). Matmul throughput is
    measured in the dtype the engine computes a ``dtype`` model in (``engine_dtype``)
    and recorded under ``dtype``, so the plan's floors are the engine's. A GGUF file's
    (``dtype`` gguf) weights are priced at the rates of the integer-dot kernel that
    runs each of its formats: for FLOP/s its throughput at prefill's shape on the
    model's own matrices of that format (``weights.layer_shapes``), blended by the
    blocks' weights in each format (``weights.layer_mix``: a prompt's matmuls); for
    bandwidth the rate at which it streams weights for one row (a decode step's
    matmuls), blended by the bytes a step reads in each (``weights.mix``). A blend is
    the total over the sum of each format's time. With the model's ``config``,
    attention's own rates too, on its heads: a prompt's at ``prompt_len`` tokens
    (attention_tflops), and the rate decode attention reads a cache of ``kv_dtype``
    (a short name, as plan_arguments gives it; the engine's default if None:
    decode_attention_read_gbs). For a GGUF file (``gguf``, its weights as
    calculator.file_weights reads them), the engine's fixed cost of a step as well, at
    batch 1 and ``batch`` (fixed_cost.step_overheads)."""
    from tandem.kernels import cpu as cpu_kernels
    from tandem.plan.calculator import engine_cache_dtype, file_weights
    from tandem.plan.fixed_cost import step_overheads

    memory_gb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9
    name = f"this machine ({torch.get_num_threads()} threads, measured)"
    computed = {"float32": torch.float32, "bfloat16": torch.bfloat16}[engine_dtype(dtype)]
    attention = kv_read = None
    if config is not None:
        attention = attention_tflops(config, prompt_len, computed)
        if cpu_kernels.available(torch.device("cpu"), computed):
            cache = engine_cache_dtype(kv_dtype) if kv_dtype is not None else "auto"
            kv_read = decode_attention_read_gbs(config, cache, computed)
    weights = file_weights(gguf) if gguf is not None else None
    mix = weights.mix if weights is not None else {}
    overheads = {}
    if mix and cpu_kernels.load() is not None:
        seconds_per_byte = sum(b / quant_kernel_read_gbs(code) for code, (b, _) in mix.items())
        shapes = weights.layer_shapes
        prefill_mix = weights.layer_mix or {code: w for code, (_, w) in mix.items()}
        seconds_per_flop = sum(
            w / quant_kernel_tflops(code, shapes.get(code)) for code, w in prefill_mix.items()
        )
        bandwidth = sum(b for b, _ in mix.values()) / seconds_per_byte
        tflops = {dtype: sum(prefill_mix.values()) / seconds_per_flop}
        names = "+".join(code.name for code in mix)
        source = f"measured by tandem plan: the integer-dot kernel on {names}"
        measured = step_overheads(gguf, sorted({1, batch}), prompt_len, bandwidth, tflops[dtype])
        overheads = measured or {}
    else:
        tflops = {dtype: matmul_tflops(computed)}
        bandwidth = memory_bandwidth_gbs()
        source = "measured by tandem plan"
    # Ranks on this host meet in shared memory: a wait, then a copy at about the rate
    # memory is read.
    return Hardware(
        name, memory_gb, bandwidth, tflops, source, attention, kv_read,
        link_gbs=bandwidth, link_latency_us=SHARED_MEMORY_ALLREDUCE_US,
        step_overheads=overheads,
    )  # fmt: skip


# One all-reduce of a token's hidden state between two ranks of a host in shared memory
# (runner/shm_group.py), as benchmarks/tensor_parallel.py measured it on a 2-vCPU EPYC:
# 15-33 us (`--link-latency-us` for another host's figure).
SHARED_MEMORY_ALLREDUCE_US = 25.0
MAX_MEASURED_PARAMS = 2e9  # a random-weight model this size takes minutes to build here
ENGINE_DTYPES = {"fp32": "float32", "bf16": "bfloat16"}  # what the CPU engine runs in


def engine_dtype(dtype: str) -> str:
    """The torch dtype tandem runs a model stored as ``dtype`` in on the CPU: float32 or
    bfloat16 as asked; fp16 (no CPU kernels) and the quantized types compute in
    float32."""
    return ENGINE_DTYPES.get(dtype, "float32")


def check_measurable(config_path, dtype: str) -> None:
    """Refuse, before anything is measured, a model this machine cannot run: too many
    parameters to build with random weights, or weights (in the dtype it would run in;
    a GGUF file's as packed) beyond 80% of the RAM."""
    from tandem.plan.calculator import FILE_DTYPE, file_weights, gguf_path, read_model

    if dtype == FILE_DTYPE:  # the file itself is loaded: no random weights to build
        weight_bytes = file_weights(gguf_path(config_path)).held_bytes
    else:
        _, params = read_model(config_path)
        if params > MAX_MEASURED_PARAMS:
            raise InvalidParameterError(
                "--measure", f"{params / 1e9:.1f}B parameters is too many to run here (at "
                f"most {MAX_MEASURED_PARAMS / 1e9:.0f}B)",
            )  # fmt: skip
        weight_bytes = params * (2 if engine_dtype(dtype) == "bfloat16" else 4)
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if weight_bytes > 0.8 * memory:
        raise InvalidParameterError(
            "--measure", f"the weights take {weight_bytes / 1e9:.1f} GB in "
            f"{engine_dtype(dtype)}, more than 80% of this machine's {memory / 1e9:.1f} GB",
        )  # fmt: skip


def measure_model(config_path, result: dict, decode_steps: int = 8) -> dict[str, float]:
    """Run tandem on this machine with the model's architecture (random weights, CPU,
    in ``engine_dtype``; a GGUF file's own weights): one prompt of ``prompt_len``
    tokens, then ``batch`` sequences decoding; the achieved times beside the floors in
    ``result`` (a plan made with this machine's hardware, measured in the same dtype)."""
    from tandem.models.loader import load_model
    from tandem.plan.calculator import FILE_DTYPE, decode_step_seconds

    check_measurable(config_path, result["dtype"])
    path = Path(config_path)
    if result["dtype"] == FILE_DTYPE:  # the file itself, its weights packed as it runs
        loaded = load_model(path, load_tokenizer=False)
    else:
        raw = json.loads((path / "config.json" if path.is_dir() else path).read_text())
        loaded = random_model(raw, dtype=engine_dtype(result["dtype"]))
    vocab = loaded.config.vocab_size
    prompt_len, batch = result["prompt_len"], result["batch"]
    prompt = [(7 * i) % vocab for i in range(prompt_len)]

    def run_once() -> tuple[float, float]:
        start = time.perf_counter()
        next(stream_with_cache(loaded, [prompt], 1))
        prefill = time.perf_counter() - start
        steps = stream_with_cache(loaded, [prompt] * batch, decode_steps + 2)
        next(steps)  # the prefill
        next(steps)
        times = []
        for _ in range(decode_steps):
            start = time.perf_counter()
            next(steps)
            times.append(time.perf_counter() - start)
        return prefill, statistics.median(times)

    with torch.inference_mode():
        run_once()  # the first run pays for page faults and kernel caches
        prefill, step = run_once()
    # The decode floor at the measured context (prompt + a few tokens), not the mean.
    floor = decode_step_seconds(
        result["weight_bytes_read_per_step"], batch, prompt_len, result["kv_bytes_per_token"],
        result["bandwidth_gbs"], result["kv_bandwidth_gbs"],
    )  # fmt: skip
    floor = max(floor, result["decode_step_compute_s"])
    return {
        "prefill_s": prefill,
        "prefill_of_floor": result["prefill_floor_s"] / prefill,
        "decode_step_s": step,
        "decode_of_floor": floor / step,
        "tokens_per_s": batch / step,
    }
