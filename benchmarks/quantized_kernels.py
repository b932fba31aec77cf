"""The quantized linear kernel alone: every linear layer of a SmolLM2-135M-shaped model
(30 layers of q/k/v, o, gate/up, down; random valid blocks) multiplied in model order,
per format and batch size, as GB/s of the packed weights streamed.

    python -m benchmarks.quantized_kernels [--formats Q4_1 Q4_0 Q8_0 Q5_0 Q5_1]

(The K formats need rows of whole 256-weight super-blocks; SmolLM2's 576 is not.)

Weights are far larger than the caches (30 layers), so T=1 is a bandwidth figure:
compare it with the machine's read bandwidth (printed). Medians of 25 passes.
"""

from __future__ import annotations

import argparse

import numpy as np
import torch

from benchmarks.common import machine
from tandem.plan.measure import median_time, memory_bandwidth_gbs
from tandem.quant.blocks import BLOCK, GGMLType
from tandem.quant.packed import PackedWeight

# (out, in) of each linear layer of one SmolLM2-135M layer: qkv, o, gate_up, down.
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]


def random_packed(code: GGMLType, rows: int, columns: int, rng) -> PackedWeight:
    per_block, nbytes = BLOCK[code]
    raw = rng.integers(0, 256, size=(rows, columns // per_block, nbytes), dtype=np.uint8)
    offsets = (0, 2) if code in (GGMLType.Q4_1, GGMLType.Q5_1) else (0,)
    for offset in offsets:
        scale = rng.uniform(-1e-3, 1e-3, size=raw.shape[:2]).astype(np.float16)
        raw[..., offset : offset + 2] = scale.view(np.uint8).reshape(*raw.shape[:2], 2)
    return PackedWeight.from_ggml(code, torch.from_numpy(raw.reshape(rows, -1)), columns)


def median_pass_seconds(layers: list[list[PackedWeight]], tokens: int) -> float:
    inputs = {k: torch.randn(tokens, k) for k in (576, 1536)}
    outs = [torch.empty(tokens, n) for n, _ in SHAPES]

    def one_pass() -> None:
        for layer in layers:
            for packed, (_, k), out in zip(layer, SHAPES, outs, strict=True):
                packed.matmul(inputs[k], out)

    return median_time(one_pass, 25, warmup=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--formats", nargs="+", default=["Q4_1", "Q4_0", "Q8_0", "Q5_0"])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16, 128])
    args = parser.parse_args()
    print(f"machine: {machine()}; read bandwidth {memory_bandwidth_gbs():.1f} GB/s\n")
    print(f"{'format':<8}{'bits/w':>7}{'tokens':>8}{'ms':>9}{'GB/s':>7}{'tok/s':>9}")
    rng = np.random.default_rng(0)
    for name in args.formats:
        code = GGMLType[name]
        layers = [[random_packed(code, n, k, rng) for n, k in SHAPES] for _ in range(30)]
        nbytes = sum(p.nbytes for layer in layers for p in layer)
        weights = 30 * sum(n * k for n, k in SHAPES)
        for tokens in args.batch:
            seconds = median_pass_seconds(layers, tokens)
            print(
                f"{name:<8}{nbytes * 8 / weights:>7.2f}{tokens:>8}{seconds * 1e3:>9.2f}"
                f"{nbytes / seconds / 1e9:>7.1f}{tokens / seconds:>9.0f}"
            )


if __name__ == "__main__":
    main()
