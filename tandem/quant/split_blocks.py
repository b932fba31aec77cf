"""GGUF Q4_0 / Q8_0 matrices with each block's fields split into two arrays: the
layout a GPU kernel reads with wide, coalesced loads, holding the same bytes as the
file (runner/linear/triton_blocks.py multiplies them).

    Q4_0  values uint8 [N, K/2]: byte j of a 32-weight block holds weight j (low
          nibble) and weight j + 16 (high nibble), as in the file; scales fp16 [N, K/32]
    Q8_0  values int8 [N, K]; scales fp16 [N, K/32]

The loader puts them on Linear layers as ``block_parts`` (first output row, weight),
one per checkpoint tensor, as it puts PackedWeight parts for the CPU kernels.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from tandem.quant.blocks import BLOCK, GGMLType

FORMATS = {GGMLType.Q4_0: 4, GGMLType.Q8_0: 8}  # the formats split so, and bits a value
GROUP = 32  # weights per block (and per scale)


@dataclass
class BlockWeight:
    values: torch.Tensor  # Q4_0: uint8 [N, K/2]; Q8_0: int8 [N, K]
    scales: torch.Tensor  # float16 [N, K/32]
    bits: int
    columns: int

    @property
    def rows(self) -> int:
        return self.values.shape[0]

    @classmethod
    def from_ggml(cls, code: GGMLType, raw: torch.Tensor, device: torch.device) -> BlockWeight:
        """raw: uint8 [N, row bytes] as the file stores the blocks."""
        weights, size = BLOCK[code]
        rows = raw.shape[0]
        blocks = raw.reshape(rows, -1, size)
        scales = blocks[:, :, :2].contiguous().view(torch.float16).reshape(rows, -1)
        values = blocks[:, :, 2:].reshape(rows, -1)
        if code == GGMLType.Q8_0:
            values = values.view(torch.int8)
        columns = blocks.shape[1] * weights
        return cls(values.to(device), scales.to(device), FORMATS[code], columns)

    def dequantize(self, dtype: torch.dtype, rows: slice = slice(None)) -> torch.Tensor:
        """[rows, K] in ``dtype`` (torch ops: the reference, and the prefill path)."""
        values, scales = self.values[rows], self.scales[rows]
        if self.bits == 8:
            q = values.to(dtype).view(values.shape[0], -1, GROUP)
        else:
            packed = values.view(values.shape[0], -1, GROUP // 2)
            q = torch.cat([packed & 15, packed >> 4], dim=-1).to(dtype) - 8
        return (q * scales.to(dtype)[:, :, None]).reshape(values.shape[0], -1)


def join(parts: list[tuple[int, BlockWeight]]) -> list[tuple[int, BlockWeight]]:
    """Adjacent parts of one format (q, k and v; gate and up) as one matrix."""
    joined: list[tuple[int, BlockWeight]] = []
    for start, weight in parts:
        if joined:
            first, last = joined[-1]
            if last.bits == weight.bits and first + last.rows == start:
                joined[-1] = (first, BlockWeight(
                    torch.cat([last.values, weight.values]),
                    torch.cat([last.scales, weight.scales]), last.bits, last.columns,
                ))  # fmt: skip
                continue
        joined.append((start, weight))
    return joined


def runs_on(device: torch.device) -> bool:
    """Whether the kernels for split blocks (Triton, on CUDA) run on ``device``."""
    from tandem.kernels.triton_support import triton

    return device.type == "cuda" and triton is not None


def add_block_part(layer: nn.Module, row_start: int, weight: BlockWeight) -> None:
    parts = getattr(layer, "block_parts", [])
    parts.append((row_start, weight))
    layer.block_parts = parts


def block_parts(layer: nn.Module) -> list[tuple[int, BlockWeight]]:
    return getattr(layer, "block_parts", [])
