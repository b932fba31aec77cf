"""GGUF block matrices with each block's fields split into arrays of their own: the
layout a GPU kernel reads with wide, coalesced loads (runner/linear/triton_blocks.py
multiplies them), holding the file's bytes (Q4_K / Q5_K: 1/36 and 1/44 more, their
6-bit sub-scales a byte each).

``BlockWeight``: Q4_0 and Q8_0, as the file lays out their values; IQ4_NL as Q8_0,
its values its table's int8 levels.

    Q4_0  values uint8 [N, K/2]: byte j of a 32-weight block holds weight j (low
          nibble) and weight j + 16 (high nibble), as in the file; scales fp16 [N, K/32]
    Q8_0  values int8 [N, K]; scales fp16 [N, K/32]

``SuperBlockWeight``: every other block format (Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K,
Q3_K, the ternary types, MXFP4, IQ4_XS) in one layout, read by one kernel. Each weight is

    w = d * sub * (q - offset) + dm * sub_min

with ``q`` the weight's 4 to 8 bits (IQ4_XS: its int8 level + 128, offset 128), ``d``
and ``dm`` float16 per super-block of ``super`` weights (32 for the 32-weight formats,
256 for the K formats), ``sub`` and ``sub_min`` integers per group of ``group``
weights (the K formats; 1 elsewhere), ``dm`` absent for formats without a minimum. The
arrays:

    low      uint8 [N, K/2]: q's low 4 bits; byte c of each 64-weight chunk holds
             weight c (low nibble) and weight c + 32 (high nibble): the byte pairs
             the same slot of a chunk's two halves, as Q4_K's file does
    high     uint8 [N, K*hb/8] (hb = 1, 2 or 4 high bits a weight; None for 4-bit
             formats): p = 8 / (2 hb) slots a byte, byte b holding slots p b to
             p b + p - 1 from its low bits up, a slot's two weights' high bits side
             by side (the first half's weight lowest)
    d, dm    float16 [N, K/super]   (dm: the minimum's factor, signed as it adds;
             a K format's -dmin); the codebook i-quants' d float32, times their
             power of two (1/4, 1/8: SuperScales.factor), which a float16 may not hold
    sub      int8 [N, K/group];  sub_min  int8 [N, K/group]

The values are moved into that layout at load (``from_ggml``); every factor keeps
the file's bits, and ``dequantize`` multiplies them in the order the ``gguf``
package does, so the two agree bit for bit.

The loader puts them on Linear layers as ``block_parts`` (first output row, weight),
one per checkpoint tensor, as it puts PackedWeight parts for the CPU kernels.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from tandem.quant.blocks import BLOCK, GGMLType, SuperFormat, decode
from tandem.quant.blocks import FORMATS as BLOCK_FORMATS

# BlockWeight's formats and bits a value; SuperBlockWeight's formats and formulas.
FORMATS = {code: f.split for code, f in BLOCK_FORMATS.items() if isinstance(f.split, int)}
SUPER_FORMATS = {
    code: f.split for code, f in BLOCK_FORMATS.items() if isinstance(f.split, SuperFormat)
}
GROUP = 32  # weights per block (and per scale)
CHUNK = 64  # SuperBlockWeight: weights whose low nibbles share 32 bytes
CONVERT_ROWS = 1024  # rows of a SuperBlockWeight converted from the file's blocks at a time


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


@dataclass
class BlockWeight:
    values: torch.Tensor  # Q4_0: uint8 [N, K/2]; Q8_0: int8 [N, K]
    scales: torch.Tensor  # float16 [N, K/32]
    bits: int
    columns: int

    @property
    def rows(self) -> int:
        return self.values.shape[0]

    @property
    def nbytes(self) -> int:
        return _nbytes([self.values, self.scales])

    @classmethod
    def from_ggml(cls, code: GGMLType, raw: torch.Tensor, device: torch.device) -> BlockWeight:
        """raw: uint8 [N, row bytes] as the file stores the blocks (IQ4_NL: its values
        are its table's int8 levels, laid out as Q8_0's)."""
        weights, size = BLOCK[code]
        rows = raw.shape[0]
        if code not in (GGMLType.Q4_0, GGMLType.Q8_0):
            dec = decode(code, raw, raw.shape[1] // size * weights)
            values, scales = dec.values.view(torch.int8), dec.scales.half()
            return cls(values.to(device), scales.to(device), FORMATS[code], values.shape[1])
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


def kept_in_blocks(code: int, columns: int) -> bool:
    """Whether a GPU keeps a matrix of this type and width in its blocks (else it is
    widened at load): Q4_0 and Q8_0 always, the other block formats in whole 64-weight
    chunks."""
    return code in FORMATS or (code in SUPER_FORMATS and columns % CHUNK == 0)


@dataclass
class SuperBlockWeight:
    """A matrix of one of SUPER_FORMATS in the layout the module's docstring gives."""

    code: GGMLType
    low: torch.Tensor  # uint8 [N, K/2]
    high: torch.Tensor | None  # uint8 [N, K*hb/8]
    d: torch.Tensor  # float16 [N, K/super] (float32: the codebook i-quants')
    sub: torch.Tensor | None  # int8 [N, K/group]
    dm: torch.Tensor | None  # float16 [N, K/super]
    sub_min: torch.Tensor | None  # int8 [N, K/group] (K formats with a minimum)
    columns: int

    @property
    def rows(self) -> int:
        return self.low.shape[0]

    @property
    def nbytes(self) -> int:
        return _nbytes(self.fields())

    @property
    def format(self) -> SuperFormat:
        return SUPER_FORMATS[self.code]

    def fields(self) -> tuple[torch.Tensor | None, ...]:
        return self.low, self.high, self.d, self.sub, self.dm, self.sub_min

    @classmethod
    def from_ggml(
        cls, code: GGMLType, raw: torch.Tensor, columns: int, device: torch.device
    ) -> SuperBlockWeight:
        """raw: uint8 [N, row bytes] as the file stores the blocks. Converted
        CONVERT_ROWS rows at a time into the fields on ``device``: decoding takes some
        13 bytes of temporaries a weight's byte (a Q6_K matrix of 32,768 x 4,096 rose
        the peak by 1.45 GB whole), so a large matrix is never decoded whole."""
        if columns % CHUNK:
            raise ValueError(f"{columns} columns are not whole {CHUNK}-weight chunks")
        rows = raw.shape[0]
        fields: list[torch.Tensor | None] = []
        for first in range(0, rows, CONVERT_ROWS):
            part = _super_fields(code, raw[first : first + CONVERT_ROWS], columns)
            if not fields:
                fields = [None if p is None else p.new_empty((rows, *p.shape[1:]), device=device)
                          for p in part]  # fmt: skip
            for field, p in zip(fields, part, strict=True):
                if p is not None:
                    field[first : first + len(p)] = p
        return cls(code, *fields, columns)

    def values(self, rows: slice = slice(None)) -> torch.Tensor:
        """q, uint8 [rows, K] in the columns' order."""
        low = self.low[rows]
        n = low.shape[0]
        slots = low.reshape(n, -1, CHUNK // 2)
        q = torch.stack([slots & 15, slots >> 4], dim=2)  # [N, chunks, half, slot]
        if self.high is not None:
            hb = self.format.high_bits
            per_byte = 8 // (2 * hb)
            shifts = torch.arange(per_byte, device=low.device, dtype=torch.uint8) * (2 * hb)
            slot = (self.high[rows].unsqueeze(-1) >> shifts).reshape(n, -1, CHUNK // 2)
            mask = (1 << hb) - 1
            high = torch.stack([slot & mask, (slot >> hb) & mask], dim=2)
            q = q | (high << 4)
        return q.reshape(n, -1)

    def dequantize(self, dtype: torch.dtype, rows: slice = slice(None)) -> torch.Tensor:
        """[rows, K] in ``dtype``: float32 products in the gguf package's order, then
        rounded once (torch ops: the reference, and the prefill path)."""
        spec = self.format
        q = self.values(rows).float()
        n = q.shape[0]
        scales = self.d[rows].float()
        if spec.has_sub:
            scales = scales.repeat_interleave(spec.super // spec.group, 1) * self.sub[rows]
        q = q.reshape(n, -1, spec.group)
        if spec.offset:
            q = q - spec.offset
        w = scales[:, :, None] * q
        if spec.has_min:
            mins = self.dm[rows].float()
            if spec.has_sub:
                mins = mins.repeat_interleave(spec.super // spec.group, 1) * self.sub_min[rows]
            w = w + mins[:, :, None]
        return w.reshape(n, -1).to(dtype)


def _super_fields(
    code: GGMLType, raw: torch.Tensor, columns: int
) -> tuple[torch.Tensor | None, ...]:
    """Rows' blocks (uint8 [n, row bytes]) -> SuperBlockWeight's fields for them, on
    the CPU: low, high, d, sub, dm, sub_min."""
    spec = SUPER_FORMATS[code]
    dec = decode(code, raw, columns)
    rows = raw.shape[0]
    q = dec.values
    if q.dtype == torch.int8:  # (IQ4_XS's levels) held + 128, its formula's offset
        q = (q.to(torch.int16) + 128).to(torch.uint8)
    q = q.reshape(rows, -1, 2, CHUNK // 2)  # [N, chunks, half, slot]
    low = (q[:, :, 0] & 15) | ((q[:, :, 1] & 15) << 4)
    high = None
    if spec.high_bits:
        hb = spec.high_bits
        slot = (q[:, :, 0] >> 4) | ((q[:, :, 1] >> 4) << hb)  # 2*hb bits a slot
        per_byte = 8 // (2 * hb)
        slot = slot.reshape(rows, -1, per_byte).to(torch.int32)
        shifts = torch.arange(per_byte, dtype=torch.int32) * (2 * hb)
        high = (slot << shifts).sum(-1).to(torch.uint8)
    d_type = torch.float16
    if spec.has_sub:  # a K format: d per 256 times integer sub-scales
        sup = dec.supers
        d, sub = sup.d * sup.factor, sup.sub.to(torch.int8)
        if sup.factor != 1:
            d_type = torch.float32
        dm = -sup.dmin if spec.has_min else None
        sub_min = sup.sub_mins.to(torch.int8) if spec.has_min else None
    else:  # the 32-weight formats: their float16 scale and minimum
        d, sub, dm, sub_min = dec.scales, None, dec.mins, None

    def put(t: torch.Tensor | None, dtype: torch.dtype | None = None) -> torch.Tensor | None:
        if t is None:
            return None
        return t.reshape(rows, -1).to(dtype or t.dtype).contiguous()

    half = torch.float16
    return put(low), put(high), put(d, d_type), put(sub), put(dm, half), put(sub_min)


SplitWeight = BlockWeight | SuperBlockWeight


def from_ggml(code: GGMLType, raw: torch.Tensor, columns: int, device: torch.device) -> SplitWeight:
    """A matrix's blocks (``kept_in_blocks``) in the split layout of its format."""
    if code in FORMATS:
        return BlockWeight.from_ggml(code, raw, device)
    return SuperBlockWeight.from_ggml(code, raw, columns, device)


def _joined(last: SplitWeight, weight: SplitWeight) -> SplitWeight | None:
    """One matrix of two of one format, rows of ``last`` first; None for two formats."""
    if isinstance(last, BlockWeight) and isinstance(weight, BlockWeight):
        if last.bits != weight.bits:
            return None
        values = torch.cat([last.values, weight.values])
        return BlockWeight(values, torch.cat([last.scales, weight.scales]), last.bits, last.columns)
    if isinstance(last, SuperBlockWeight) and isinstance(weight, SuperBlockWeight):
        if last.code != weight.code:
            return None
        fields = [None if a is None else torch.cat([a, b])
                  for a, b in zip(last.fields(), weight.fields(), strict=True)]  # fmt: skip
        return SuperBlockWeight(last.code, *fields, last.columns)
    return None


def join(parts: list[tuple[int, SplitWeight]]) -> list[tuple[int, SplitWeight]]:
    """Adjacent parts of one format (q, k and v; gate and up) as one matrix."""
    joined: list[tuple[int, SplitWeight]] = []
    for start, weight in parts:
        if joined:
            first, last = joined[-1]
            both = _joined(last, weight) if first + last.rows == start else None
            if both is not None:
                joined[-1] = (first, both)
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
