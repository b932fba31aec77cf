"""The quantized linear kernel alone: every linear layer of a model's shape (q/k/v,
o, gate/up, down of each layer; random valid blocks) multiplied in model order, per
format and batch size, as GB/s of the packed weights streamed.

    python -m benchmarks.quantized_kernels [--formats Q4_1 Q4_0 Q8_0 Q5_0 Q5_1]
    python -m benchmarks.quantized_kernels --shape llama-3.2-1b --formats Q4_0 Q4_K Q6_K

(The K formats need rows of whole 256-weight super-blocks: SmolLM2's 576 is not, the
1B shape's 2048 is.) Weights are far larger than the caches, so T=1 is a bandwidth
figure: compare it with the machine's read bandwidth (printed). Medians of 25 passes.
"""

from __future__ import annotations

import argparse

import numpy as np
import torch

from benchmarks.common import machine
from tandem.models import random_gguf
from tandem.plan.measure import median_time, memory_bandwidth_gbs
from tandem.quant.blocks import GGMLType
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


def median_pass_seconds(layers: list[list[PackedWeight]], shapes, tokens: int) -> float:
    inputs = {k: torch.randn(tokens, k) for _, k in shapes}
    outs = [torch.empty(tokens, n) for n, _ in shapes]

    def one_pass() -> None:
        for layer in layers:
            for packed, (_, k), out in zip(layer, shapes, outs, strict=True):
                packed.matmul(inputs[k], out)

    return median_time(one_pass, 25, warmup=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--formats", nargs="+", default=["Q4_1", "Q4_0", "Q8_0", "Q5_0"])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16, 128])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="smollm2-135m")
    args = parser.parse_args()
    count, shapes = SHAPES[args.shape]
    print(f"machine: {machine()}; read bandwidth {memory_bandwidth_gbs():.1f} GB/s\n")
    print(f"{'format':<8}{'bits/w':>7}{'tokens':>8}{'ms':>9}{'GB/s':>7}{'tok/s':>9}")
    rng = np.random.default_rng(0)
    for name in args.formats:
        code = GGMLType[name]
        layers = [[random_packed(code, n, k, rng) for n, k in shapes] for _ in range(count)]
        nbytes = sum(p.nbytes for layer in layers for p in layer)
        weights = count * sum(n * k for n, k in shapes)
        for tokens in args.batch:
            seconds = median_pass_seconds(layers, shapes, tokens)
            print(
                f"{name:<8}{nbytes * 8 / weights:>7.2f}{tokens:>8}{seconds * 1e3:>9.2f}"
                f"{nbytes / seconds / 1e9:>7.1f}{tokens / seconds:>9.0f}"
            )


if __name__ == "__main__":
    main()
