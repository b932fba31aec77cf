"""Linear layers whose weights stay quantized (GGUF blocks, or quantized on load).

The loader leaves each such layer's matrices as PackedWeight parts (models/quantized.py);
this method joins parts that share a layout into one matrix (q, k and v of the same
format become one kernel call, as the fused float layer is one matmul) and multiplies
them with the integer-dot kernel (tandem/kernels/quant_ops.cpp), each part writing its
own columns of the output. Activations enter and leave in float32; a bfloat16 model
converts at the boundary.
"""

from __future__ import annotations

import torch

from tandem.kernels import cpu as cpu_kernels
from tandem.models.linear import Linear
from tandem.models.quantized import packed_parts
from tandem.quant.packed import ROWS, PackedWeight


def _joinable(a: PackedWeight, b: PackedWeight) -> bool:
    same = (a.bits, a.group, a.scales.dtype, a.corr is None, a.offset, a.record, a.factor,
            a.table) == (b.bits, b.group, b.scales.dtype, b.corr is None, b.offset, b.record,
                         b.factor, b.table)  # fmt: skip
    return same and a.rows % ROWS == 0


def _join(a: PackedWeight, b: PackedWeight) -> PackedWeight:
    corr = None
    if a.corr is not None or b.corr is not None:
        corr = torch.cat(
            [
                a.corr if a.corr is not None else torch.zeros_like(a.scales),
                b.corr if b.corr is not None else torch.zeros_like(b.scales),
            ]
        )
    return PackedWeight(
        torch.cat([a.values, b.values]),
        torch.cat([a.scales, b.scales]),
        corr,
        a.rows + b.rows,
        a.group,
        a.source if a.source == b.source else f"{a.source}+{b.source}",
        a.offset,
        a.record,
        a.factor,
        a.table,
    )


def join_parts(parts: list[tuple[int, PackedWeight]]) -> list[tuple[int, PackedWeight]]:
    """Adjacent parts in the same layout (bits a value, group size, scale type,
    constants, offset, record, factor, table) as one."""
    joined: list[tuple[int, PackedWeight]] = []
    for start, weight in parts:
        if joined and _joinable(joined[-1][1], weight):
            first, previous = joined[-1]
            if first + previous.rows == start:
                joined[-1] = (first, _join(previous, weight))
                continue
        joined.append((start, weight))
    return joined


class QuantizedLinearMethod:
    def process_weights_after_loading(self, layer: Linear) -> None:
        parts = join_parts(packed_parts(layer))
        covered = sum(weight.rows for _, weight in parts)
        if covered != layer.out_features:
            raise ValueError(f"quantized parts cover {covered} of {layer.out_features} output rows")
        if layer.bias is not None and layer.bias.dtype != torch.float32:
            layer.float_bias = layer.bias.float()
        layer.packed_parts = parts

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        # The common case first, with as little Python as possible: this runs once per
        # layer per step, and a decode step's matmuls take a few microseconds each.
        parts = layer.packed_parts
        if x.dim() == 2 and x.dtype == torch.float32 and x.stride(1) == 1 and len(parts) == 1:
            weight = parts[0][1]
            out = torch.empty(x.shape[0], weight.rows)
            kernel()(out, x, weight.values, weight.scales, weight.corr, layer.bias,
                     weight.rows, weight.group, weight.offset, weight.factor,
                     weight.table)  # fmt: skip
            return out
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if x2.dtype != torch.float32 or x2.stride(-1) != 1:
            x2 = x2.float().contiguous()
        out = torch.empty(x2.shape[0], layer.out_features, dtype=torch.float32)
        bias = getattr(layer, "float_bias", layer.bias)
        for start, weight in parts:
            end = start + weight.rows
            weight.matmul(x2, out[:, start:end], None if bias is None else bias[start:end])
        return out.to(x.dtype).reshape(*shape[:-1], layer.out_features)


def kernel():
    return cpu_kernels.load().quant_linear
