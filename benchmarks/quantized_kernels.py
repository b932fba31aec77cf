"""The quantized linear kernel alone: every linear layer of a model's shape (q/k/v,
o, gate/up, down of each layer; random valid blocks) multiplied in model order, per
format and batch size, as GB/s of the packed weights streamed.

    python -m benchmarks.quantized_kernels [--formats Q4_1 Q4_0 Q8_0 Q5_0 Q5_1]
    python -m benchmarks.quantized_kernels --shape llama-3.2-1b --formats Q4_0 Q4_K Q6_K

(The K formats need rows of whole 256-weight super-blocks: SmolLM2's 576 is not, the
1B shape's 2048 is.) Weights are far larger than the caches, so T=1 is a bandwidth
figure: compare it with the machine's read bandwidth (printed). Medians of 25 passes.

    python -m benchmarks.quantized_kernels --shape llama-3.2-1b --against HEAD~1
    python -m benchmarks.quantized_kernels --shape llama-3.2-1b --formats Q2_K Q3_K --layouts

compares the working tree's kernel with quant_ops.cpp as it was at a git revision:
both are built (alone, as their own modules), run alternately in one process, and
their outputs compared bit for bit; each line gives both medians and the median of
the rounds' time ratios (old / new: above 1, the working tree is faster).
``--cflags "-mno-avx512f -mno-avxvnni"`` builds both sides with those flags too (the
AVX2 path, on a machine that has AVX-512). ``--layouts`` instead compares, with this
build, the compact formats (Q2_K, Q3_K, the ternary and table formats: FORMATS'
compact_bits) packed wide (nibbles and int8 levels, the AVX-512 builds' layouts) and
compact, alternating: wide / compact time, above 1 the compact layout is faster; and
the codebook types, their values decoded once into int8 (wide) against their blocks
decoded a tile at a time as they are multiplied (compact).
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from benchmarks.common import add_against_arguments, alternating, kernel_sides, machine
from tandem.models import random_gguf
from tandem.plan.measure import median_time, memory_bandwidth_gbs
from tandem.quant.blocks import BLOCK, FORMATS, GGMLType, decode
from tandem.quant.packed import PackedWeight

# Layers, and (out, in) of each linear layer of one layer: qkv, o, gate_up, down.
SHAPES = {
    "smollm2-135m": (30, [(960, 576), (576, 576), (3072, 576), (576, 1536)]),
    "llama-3.2-1b": (16, [(3072, 2048), (2048, 2048), (16384, 2048), (2048, 8192)]),
    # 8 of Llama-3.1-8B's 32 layers: 1.75B weights, far past the caches.
    "llama-3.1-8b": (8, [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]),
}


def random_packed(code: GGMLType, rows: int, columns: int, rng) -> PackedWeight:
    raw = random_gguf.random_blocks(code, rows, columns, rng)  # valid blocks of any format
    return PackedWeight.from_ggml(code, torch.from_numpy(raw), columns)


def model_pass(layers: list[list[PackedWeight]], shapes, inputs, outs, kernels) -> None:
    """Every layer's matrices in model order, on ``kernels``' quant_linear (a build of
    quant_ops.cpp; one from before its ``factor`` and ``table`` arguments, 2026-12-07,
    without them: the old side of a comparison packs its table formats as int8)."""
    doc = kernels.quant_linear.__doc__
    count = 2 if "arg10" in doc else 1 if "arg9" in doc else 0  # (factor, table)
    for layer in layers:
        for w, (_, k), out in zip(layer, shapes, outs, strict=True):
            args = (out, inputs[k], w.values, w.scales, w.corr, None, w.rows, w.group, w.offset)
            kernels.quant_linear(*args, *[w.factor, w.table][:count])


def median_pass_seconds(layers: list[list[PackedWeight]], shapes, tokens: int) -> float:
    from tandem.kernels import cpu as cpu_kernels

    inputs = {k: torch.randn(tokens, k) for _, k in shapes}
    outs = [torch.empty(tokens, n) for n, _ in shapes]
    kernels = cpu_kernels.load()
    return median_time(lambda: model_pass(layers, shapes, inputs, outs, kernels), 25, warmup=1)


def compare(layers, shapes, tokens: int, old, new, rounds: int = 7) -> str:
    """The old kernel against the new on the same inputs, alternating."""
    inputs = {k: torch.randn(tokens, k) for _, k in shapes}
    outs = {id(m): [torch.empty(tokens, n) for n, _ in shapes] for m in (old, new)}

    def one_pass(module) -> float:
        started = time.perf_counter()
        model_pass(layers, shapes, inputs, outs[id(module)], module)
        return time.perf_counter() - started

    one_pass(old), one_pass(new)
    equal = all(map(torch.equal, outs[id(old)], outs[id(new)]))
    before, after, ratio = alternating(lambda: one_pass(old), lambda: one_pass(new), rounds)
    same = "equal" if equal else "NOT equal"
    return f"{before * 1e3:>9.2f}{after * 1e3:>9.2f}{ratio:>8.2f}x  outputs {same}"


def compare_layouts(code: GGMLType, shapes, count: int, tokens_list, rounds: int = 7) -> None:
    """``code`` packed wide and compact (packed.kernels_read_compact forced each way; a
    codebook type's values decoded once into int8, or its blocks), the same blocks,
    alternating on this build's kernel."""
    from tandem.kernels import cpu as cpu_kernels
    from tandem.quant import packed

    def wide_codebook(rows: int, columns: int, rng) -> PackedWeight:
        raw = torch.from_numpy(random_gguf.random_blocks(code, rows, columns, rng))
        return PackedWeight.from_decoded(decode(code, raw, columns), code.name)

    kernels, read = cpu_kernels.load(), packed.kernels_read_compact
    sides = {}
    try:
        for compact in (False, True):
            packed.kernels_read_compact = lambda compact=compact: compact
            rng = np.random.default_rng(0)
            pack = wide_codebook if FORMATS[code].codebook and not compact else (
                lambda n, k, rng: random_packed(code, n, k, rng))  # fmt: skip
            sides[compact] = [[pack(n, k, rng) for n, k in shapes] for _ in range(count)]
    finally:
        packed.kernels_read_compact = read
    for tokens in tokens_list:
        inputs = {k: torch.randn(tokens, k) for _, k in shapes}
        outs = {c: [torch.empty(tokens, n) for n, _ in shapes] for c in sides}

        def one_pass(compact: bool, inputs=inputs, outs=outs) -> float:
            started = time.perf_counter()
            model_pass(sides[compact], shapes, inputs, outs[compact], kernels)
            return time.perf_counter() - started

        one_pass(False), one_pass(True)
        equal = all(map(torch.equal, outs[False], outs[True]))
        wide, compact, ratio = alternating(lambda: one_pass(False), lambda: one_pass(True), rounds)
        print(f"{code.name:<8}{tokens:>8}{wide * 1e3:>9.2f}{compact * 1e3:>9.2f}{ratio:>8.2f}x"
              f"  outputs {'equal' if equal else 'NOT equal'}", flush=True)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--formats", nargs="+", default=["Q4_1", "Q4_0", "Q8_0", "Q5_0"])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16, 128])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="smollm2-135m")
    parser.add_argument("--layouts", action="store_true", help="wide against compact layouts")
    add_against_arguments(parser)
    args = parser.parse_args()
    count, shapes = SHAPES[args.shape]
    for name in args.formats:  # named before anything is built or compiled
        if name not in GGMLType.__members__ or GGMLType[name] not in BLOCK:
            parser.error(f"--formats: {name} is not a block format")
        per_block = BLOCK[GGMLType[name]][0]
        if any(k % per_block for _, k in shapes):
            parser.error(f"--formats: {name} needs rows of whole {per_block}-weight blocks; "
                         f"{args.shape}'s {sorted({k for _, k in shapes})} are not")  # fmt: skip
    if args.layouts:
        print(f"machine: {machine()}\n\n{'format':<8}{'tokens':>8}{'wide ms':>9}"
              f"{'compact':>9}{'w/c':>8}")  # fmt: skip
        for name in args.formats:
            if not (FORMATS[GGMLType[name]].compact_bits or FORMATS[GGMLType[name]].codebook):
                parser.error(f"--layouts: {name} has no compact layout")
            compare_layouts(GGMLType[name], shapes, count, args.batch)
        return
    old, new = kernel_sides(args, "quant_ops.cpp", ["quant_linear"])
    print(f"machine: {machine()}; read bandwidth {memory_bandwidth_gbs():.1f} GB/s\n")
    if old is not None:
        print(f"{'format':<8}{'tokens':>8}{'old ms':>9}{'new ms':>9}{'old/new':>8}")
    else:
        print(f"{'format':<8}{'bits/w':>7}{'tokens':>8}{'ms':>9}{'GB/s':>7}{'tok/s':>9}")
    rng = np.random.default_rng(0)
    for name in args.formats:
        code = GGMLType[name]
        layers = [[random_packed(code, n, k, rng) for n, k in shapes] for _ in range(count)]
        nbytes = sum(p.nbytes for layer in layers for p in layer)
        weights = count * sum(n * k for n, k in shapes)
        for tokens in args.batch:
            if old is not None:
                print(
                    f"{name:<8}{tokens:>8}{compare(layers, shapes, tokens, old, new)}", flush=True
                )
                continue
            seconds = median_pass_seconds(layers, shapes, tokens)
            print(
                f"{name:<8}{nbytes * 8 / weights:>7.2f}{tokens:>8}{seconds * 1e3:>9.2f}"
                f"{nbytes / seconds / 1e9:>7.1f}{tokens / seconds:>9.0f}"
            )


if __name__ == "__main__":
    main()
