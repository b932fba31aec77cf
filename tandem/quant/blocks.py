"""llama.cpp's (GGML's) weight block formats: raw bytes -> integer values and scales.

Every quantized row of a GGUF tensor is a run of fixed-size blocks. Whatever the
format, each weight is ``w = d * (q - offset) + m`` for an integer ``q``, a float
scale ``d`` and minimum ``m`` shared by a *group* of 32 weights (16 for Q6_K), and a
format-wide constant ``offset``. ``decode`` turns the bytes into exactly that:
``Decoded(values, scales, mins, offset, group)``. The dequantizer and the kernel
packer (packed.py) both start from it, so the byte layouts live only here.

Layouts, per block (d, m, dmin: float16; all little-endian), from ggml-common.h:

    Q8_0   34 B / 32 w: d, int8 q[32]                        w = d*q
    Q4_0   18 B / 32 w: d, q[16] (low nibble: w0..15, high: w16..31)   w = d*(q-8)
    Q4_1   20 B / 32 w: d, m, q[16]                          w = d*q + m
    Q5_0   22 B / 32 w: d, qh u32 (5th bits), q[16]          w = d*(q-16)
    Q5_1   24 B / 32 w: d, m, qh, q[16]                      w = d*q + m
    Q4_K  144 B / 256 w: d, dmin, 12 B of 6-bit (scale, min) for 8 groups of 32,
                         q[128] (each 32 bytes: low nibbles one group, high the next)
                                                             w = d*sc*q - dmin*mn
    Q5_K  176 B / 256 w: as Q4_K plus qh[32] (bit g of byte i: group g's 5th bit)
    Q6_K  210 B / 256 w: ql[128], qh[64], int8 scales[16] (groups of 16), d
                                                             w = d*sc*(q-32)
    Q3_K  110 B / 256 w: hmask[32] (3rd bits), qs[64] (2-bit pairs), 12 B of 6-bit
                         scales for 16 groups of 16, d       w = d*(sc-32)*(q-4)
                         (q = the 2 low bits + 4 * the hmask bit: 0..7)
    Q2_K   84 B / 256 w: scales[16] (4-bit scale | 4-bit min << 4, groups of 16),
                         qs[64] (Q3_K's pairs), d, dmin      w = d*sc*q - dmin*mn
    TQ2_0  66 B / 256 w: qs[64] (2-bit values, Q3_K's pairs), d   w = d*(q-1)
    TQ1_0  54 B / 256 w: qs[48] (5 values a byte, base 3), qh[4] (4 a byte), d
                                                             w = d*(q-1), q in 0..2
    IQ4_NL 18 B / 32 w:  d, q[16] as Q4_0's nibbles          w = d*IQ4_NL_VALUES[q]
                         (a non-linear table of 16 int8 levels: the value is the
                         table's, an int8, and the format packs as Q8_0 does)
    IQ3_S  110 B / 256 w: d, qs[64], qh[8] (9-bit codebook indices, 4 weights each),
                         signs[32], scales[4] (4-bit s per 32)  w = d*(1+2s)*grid*sign
    IQ4_XS 136 B / 256 w: d, scales_h u16, scales_l[4] (6-bit ls for 8 groups of 32),
                         q[128] as IQ4_NL's                  w = d*(ls-32)*IQ4_NL_VALUES[q]
                         (the levels as int8 values, Q6_K's records: d and the
                         sub-scales, one a group of 16)
    MXFP4  17 B / 32 w:  e (E8M0), q[16] as Q4_0's nibbles   w = 2**(e-128) * MXFP4_VALUES[q]
                         (FP4 E2M1 values doubled, -12..12: held as Q5_0's 5-bit
                         values, offset 16, the power of two as Q5_0's float16 scale)

The other codebook types: 8 (IQ3_XXS: 4) weights an index into a grid of llama.cpp's
(gguf-py's tables), signs as 7-bit indices whose 8th bit is their parity (IQ2_XXS,
IQ2_XS, IQ3_XXS) or as plain bits (IQ2_S), a 4-bit (IQ1: 3-bit) s per 32 or 16 weights:

    IQ3_XXS  98 B: d, qs[64] (8-bit indices), 8 u32 (4 sign indices, s)
                                                   w = d*(1+2s)/4 * grid * sign
    IQ2_XXS  66 B: d, 8 u32 pairs (4 8-bit indices; 4 sign indices, s)
                                                   w = d*(1+2s)/8 * grid * sign
    IQ2_XS   74 B: d, qs[32] u16 (9-bit index, 7-bit signs), scales[8] (s per 16)
    IQ2_S    82 B: d, qs[32], signs[32], qh[8] (2 more index bits), scales[8]
    IQ1_S    50 B: d, qs[32], qh[8] u16 (3 index bits x 4, s, delta's sign) per 32
                                                   w = d*(2s+1) * (grid + delta)
    IQ1_M    56 B: qs[32], qh[16] (3 index bits, delta's sign per 8), scales[8] (3-bit
                   s per 16, d's 16 bits in the top nibbles of its four u16)

(grid: IQ3_XXS 4..62, IQ2 8, 25 or 43, IQ1 -1, 0 or 1; delta +-1/8). All are held as
IQ3_S is, int8 values under Q6_K's records (IQ1's as 8 * (grid + delta)), with d's
power of two (1/4, 1/8) kept apart: ``SuperScales.factor``.

The scales are multiplied out in float32 in the same order as the ``gguf`` package
(and llama.cpp) does, so ``dequantize`` equals theirs bit for bit.

``FORMATS`` is the one table of block formats: a new format is its row there (its
decoder among the row's fields), and its case in the C++ packer (kernels/pack_ops.cpp).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from enum import IntEnum
from functools import partial

import numpy as np
import torch

from tandem.errors import ModelLoadError


class GGMLType(IntEnum):
    """GGUF tensor type codes (ggml.h's ggml_type) for the formats tandem computes on
    (FORMATS' rows) or writes (quant/quantize.py's QUANTIZERS)."""

    F32 = 0
    F16 = 1
    Q4_0 = 2
    Q4_1 = 3
    Q5_0 = 6
    Q5_1 = 7
    Q8_0 = 8
    Q2_K = 10
    Q3_K = 11
    Q4_K = 12
    Q5_K = 13
    Q6_K = 14
    IQ2_XXS = 16
    IQ2_XS = 17
    IQ3_XXS = 18
    IQ1_S = 19
    IQ4_NL = 20
    IQ3_S = 21
    IQ2_S = 22
    IQ4_XS = 23
    IQ1_M = 29
    BF16 = 30
    TQ1_0 = 34
    TQ2_0 = 35
    MXFP4 = 39


FLOAT_TYPES = {
    GGMLType.F32: torch.float32,
    GGMLType.F16: torch.float16,
    GGMLType.BF16: torch.bfloat16,
}


@dataclass
class SuperScales:
    """A K format's scales as the file holds them, per super-block of 256 weights:
    ``scales = d * sub * factor`` and ``mins = -(dmin * sub_mins)`` in float32
    (Decoded's).

    d, dmin: float32 [rows, columns // 256], each exactly a float16; sub: the 6-bit
    (uint8, Q4_K / Q5_K; Q2_K's 4-bit) or 8-bit signed (int8, Q6_K) sub-scales
    [rows, groups]; sub_mins: uint8 [rows, groups]; dmin and sub_mins None for the
    formats without minimums (Q6_K, Q3_K, ...); factor: a power of two every scale
    takes beyond d and sub (the codebook types': IQ3_XXS's 1/4, IQ2's and IQ1's 1/8),
    which the layouts keep apart (a float16 d times it may not be a float16)."""

    d: torch.Tensor
    sub: torch.Tensor
    dmin: torch.Tensor | None = None
    sub_mins: torch.Tensor | None = None
    factor: float = 1.0


@dataclass
class Decoded:
    """``w[r, k] = scales[r, k // group] * (values[r, k] - offset) + mins[r, k // group]``.

    values: uint8 in 0..2**bits - 1 (``bits`` 4, 5 or 6: the Q4 and Q5 formats and
    Q6_K, as the file stores them; Q3_K's 0..7 as 4), or int8 (Q8_0, bits 8); scales, mins: float32
    [rows, columns // group] (mins None when the format has none); supers: the factors
    of a K format's scales and mins (None for the others)."""

    values: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor | None
    offset: int
    group: int
    bits: int
    supers: SuperScales | None = None


def _f16(raw: torch.Tensor) -> torch.Tensor:
    """[..., 2] uint8 -> [...] float32."""
    return raw.contiguous().view(torch.float16).squeeze(-1).float()


def f16_bytes(x: torch.Tensor) -> torch.Tensor:
    """[...] float -> [..., 2] uint8: float16, little-endian (as blocks store it)."""
    return x.to(torch.float16).contiguous().view(torch.uint8).reshape(*x.shape, 2)


def _nibbles32(qs: torch.Tensor) -> torch.Tensor:
    """[..., 16] bytes -> [..., 32]: low nibbles are weights 0..15, high 16..31."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=-1)


def _high_bits32(qh: torch.Tensor) -> torch.Tensor:
    """[..., 4] bytes (a little-endian u32) -> [..., 32] bits, bit j for weight j."""
    bits = qh.unsqueeze(-1) >> torch.arange(8, dtype=torch.uint8)
    return (bits & 1).reshape(*qh.shape[:-1], 32)


def _k_scales(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K: 12 bytes -> 8 six-bit scales and 8 six-bit mins, uint8 (as
    get_scale_min_k4)."""
    s = scales.reshape(*scales.shape[:-1], 3, 4)
    d, m, md = s[..., 0, :], s[..., 1, :], s[..., 2, :]
    sc = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mn = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc, mn


def check_row_bytes(code: GGMLType, raw: torch.Tensor, columns: int) -> None:
    """raw: uint8 [rows, row bytes] must be whole ``code`` blocks of ``columns`` weights."""
    per_block, nbytes = BLOCK[code]
    if columns % per_block or raw.dim() != 2 or raw.shape[-1] != columns // per_block * nbytes:
        raise ModelLoadError(
            f"{code.name} rows of {columns} weights: not whole blocks of {per_block}, or "
            f"not {columns // per_block * nbytes} bytes"
        )


# -- one decoder a format: [rows, blocks, block bytes] -> Decoded ------------------------


def _flat(t: torch.Tensor, rows: int) -> torch.Tensor:
    return t.reshape(rows, -1)


def _decode_q8_0(blocks: torch.Tensor) -> Decoded:
    rows = blocks.shape[0]
    d, q = _f16(blocks[..., :2]), blocks[..., 2:].contiguous().view(torch.int8)
    return Decoded(_flat(q, rows), d, None, 0, 32, 8)


def _decode_q4(blocks: torch.Tensor, has_min: bool) -> Decoded:
    """Q4_0 (w = d*(q-8)) and Q4_1 (w = d*q + m)."""
    rows, start = blocks.shape[0], 4 if has_min else 2
    q = _nibbles32(blocks[..., start:])
    mins = _f16(blocks[..., 2:4]) if has_min else None
    return Decoded(_flat(q, rows), _f16(blocks[..., :2]), mins, 0 if has_min else 8, 32, 4)


def _decode_q5(blocks: torch.Tensor, has_min: bool) -> Decoded:
    """Q5_0 (w = d*(q-16)) and Q5_1 (w = d*q + m): Q4's nibbles plus a u32 of 5th bits."""
    rows, start = blocks.shape[0], 4 if has_min else 2
    qh = _high_bits32(blocks[..., start : start + 4])
    q = _nibbles32(blocks[..., start + 4 :]) | (qh << 4)
    mins = _f16(blocks[..., 2:4]) if has_min else None
    return Decoded(_flat(q, rows), _f16(blocks[..., :2]), mins, 0 if has_min else 16, 32, 5)


def _decode_q45_k(blocks: torch.Tensor, bits: int) -> Decoded:
    """Q4_K and Q5_K: w = d*sc*q - dmin*mn, 8 groups of 32 a super-block."""
    rows = blocks.shape[0]
    d, dmin = _f16(blocks[..., 0:2]), _f16(blocks[..., 2:4])
    sc, mn = _k_scales(blocks[..., 4:16])
    if bits == 4:
        qs = blocks[..., 16:].reshape(rows, -1, 4, 32)  # 4 pairs of groups
        q = torch.stack([qs & 0x0F, qs >> 4], dim=-2)  # [rows, blocks, 4, 2, 32]
    else:
        qh = blocks[..., 16:48].unsqueeze(-2) >> torch.arange(8, dtype=torch.uint8).view(8, 1)
        qs = blocks[..., 48:].reshape(rows, -1, 4, 32)
        low = torch.stack([qs & 0x0F, qs >> 4], dim=-2).reshape(rows, -1, 8, 32)
        q = low | ((qh & 1) << 4)
    scales = d.unsqueeze(-1) * sc.float()
    mins = -(dmin.unsqueeze(-1) * mn.float())
    supers = SuperScales(d, _flat(sc, rows), dmin, _flat(mn, rows))
    return Decoded(_flat(q, rows), _flat(scales, rows), _flat(mins, rows), 0, 32, bits, supers)


def _decode_q6_k(blocks: torch.Tensor) -> Decoded:
    """Q6_K: w = d*sc*(q-32), 16 groups of 16 a super-block."""
    rows = blocks.shape[0]
    ql = blocks[..., :128].reshape(rows, -1, 2, 1, 64)
    qh = blocks[..., 128:192].reshape(rows, -1, 2, 1, 32)
    sc = blocks[..., 192:208].contiguous().view(torch.int8)
    d = _f16(blocks[..., 208:210])
    low = (ql >> torch.tensor([0, 4], dtype=torch.uint8).view(2, 1)) & 0x0F
    high = (qh >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(4, 1)) & 0x03
    q = low.reshape(rows, -1, 2, 4, 32) | (high.reshape(rows, -1, 2, 4, 32) << 4)
    scales = d.unsqueeze(-1) * sc.float()
    supers = SuperScales(d, _flat(sc, rows))
    return Decoded(_flat(q, rows), _flat(scales, rows), None, 32, 16, 6, supers)


def _decode_q3_k(blocks: torch.Tensor) -> Decoded:
    """Q3_K: w = d*(sc-32)*(q-4), 16 groups of 16 a super-block. Weight 128h + 32j + l
    (h: half, j: 0..3, l: 0..31) takes bits 2j of qs[32h + l] and bit 4h + j of
    hmask[l]; 6-bit scale s: its low nibble from byte s (s < 8) or the high nibble
    of byte s - 8, its top two bits from byte 8 + s % 4 at bit 2 * (s // 4)."""
    rows = blocks.shape[0]
    hmask, qs, packed, d = (blocks[..., a:b] for a, b in ((0, 32), (32, 96), (96, 108), (108, 110)))
    low = torch.cat([packed[..., :8] & 0x0F, packed[..., :8] >> 4], dim=-1)  # [.., 16]
    top = (packed[..., 8:12].unsqueeze(-2) >> _PAIRS_OF_BITS) & 0x03  # [.., 4 (s // 4), 4]
    sub = (low | (top.reshape(*low.shape) << 4)).to(torch.int8) - 32
    pairs = _pairs(qs, rows)
    bit = torch.arange(8, dtype=torch.uint8).view(2, 4, 1)
    third = (hmask.reshape(rows, -1, 1, 1, 32) >> bit) & 1
    q = pairs | (third << 2)
    dd = _f16(d)
    scales = dd.unsqueeze(-1) * sub.float()
    supers = SuperScales(dd, _flat(sub, rows))
    return Decoded(_flat(q, rows), _flat(scales, rows), None, 4, 16, 4, supers)


_PAIRS_OF_BITS = torch.arange(0, 8, 2, dtype=torch.uint8).view(4, 1)


def _pairs(qs: torch.Tensor, rows: int) -> torch.Tensor:
    """64 bytes a super-block -> its 256 2-bit values [rows, blocks, h, j, l]: weight
    128h + 32j + l is bits 2j of byte 32h + l (Q3_K's low bits, TQ2_0's values)."""
    return (qs.reshape(rows, -1, 2, 1, 32) >> _PAIRS_OF_BITS) & 0x03


def _ternary(values: torch.Tensor, d: torch.Tensor, rows: int) -> Decoded:
    """TQ1_0's and TQ2_0's w = d*(q-1), q in 0..2: one d a super-block, so a sub-scale
    of 1 for each of the 16 groups (the packed and split layouts are Q3_K's)."""
    sub = torch.ones(*d.shape, 16, dtype=torch.int8)
    scales = d.unsqueeze(-1) * sub.float()
    supers = SuperScales(d, _flat(sub, rows))
    return Decoded(_flat(values, rows), _flat(scales, rows), None, 1, 16, 4, supers)


def _decode_q2_k(blocks: torch.Tensor) -> Decoded:
    """Q2_K: scales[16] (a 4-bit scale low, a 4-bit min high, per group of 16),
    qs[64] (Q3_K's pairs), d, dmin: w = d*sc*q - dmin*mn, q in 0..3."""
    rows = blocks.shape[0]
    packed, qs = blocks[..., :16], blocks[..., 16:80]
    d, dmin = _f16(blocks[..., 80:82]), _f16(blocks[..., 82:84])
    sc, mn = packed & 0x0F, packed >> 4
    scales = d.unsqueeze(-1) * sc.float()
    mins = -(dmin.unsqueeze(-1) * mn.float())
    supers = SuperScales(d, _flat(sc, rows), dmin, _flat(mn, rows))
    return Decoded(_flat(_pairs(qs, rows), rows), _flat(scales, rows), _flat(mins, rows), 0, 16,
                   4, supers)  # fmt: skip


def _decode_tq2_0(blocks: torch.Tensor) -> Decoded:
    """TQ2_0: qs[64] (2-bit values, Q3_K's pairs), d."""
    rows = blocks.shape[0]
    return _ternary(_pairs(blocks[..., :64], rows), _f16(blocks[..., 64:66]), rows)


_POWERS_OF_3 = torch.tensor([1, 3, 9, 27, 81], dtype=torch.uint8).view(5, 1)


def _decode_tq1_0(blocks: torch.Tensor) -> Decoded:
    """TQ1_0: qs[48] (5 values a byte), qh[4] (4 a byte), d. A byte b holds its k-th
    value as the top "trit" of b * 3**k: ((b * 3**k mod 256) * 3) >> 8. Weights 0..159
    are qs[0:32]'s (value k of byte i: weight 32k + i), 160..239 qs[32:48]'s (16k + i),
    240..255 qh's (4k + i)."""
    rows = blocks.shape[0]
    parts = [(blocks[..., a:b].unsqueeze(-2) * _POWERS_OF_3[:n]).flatten(-2)
             for a, b, n in ((0, 32, 5), (32, 48, 5), (48, 52, 4))]  # fmt: skip
    trits = ((torch.cat(parts, dim=-1).to(torch.int32) * 3) >> 8).to(torch.uint8)
    return _ternary(trits, _f16(blocks[..., 52:54]), rows)


# IQ4_NL's (and IQ4_XS's) 16 levels, as llama.cpp's ggml-common.h defines the format.
IQ4_NL_VALUES = torch.tensor(
    [-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=torch.int8
)


def _decode_iq4_nl(blocks: torch.Tensor) -> Decoded:
    """IQ4_NL: w = d * IQ4_NL_VALUES[q], q Q4_0's nibbles; the values are the table's."""
    rows = blocks.shape[0]
    q = _nibbles32(blocks[..., 2:]).long()
    return Decoded(_flat(IQ4_NL_VALUES[q], rows), _f16(blocks[..., :2]), None, 0, 32, 8)


def _codebook(values: torch.Tensor, d: torch.Tensor, sub: torch.Tensor, rows: int,
              factor: float = 1.0) -> Decoded:  # fmt: skip
    """Int8 values under Q6_K's records (IQ4_XS and the codebook types): w = d * sub *
    factor * value, sub int8 [rows, blocks, 16] (one a group of 16), factor a power of
    two (so that the float32 products are exact, the gguf package's in any order)."""
    scales = d.unsqueeze(-1) * sub.float() * factor
    supers = SuperScales(d, _flat(sub, rows), factor=factor)
    return Decoded(_flat(values, rows), _flat(scales, rows), None, 0, 16, 8, supers)


def _decode_iq4_xs(blocks: torch.Tensor) -> Decoded:
    """IQ4_XS: d, scales_h (u16), scales_l[4], qs[128]; eight sub-blocks of 32, each
    IQ4_NL's nibbles with a 6-bit scale ls (its low nibble from scales_l, its top two
    bits from scales_h): w = d * (ls - 32) * IQ4_NL_VALUES[q]. Held as int8 levels under
    Q6_K's records, each sub-scale given to both of its 16-weight groups."""
    rows = blocks.shape[0]
    d = _f16(blocks[..., 0:2])
    high = blocks[..., 2:4].contiguous().view(torch.int16).to(torch.int32)  # [.., 1]
    low = (blocks[..., 4:8].unsqueeze(-1) >> torch.tensor([0, 4], dtype=torch.uint8)) & 0x0F
    top = (high >> torch.arange(0, 16, 2, dtype=torch.int32)) & 0x03  # [.., 8]
    sub = (low.reshape(*top.shape).to(torch.int32) | (top << 4)) - 32
    q = _nibbles32(blocks[..., 8:].reshape(rows, -1, 8, 16)).long()
    sub16 = sub.to(torch.int8).repeat_interleave(2, dim=-1)  # [rows, blocks, 16]
    return _codebook(IQ4_NL_VALUES[q], d, sub16, rows)


def grid(code: GGMLType) -> torch.Tensor | None:
    """A codebook type's grid (int8 [entries, weights an entry]); None for the others."""
    return _grid(code.name) if FORMATS[code].codebook else None


@functools.cache
def _grid(name: str) -> torch.Tensor:
    """A codebook type's grid as gguf-py decodes llama.cpp's table: int8 [entries,
    weights an entry]."""
    from gguf import quants

    kind = getattr(quants, name)
    kind.init_grid()
    return torch.from_numpy(kind.grid.reshape(kind.grid_shape).astype(np.int8))


_BITS = torch.arange(8, dtype=torch.uint8)


def _decode_iq3_s(blocks: torch.Tensor) -> Decoded:
    """IQ3_S: d, qs[64], qh[8], signs[32], scales[4]. Index i (weights 4i..4i+3) is
    qs[i] plus bit i of qh as its ninth bit, into the codebook; bit k of signs[j] is
    weight 8j + k's sign; a 4-bit s per 32 weights: w = d * (1 + 2s) * grid * sign.
    Held as int8 values (grid x sign) under Q6_K's records, 1 + 2s a sub-scale given
    to both of its 16-weight groups."""
    rows = blocks.shape[0]
    d = _f16(blocks[..., 0:2])
    qh = (blocks[..., 66:74].unsqueeze(-1) >> _BITS) & 1  # [.., 8, 8]: index 8j + k
    index = blocks[..., 2:66].long() | (qh.reshape(*qh.shape[:-2], 64).long() << 8)
    grid = _grid("IQ3_S")[index].reshape(rows, -1, 256)  # (512 entries of 4 odd 1..15)
    signs = ((blocks[..., 74:106].unsqueeze(-1) >> _BITS) & 1).reshape(rows, -1, 256)
    values = grid * (1 - 2 * signs.to(torch.int8))
    nibbles = blocks[..., 106:110].unsqueeze(-1) >> torch.tensor([0, 4], dtype=torch.uint8)
    sub = (1 + 2 * (nibbles & 0x0F).to(torch.int8)).reshape(rows, -1, 8).repeat_interleave(2, -1)
    return _codebook(values, d, sub, rows)


def _parity_signs() -> torch.Tensor:
    """The 7-bit sign indices' signs, int8 [128, 8] of +-1: bits 0..6 of the index and
    an 8th that makes the count of minus signs even (llama.cpp's ksigns)."""
    index = torch.arange(128, dtype=torch.int32)
    parity = sum((index >> b) & 1 for b in range(7)) & 1
    bits = ((index | (parity << 7)).unsqueeze(-1) >> torch.arange(8, dtype=torch.int32)) & 1
    return (1 - 2 * bits).to(torch.int8)


_SIGNS = _parity_signs()


def _bit_signs(raw: torch.Tensor) -> torch.Tensor:
    """[..., n] bytes -> int8 [..., n, 8] of +-1: bit k of byte j is weight 8j + k's."""
    return (1 - 2 * ((raw.unsqueeze(-1) >> _BITS) & 1)).to(torch.int8)


def _words(raw: torch.Tensor, width: int) -> torch.Tensor:
    """[..., n * width] little-endian bytes -> int32 [..., n] unsigned words of
    ``width`` (2 or 4) bytes (a u32's top bit as int32's sign: shift, then mask)."""
    dtype = torch.int16 if width == 2 else torch.int32
    words = raw.contiguous().view(dtype).to(torch.int32)
    return words & 0xFFFF if width == 2 else words


def _decode_iq3_xxs(blocks: torch.Tensor) -> Decoded:
    """IQ3_XXS: d, qs[64] (an index a 4 weights), 8 u32 per 32 weights: bits 7j..7j+6
    the sign index of weights 8j..8j+7, bits 28..31 s: w = d * (1+2s) / 4 * grid * sign."""
    rows, nb = blocks.shape[:2]
    words = _words(blocks[..., 66:98], 4)  # [.., 8]
    signs = _SIGNS[((words.unsqueeze(-1) >> (7 * _FOUR)) & 127).long()]  # [.., 8, 4, 8]
    grid = _grid("IQ3_XXS")[blocks[..., 2:66].long()].reshape(rows, nb, 8, 4, 8)
    sub = (1 + 2 * ((words >> 28) & 15)).to(torch.int8).repeat_interleave(2, -1)
    return _codebook(grid * signs, _f16(blocks[..., 0:2]), sub, rows, 0.25)


_FOUR = torch.arange(4, dtype=torch.int32)


def _decode_iq2_xxs(blocks: torch.Tensor) -> Decoded:
    """IQ2_XXS: d, then per 32 weights a u32 of four indices (a byte each, 8 weights an
    index) and a u32 of four sign indices and s (IQ3_XXS's): w = d * (1+2s) / 8 *
    grid * sign."""
    rows, nb = blocks.shape[:2]
    pairs = blocks[..., 2:66].reshape(rows, nb, 8, 8)
    words = _words(pairs[..., 4:], 4).squeeze(-1)  # [.., 8]
    signs = _SIGNS[((words.unsqueeze(-1) >> (7 * _FOUR)) & 127).long()]  # [.., 8, 4, 8]
    grid = _grid("IQ2_XXS")[pairs[..., :4].long()]  # [.., 8, 4, 8]
    sub = (1 + 2 * ((words >> 28) & 15)).to(torch.int8).repeat_interleave(2, -1)
    return _codebook(grid * signs, _f16(blocks[..., 0:2]), sub, rows, 0.125)


def _nibble_subs(raw: torch.Tensor) -> torch.Tensor:
    """scales[8] -> int8 [.., 16] sub-scales 1 + 2s, s the low nibble of byte j for
    group 2j and its high nibble for 2j + 1 (IQ2_XS, IQ2_S)."""
    s = (raw.unsqueeze(-1) >> torch.tensor([0, 4], dtype=torch.uint8)) & 0x0F
    return (1 + 2 * s.to(torch.int8)).flatten(-2)


def _decode_iq2_xs(blocks: torch.Tensor) -> Decoded:
    """IQ2_XS: d, 32 u16 (a 9-bit index and a 7-bit sign index, 8 weights each),
    scales[8] (an s per 16 weights): w = d * (1+2s) / 8 * grid * sign."""
    words = _words(blocks[..., 2:66], 2)  # [.., 32]
    values = _grid("IQ2_XS")[(words & 511).long()] * _SIGNS[(words >> 9).long()]
    return _codebook(values, _f16(blocks[..., 0:2]), _nibble_subs(blocks[..., 66:74]),
                     blocks.shape[0], 0.125)  # fmt: skip


def _decode_iq2_s(blocks: torch.Tensor) -> Decoded:
    """IQ2_S: d, qs[32] (indices' low 8 bits), signs[32] (bit k of byte j: weight
    8j + k), qh[8] (bits 2m of byte j: index 4j + m's top two), scales[8] as IQ2_XS's:
    w = d * (1+2s) / 8 * grid * sign."""
    high = (blocks[..., 66:74].unsqueeze(-1) >> (2 * _FOUR).to(torch.uint8)) & 3
    index = blocks[..., 2:34].long() | (high.flatten(-2).long() << 8)
    values = _grid("IQ2_S")[index] * _bit_signs(blocks[..., 34:66])
    return _codebook(values, _f16(blocks[..., 0:2]), _nibble_subs(blocks[..., 74:82]),
                     blocks.shape[0], 0.125)  # fmt: skip


def _decode_iq1_s(blocks: torch.Tensor) -> Decoded:
    """IQ1_S: d, qs[32] (indices' low 8 bits), a u16 per 32 weights: bits 3m..3m+2
    index m's top three, 12..14 s, 15 the sign of delta = +-1/8:
    w = d * (2s+1) * (grid + delta), held as d * (2s+1) / 8 * (8 grid +- 1)."""
    rows, nb = blocks.shape[:2]
    words = _words(blocks[..., 34:50], 2)  # [.., 8]
    high = (words.unsqueeze(-1) >> (3 * _FOUR)) & 7  # [.., 8, 4]
    index = blocks[..., 2:34].reshape(rows, nb, 8, 4).long() | (high.long() << 8)
    delta = 1 - 2 * ((words >> 15) & 1)  # [.., 8]
    values = 8 * _grid("IQ1_S")[index] + delta[..., None, None].to(torch.int8)
    sub = (1 + 2 * ((words >> 12) & 7)).to(torch.int8).repeat_interleave(2, -1)
    return _codebook(values, _f16(blocks[..., 0:2]), sub, rows, 0.125)


def _decode_iq1_m(blocks: torch.Tensor) -> Decoded:
    """IQ1_M: qs[32] (indices' low 8 bits), qh[16] (byte j: index 2j's top three bits
    and delta's sign in its low nibble, index 2j + 1's in its high), 4 u16: s for
    groups 4i..4i+3 of 16 weights at bits 3m, and d's bits 4i..4i+3 on top:
    w = d * (2s+1) * (grid + delta), delta = +-1/8 per 8 weights, held as IQ1_S's."""
    words = _words(blocks[..., 48:56], 2)  # [.., 4]
    d_bits = sum((words[..., i] >> 12) << (4 * i) for i in range(4))
    d = _f16(torch.stack([d_bits & 0xFF, d_bits >> 8], dim=-1).to(torch.uint8))
    nibbles = ((blocks[..., 32:48].unsqueeze(-1) >> torch.tensor([0, 4], dtype=torch.uint8))
               & 0x0F).flatten(-2).long()  # [.., 32]: index g's  # fmt: skip
    index = blocks[..., 0:32].long() | ((nibbles & 7) << 8)
    delta = (1 - 2 * (nibbles >> 3)).to(torch.int8)
    values = 8 * _grid("IQ1_M")[index] + delta.unsqueeze(-1)
    sub = (1 + 2 * ((words.unsqueeze(-1) >> (3 * _FOUR)) & 7)).to(torch.int8).flatten(-2)
    return _codebook(values, d, sub, blocks.shape[0], 0.125)


# MXFP4's 16 values (E2M1 numbers doubled, as ggml's kvalues_mxfp4), and the
# shared exponent's float: 2**(e - 128), half of E8M0's 2**(e - 127) for the doubling.
MXFP4_VALUES = torch.tensor([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12],
                            dtype=torch.int8)  # fmt: skip
# The exponents whose power of two a float16 holds exactly (2**-24 .. 2**15).
MXFP4_HALF_EXPONENTS = (104, 143)


def _e8m0_half(e: torch.Tensor) -> torch.Tensor:
    """uint8 exponents -> float32 2**(e - 128) (for e < 2, the subnormals ggml makes)."""
    e = e.to(torch.int32)
    bits = torch.where(e < 2, 0x00200000 << e, (e - 1) << 23)
    return bits.view(torch.float32)


def _decode_mxfp4(blocks: torch.Tensor) -> Decoded:
    """MXFP4: w = 2**(e-128) * MXFP4_VALUES[q]; the values + 16 (Q5_0's 5-bit range)."""
    rows = blocks.shape[0]
    q = _nibbles32(blocks[..., 1:]).long()
    values = (MXFP4_VALUES[q].to(torch.int16) + 16).to(torch.uint8)
    return Decoded(_flat(values, rows), _e8m0_half(blocks[..., 0]), None, 16, 32, 5)


def _mxfp4_held_exactly(raw: torch.Tensor) -> bool:
    """Whether every block's power of two is a float16 (the layouts' scales), or its
    values are all zero (then any scale is)."""
    blocks = raw.reshape(-1, 17)
    low, high = MXFP4_HALF_EXPONENTS
    outside = (blocks[:, 0] < low) | (blocks[:, 0] > high)
    if not bool(outside.any()):
        return True
    q = blocks[outside, 1:]
    return bool((((q & 0x07) == 0) & (((q >> 4) & 0x07) == 0)).all())


# -- the table ---------------------------------------------------------------------------


@dataclass(frozen=True)
class SuperFormat:
    """How a format fills the GPU's SuperBlockWeight formula (split_blocks.py)."""

    super: int  # weights per d (and dm)
    group: int  # weights per sub (== super where there is none)
    high_bits: int  # bits of q above its low 4
    offset: int
    has_sub: bool
    has_min: bool


@dataclass(frozen=True)
class BlockFormat:
    """Everything tandem knows about one block format, in one row (llama.cpp's
    ``ggml_type_traits``): its bytes, its exact decoder, and the layouts it is packed
    to. kernels/pack_ops.cpp's ``Code`` and ``value_bits`` mirror the packed layout
    (tests/test_quant.py checks the two agree, and every decoder against gguf-py's)."""

    code: GGMLType
    weights: int  # per block
    nbytes: int  # per block
    decoder: Callable[[torch.Tensor], Decoded]  # uint8 [rows, blocks, nbytes] -> Decoded
    # The CPU kernel's packed layout (packed.py): bits a value, weights per scale, the
    # values' offset, stored minimums (``corr``), and the bytes of a K format's
    # super-block record (0: float16 scales, no records).
    packed_bits: int
    group: int
    offset: float
    has_corr: bool
    record_bytes: int
    # The GPU's split layout (split_blocks.py): BlockWeight's bits a value (Q4_0,
    # Q8_0: their values as the file lays them out), or SuperBlockWeight's formula.
    split: int | SuperFormat
    # Whether the layouts hold a tensor's blocks (uint8 [rows, row bytes]) exactly, for a
    # format whose file can hold what they cannot (MXFP4's scales beyond float16): a
    # tensor that fails is decoded to float32 at load instead. None: always.
    held_exactly: Callable[[torch.Tensor], bool] | None = None
    # Whether its values come from a codebook, gguf-py's grid of its name (``grid``; the
    # compiled kernels are given it): held as the file's blocks, decoded a tile at a time.
    codebook: bool = False
    # The power of two its scales take beyond the records' d and sub-scales
    # (SuperScales.factor): the kernels multiply each output by it.
    factor: float = 1.0
    # Bits its values take in the compact layouts, where the CPU kernels read them
    # (packed.py's layout_bits; instead of ``packed_bits``): Q2_K's and the ternary
    # types' 2, Q3_K's 3, the table formats' 4-bit indices; 0: none.
    compact_bits: int = 0
    # The 16 levels (TABLES) its compact 4-bit values index, through a byte shuffle
    # (packed.py's table_layout); 0: none.
    table: int = 0

    @property
    def name(self) -> str:
        return self.code.name

    @property
    def bytes_per_weight(self) -> float:
        """The file's bytes a weight, scales included (the planner's price)."""
        return self.nbytes / self.weights


_q4_0, _q4_1 = partial(_decode_q4, has_min=False), partial(_decode_q4, has_min=True)
_q5_0, _q5_1 = partial(_decode_q5, has_min=False), partial(_decode_q5, has_min=True)
_q4_k, _q5_k = partial(_decode_q45_k, bits=4), partial(_decode_q45_k, bits=5)
FORMATS: dict[GGMLType, BlockFormat] = {f.code: f for f in (
    # format, weights and bytes a block, decoder; packed: bits, group, offset, corr,
    # record bytes; split
    BlockFormat(GGMLType.Q8_0, 32, 34, _decode_q8_0, 8, 32, 0.0, False, 0, 8),
    BlockFormat(GGMLType.Q4_0, 32, 18, _q4_0, 4, 32, 8.0, False, 0, 4),
    BlockFormat(GGMLType.Q4_1, 32, 20, _q4_1, 4, 32, 0.0, True, 0,
                SuperFormat(32, 32, 0, 0, False, True)),
    BlockFormat(GGMLType.Q5_0, 32, 22, _q5_0, 5, 32, 16.0, False, 0,
                SuperFormat(32, 32, 1, 16, False, False)),
    BlockFormat(GGMLType.Q5_1, 32, 24, _q5_1, 5, 32, 0.0, True, 0,
                SuperFormat(32, 32, 1, 0, False, True)),
    BlockFormat(GGMLType.Q4_K, 256, 144, _q4_k, 4, 32, 0.0, False, 320,
                SuperFormat(256, 32, 0, 0, True, True)),
    BlockFormat(GGMLType.Q5_K, 256, 176, _q5_k, 5, 32, 0.0, False, 320,
                SuperFormat(256, 32, 1, 0, True, True)),
    BlockFormat(GGMLType.Q6_K, 256, 210, _decode_q6_k, 6, 16, 32.0, False, 288,
                SuperFormat(256, 16, 2, 32, True, False)),
    # Q3_K's 3-bit values under Q6_K's records (3.5625 bits a weight held against the
    # file's 3.4375), or a nibble each (4.5625) where the kernels read no 3 bits.
    BlockFormat(GGMLType.Q3_K, 256, 110, _decode_q3_k, 4, 16, 4.0, False, 288,
                SuperFormat(256, 16, 0, 4, True, False), compact_bits=3),
    # Q2_K's 2-bit values, records of 16-weight groups with minimums, a group's sub-scale
    # and sub-min in one byte as in the file (2.625 bits, the file's; a nibble each: 4.625).
    BlockFormat(GGMLType.Q2_K, 256, 84, _decode_q2_k, 4, 16, 0.0, False, 320,
                SuperFormat(256, 16, 0, 0, True, True), compact_bits=2),
    # TQ2_0's 2-bit values, Q3_K's records (2.5625 bits against 2.0625; nibbles: 4.5625).
    BlockFormat(GGMLType.TQ2_0, 256, 66, _decode_tq2_0, 4, 16, 1.0, False, 288,
                SuperFormat(256, 16, 0, 1, True, False), compact_bits=2),
    # TQ1_0's ternary values (5 a byte in the file) as TQ2_0's (2.56 bits against 1.69).
    BlockFormat(GGMLType.TQ1_0, 256, 54, _decode_tq1_0, 4, 16, 1.0, False, 288,
                SuperFormat(256, 16, 0, 1, True, False), compact_bits=2),
    # IQ4_NL's table levels as int8 values: Q8_0's layouts (8.5 bits against 4.5), or its
    # indices (table 1: 4.5 bits).
    BlockFormat(GGMLType.IQ4_NL, 32, 18, _decode_iq4_nl, 8, 32, 0.0, False, 0, 8, compact_bits=4,
                table=1),
    # IQ4_XS's levels as int8 values under Q6_K's records (8.5625 bits against 4.25), or
    # its indices (4.5625); on the GPU its levels + 128 as 8-bit q (4 high bits) and its
    # sub-scales.
    BlockFormat(GGMLType.IQ4_XS, 256, 136, _decode_iq4_xs, 8, 16, 0.0, False, 288,
                SuperFormat(256, 16, 4, 128, True, False), compact_bits=4, table=1),
    # IQ3_S: held as the file's blocks (3.4375 bits; packed.py's codebook_layout), each
    # tile decoded as it is multiplied into what packed_bits and record_bytes describe:
    # its codebook values (x their signs) as int8 under IQ4_XS's records.
    BlockFormat(GGMLType.IQ3_S, 256, 110, _decode_iq3_s, 8, 16, 0.0, False, 288,
                SuperFormat(256, 16, 4, 128, True, False), codebook=True),
    # The other codebook types as IQ3_S (d's power of two kept apart: ``factor``).
    *(BlockFormat(code, 256, nbytes, decoder, 8, 16, 0.0, False, 288,
                  SuperFormat(256, 16, 4, 128, True, False), codebook=True, factor=factor)
      for code, nbytes, decoder, factor in (
          (GGMLType.IQ3_XXS, 98, _decode_iq3_xxs, 0.25),
          (GGMLType.IQ2_XXS, 66, _decode_iq2_xxs, 0.125),
          (GGMLType.IQ2_XS, 74, _decode_iq2_xs, 0.125),
          (GGMLType.IQ2_S, 82, _decode_iq2_s, 0.125),
          (GGMLType.IQ1_S, 50, _decode_iq1_s, 0.125),
          (GGMLType.IQ1_M, 56, _decode_iq1_m, 0.125))),
    # MXFP4's values + 16 in Q5_0's layouts, its powers of two as their float16 scales
    # (5.5 bits a weight held against the file's 4.25), or its indices (table 2: 4.5).
    BlockFormat(GGMLType.MXFP4, 32, 17, _decode_mxfp4, 5, 32, 16.0, False, 0,
                SuperFormat(32, 32, 1, 16, False, False), _mxfp4_held_exactly, compact_bits=4,
                table=2),
)}  # fmt: skip

# The 16-entry tables of FORMATS' ``table`` (kernels/quant_ops.cpp's kTables).
TABLES = {1: IQ4_NL_VALUES, 2: MXFP4_VALUES}

# Weights and bytes per block (FORMATS' sizes, as most readers want them).
BLOCK = {code: (f.weights, f.nbytes) for code, f in FORMATS.items()}

SUPPORTED = sorted([*FLOAT_TYPES, *BLOCK], key=int)


def type_name(code: int) -> str:
    try:
        return GGMLType(code).name
    except ValueError:
        pass
    try:
        import gguf

        return gguf.GGMLQuantizationType(code).name
    except Exception:
        return f"type {code}"


# -- every other type llama.cpp writes ------------------------------------------------------


@functools.cache
def decoded_at_load() -> dict[int, tuple[int, int]]:
    """The block types that have no row in FORMATS yet (NVFP4, and whatever types a
    newer gguf-py knows): code -> (weights, bytes) a block. A file's tensors of
    these types are decoded to float32 as they are read (``dequantize_other``), so
    the file loads and runs exactly, at float memory and float speed."""
    import gguf
    from gguf import quants

    found = {}
    for kind in gguf.GGMLQuantizationType:
        code = int(kind)
        if code in FLOAT_TYPES or code in BLOCK or kind not in gguf.GGML_QUANT_SIZES:
            continue
        weights, nbytes = gguf.GGML_QUANT_SIZES[kind]
        try:  # (gguf-py decodes every block type llama.cpp writes but a few)
            quants.dequantize(np.zeros((1, nbytes), dtype=np.uint8), kind)
        except NotImplementedError:
            continue
        if weights > 1:
            found[code] = (weights, nbytes)
    return found


def held_exactly(code: int, raw: np.ndarray | torch.Tensor) -> bool:
    """Whether the kernels' layouts of ``code`` hold these blocks (a tensor's uint8
    bytes) exactly: its row's ``held_exactly`` test, or True (float types, and a
    format whose file holds nothing the layouts cannot)."""
    spec = FORMATS.get(code)
    if spec is None or spec.held_exactly is None:
        return True
    return spec.held_exactly(torch.as_tensor(raw))


def dequantize_other(code: int, raw: np.ndarray, shape: tuple[int, ...]) -> torch.Tensor:
    """A tensor decoded at load (``decoded_at_load``, or not ``held_exactly``): its
    bytes (uint8) -> float32 of ``shape``, by gguf-py's decoder (llama.cpp's
    dequantization, exactly)."""
    import gguf
    from gguf import quants

    values = quants.dequantize(raw.reshape(shape[0], -1), gguf.GGMLQuantizationType(code))
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).reshape(shape)


def check_supported(code: int, tensor: str) -> int:
    """``code`` (a GGMLType, or a ``decoded_at_load`` type's number), or a clear error."""
    if code not in FLOAT_TYPES and code not in BLOCK and code not in decoded_at_load():
        supported = ", ".join(GGMLType(c).name for c in SUPPORTED)
        others = ", ".join(type_name(c) for c in decoded_at_load())
        raise ModelLoadError(
            f"tensor {tensor!r} is stored as {type_name(code)}, which tandem does not read "
            f"(supported: {supported}; decoded to float at load: {others})"
        )
    return GGMLType(code) if code in FLOAT_TYPES or code in BLOCK else code


def row_bytes(code: GGMLType, columns: int) -> int:
    weights, nbytes = BLOCK[code]
    if columns % weights:
        raise ModelLoadError(f"a {code.name} row of {columns} weights is not whole blocks")
    return columns // weights * nbytes


def decode(code: GGMLType, raw: torch.Tensor, columns: int) -> Decoded:
    """raw: uint8 [rows, row_bytes] -> the rows' integer values and scales (the
    format's own decoder, FORMATS[code].decoder)."""
    if code not in FORMATS:
        raise ModelLoadError(f"no decoder for {GGMLType(code).name}")
    check_row_bytes(code, raw, columns)
    spec = FORMATS[code]
    return spec.decoder(raw.reshape(raw.shape[0], columns // spec.weights, spec.nbytes))


def dequantize_decoded(dec: Decoded) -> torch.Tensor:
    rows, columns = dec.values.shape
    groups = columns // dec.group
    q = dec.values.float().reshape(rows, groups, dec.group)
    if dec.offset:
        q = q - dec.offset
    w = dec.scales.unsqueeze(-1) * q
    if dec.mins is not None:
        w = w + dec.mins.unsqueeze(-1)
    return w.reshape(rows, columns)


def dequantize(code: GGMLType, raw: torch.Tensor, columns: int) -> torch.Tensor:
    """Any supported tensor's rows -> float32 [rows, columns]."""
    if code in FLOAT_TYPES:
        return raw.contiguous().view(FLOAT_TYPES[code]).reshape(-1, columns).float()
    return dequantize_decoded(decode(code, raw, columns))
