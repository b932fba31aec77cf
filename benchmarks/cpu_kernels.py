"""tandem's compiled CPU kernels against the torch calls they replace, on one machine in
one run: the small-batch linear kernel against F.linear (all linear layers of a
SmolLM2-135M-shaped Llama, streamed in model order so no weight stays in cache), and
the row argmax against torch's, on [64, 49152] logits. These measurements set the
row limits in runner/linear/cpu_small_batch.py (MAX_ROWS).

    python -m benchmarks.cpu_kernels [--rows 1 2 4 8 16] [--repeats 5]
"""

from __future__ import annotations

import argparse
import functools

import torch
import torch.nn.functional as F

from benchmarks.common import SMOLLM2_SHAPE, machine
from tandem.kernels import cpu as cpu_kernels
from tandem.plan.measure import median_time


def layer_shapes() -> list[tuple[int, int]]:
    """(out, in) of every linear layer of the shape, the tied LM head last."""
    hidden, inter = SMOLLM2_SHAPE["hidden_size"], SMOLLM2_SHAPE["intermediate_size"]
    head_dim = hidden // SMOLLM2_SHAPE["num_attention_heads"]
    qkv = hidden + 2 * SMOLLM2_SHAPE["num_key_value_heads"] * head_dim
    layer = [(qkv, hidden), (hidden, hidden), (2 * inter, hidden), (hidden, inter)]
    return layer * SMOLLM2_SHAPE["num_hidden_layers"] + [(SMOLLM2_SHAPE["vocab_size"], hidden)]


def _run_torch(calls) -> None:
    for weight, x, _ in calls:
        F.linear(x, weight)


def _run_kernel(kernels, calls) -> None:
    for weight, x, out in calls:
        kernels.small_linear(out, x, weight, None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    kernels = cpu_kernels.load()
    if kernels is None:
        raise SystemExit("the CPU kernels could not be built here (no compiler?)")
    print(f"machine: {machine()}\n")
    print(f"{'dtype':<10}{'rows':>5}{'torch ms':>10}{'GB/s':>7}{'kernel ms':>11}{'GB/s':>7}")
    for dtype in (torch.float32, torch.bfloat16):
        weights = [torch.randn(o, i).to(dtype) for o, i in layer_shapes()]
        total = sum(w.numel() * w.element_size() for w in weights)
        for rows in args.rows:
            inputs = {w.shape[1]: torch.randn(rows, w.shape[1]).to(dtype) for w in weights}
            outs = {w.shape[0]: torch.empty(rows, w.shape[0], dtype=dtype) for w in weights}

            calls = [(w, inputs[w.shape[1]], outs[w.shape[0]]) for w in weights]
            with_torch = functools.partial(_run_torch, calls)
            with_kernel = functools.partial(_run_kernel, kernels, calls)
            ours = median_time(with_kernel, args.repeats, warmup=1)
            theirs = median_time(with_torch, args.repeats, warmup=1)
            print(
                f"{str(dtype).removeprefix('torch.'):<10}{rows:>5}{theirs * 1e3:>10.1f}"
                f"{total / theirs / 1e9:>7.1f}{ours * 1e3:>11.1f}{total / ours / 1e9:>7.1f}"
            )
    logits = torch.randn(64, SMOLLM2_SHAPE["vocab_size"])
    out = torch.empty(64, dtype=torch.long)
    theirs = median_time(lambda: logits.argmax(dim=-1), 50, warmup=1)
    ours = median_time(lambda: kernels.argmax_rows(out, logits), 50, warmup=1)
    print(f"\nargmax over [64, {logits.shape[1]}]: torch {theirs * 1e3:.2f} ms, "
          f"kernel {ours * 1e3:.2f} ms")  # fmt: skip


if __name__ == "__main__":
    main()
