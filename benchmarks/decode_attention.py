"""The CPU decode-attention kernel against the memory-bandwidth floor: one sequence at
several depths, the K/V of every layer read once per step, for a model's head shape.
Bytes read over time is the kernel's achieved bandwidth; beside it, the machine's read
bandwidth (tandem.plan.measure: the faster of a 1 GiB sum and the read probe). Blocks
are scattered in a pool twice as large as the context (as in a serving cache), so
nothing stays in cache between layers.

    python -m benchmarks.decode_attention [--depths 2048 8192 32768] [--threads 1 2]

``--against REVISION`` times cpu_ops.cpp as it was at a git revision (built alone, as
a module of its own) against the working tree's, alternating on the same caches: each
line gives both medians and the median of the rounds' ratios (old / new: above 1, the
working tree is faster), and whether the outputs agree to float32 rounding.
``--cflags "-mno-avx512f -mno-avxvnni"`` builds both sides with those flags too (the
AVX2 path, on a machine that has AVX-512).
"""

from __future__ import annotations

import argparse
import time

import torch

from benchmarks.common import add_against_arguments, alternating, kernel_sides, machine
from tandem.kernels import cpu as cpu_kernels
from tandem.plan.measure import decode_attention_seconds, memory_bandwidth_gbs, paged_caches

SHAPES = {  # heads, KV heads, head size, layers
    "smollm2-135m": (9, 3, 64, 30),
    "llama-3.2-1b": (32, 8, 64, 16),
    "qwen3-30b-a3b": (32, 4, 128, 48),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--depths", type=int, nargs="+", default=[2048, 8192, 32768])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--kv-dtypes", nargs="+", default=["auto", "bfloat16", "int8"])
    add_against_arguments(parser)
    args = parser.parse_args()
    if cpu_kernels.load() is None:
        raise SystemExit("the CPU kernels could not be built here")
    old, new = kernel_sides(args, "cpu_ops.cpp", ["decode_attention"])
    floor = memory_bandwidth_gbs()
    print(f"# {machine()}\n# read bandwidth {floor:.1f} GB/s (tandem.plan.measure)")
    if old is not None:
        print("| shape | KV | depth | threads | old ms | new ms | old / new | outputs |")
    else:
        print("| shape | KV | depth | threads | ms / step (all layers) | GB/s | of the floor |")
    print("|---|---|---|---|---|---|---|" + ("---|" if old is not None else ""))
    for name, (heads, kv_heads, head_dim, layers) in SHAPES.items():
        q = torch.randn(1, heads, head_dim)
        for kv_dtype in args.kv_dtypes:
            for depth in args.depths:
                caches, table, layer_bytes = paged_caches(
                    kv_dtype, depth, kv_heads, head_dim, layers
                )
                lens = torch.tensor([depth])
                for threads in args.threads:
                    torch.set_num_threads(threads)
                    if old is not None:
                        figures = compare(old, new, caches, q, table, lens, head_dim**-0.5)
                        print(f"| {name} | {kv_dtype} | {depth} | {threads} | {figures} |")
                        continue
                    seconds = decode_attention_seconds(caches, q, table, lens, head_dim**-0.5)
                    rate = layer_bytes * layers / seconds / 1e9
                    print(
                        f"| {name} | {kv_dtype} | {depth} | {threads} | {seconds * 1e3:.2f} "
                        f"| {rate:.1f} | {rate / floor:.0%} |",
                        flush=True,
                    )


def compare(old, new, caches, q, table, lens, scale: float, rounds: int = 15) -> str:
    """The old kernel against the new on the same caches, alternating: a step (every
    layer's call) of each per round."""
    outs = {id(old): torch.empty_like(q), id(new): torch.empty_like(q)}
    no_sinks = torch.empty(0, dtype=torch.float32)

    def call(module, *args) -> None:
        try:
            module.decode_attention(*args, no_sinks)
        except TypeError:  # a build from before the kernels took attention sinks
            module.decode_attention(*args)

    def step(module) -> float:
        started = time.perf_counter()
        for cache in caches:
            call(module, outs[id(module)], q, cache[0], cache[1], table, lens, scale, 0)
        return time.perf_counter() - started

    step(old), step(new)
    agree = torch.allclose(outs[id(old)], outs[id(new)], rtol=1e-4, atol=1e-6)
    before, after, ratio = alternating(lambda: step(old), lambda: step(new), rounds)
    outputs = "agree" if agree else "DIFFER"
    return f"{before * 1e3:.2f} | {after * 1e3:.2f} | {ratio:.2f}x | {outputs}"


if __name__ == "__main__":
    main()
