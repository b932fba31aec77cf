"""PackedWeight: a quantized matrix in the layout the integer-dot kernel reads.

Any GGML format decodes (blocks.py) to ``w = scale * (q - offset) + min`` per group;
packing keeps ``q`` as it is stored, at 4 bits (two a byte, for Q4_0 / Q4_1 / Q4_K)
or 8 (everything else: Q5's 5-bit values take a byte), and keeps the constants as
``corr = min - offset * scale`` (Q4_1, Q5_1, the K formats) or, when there is only
an offset (Q4_0, Q5_0), not at all: the kernel computes ``-offset * scale``. So one
kernel (tandem/kernels/quant_ops.cpp) serves every format. Scales (and constants)
are float16 where every one of them is exactly a float16, as in the Q4/Q5/Q8 files,
so those take the file's own bytes; the K formats' products of a float16 and a 6- or
8-bit sub-scale are not, and stay float32 (Q4_K: 6 bits a weight against the file's
4.5). ``nbytes`` reports what is held.

``reference`` is the exact math the kernel must reproduce: the activations quantized
to int8 per block of 32 as the kernel does, times the dequantized weights, in float64.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from tandem.quant.blocks import Decoded, GGMLType, check_row_bytes, decode, dequantize_decoded

BLOCK = 32
ROWS = 16  # rows per tile (the kernel's layout)

# What each format packs to (as from_decoded makes it): 4-bit values or not, group
# size, the offset left to the kernel, stored constants or not, and whether the
# scales (and constants) are the file's own float16s (else float32 products).
_LAYOUT = {
    GGMLType.Q4_0: (True, 32, 8.0, False, True),
    GGMLType.Q4_1: (True, 32, 0.0, True, True),
    GGMLType.Q5_0: (False, 32, 16.0, False, True),
    GGMLType.Q5_1: (False, 32, 0.0, True, True),
    GGMLType.Q8_0: (False, 32, 0.0, False, True),
    GGMLType.Q4_K: (True, 32, 0.0, True, False),
    GGMLType.Q5_K: (False, 32, 0.0, True, False),
    GGMLType.Q6_K: (False, 16, 0.0, False, False),
}


def _tile(t: torch.Tensor, rows: int) -> torch.Tensor:
    """[N, ...] -> [ceil(N / 16), 16, ...], padding rows with zeros."""
    pad = -rows % ROWS
    if pad:
        t = torch.cat([t, t.new_zeros(pad, *t.shape[1:])])
    return t.reshape(-1, ROWS, *t.shape[1:])


@dataclass
class PackedWeight:
    """A [rows, columns] matrix in tiles of 16 rows (layout in quant_ops.cpp)."""

    values: torch.Tensor  # uint8 [tiles, K*8] (4-bit pairs) or int8 [tiles, K*16]
    scales: torch.Tensor  # [tiles, K/group, 16], float16 where exact, else float32
    corr: torch.Tensor | None  # like scales; None: each constant is -offset * scale
    rows: int
    group: int
    source: str  # the format it came from, e.g. "Q4_1"
    offset: float = 0.0  # Q4_0: 8, Q5_0: 16 (when corr is None)

    @property
    def nibbles(self) -> bool:
        return self.values.dtype == torch.uint8

    @property
    def shape(self) -> tuple[int, int]:
        return self.rows, self.scales.shape[1] * self.group

    @property
    def nbytes(self) -> int:
        extra = 0 if self.corr is None else self.corr.nbytes
        return self.values.nbytes + self.scales.nbytes + extra

    @classmethod
    def from_decoded(cls, dec: Decoded, source: str) -> PackedWeight:
        rows, columns = dec.values.shape
        blocks = columns // BLOCK
        q = _tile(dec.values, rows).reshape(-1, ROWS, blocks, BLOCK)
        if dec.nibbles:
            # byte (block, pair, row, i) = weight 4*pair+i | weight 16+4*pair+i << 4
            q = q.reshape(-1, ROWS, blocks, 2, 4, 4)
            packed = q[:, :, :, 0] | (q[:, :, :, 1] << 4)  # [tiles, rows, blocks, 4, 4]
            values = packed.permute(0, 2, 3, 1, 4)
        else:
            # (block, step, row, i) = weight 4*step+i
            values = q.to(torch.int8).reshape(-1, ROWS, blocks, 8, 4).permute(0, 2, 3, 1, 4)
        values = values.reshape(values.shape[0], -1).contiguous()
        # Constants: stored only when the format has minimums; an offset alone is
        # recomputed by the kernel from the scale.
        offset = float(dec.offset)
        corr = None
        if dec.mins is not None:
            corr = dec.mins - offset * dec.scales if offset else dec.mins
            offset = 0.0
        # float16 when every scale (and constant) is one exactly: the file's own bytes.
        stored = [dec.scales] + ([corr] if corr is not None else [])
        exact = all(torch.equal(t.half().float(), t) for t in stored)
        dtype = torch.float16 if exact else torch.float32

        def tiled(t: torch.Tensor) -> torch.Tensor:
            return _tile(t.to(dtype), rows).permute(0, 2, 1).contiguous()

        return cls(
            values,
            tiled(dec.scales),
            None if corr is None else tiled(corr),
            rows,
            dec.group,
            source,
            offset,
        )

    @classmethod
    def from_ggml(cls, code: GGMLType, raw: torch.Tensor, columns: int) -> PackedWeight:
        """raw: uint8 [rows, row bytes] (the file's blocks; rows may be strided) ->
        packed, by the compiled packer when it is built (the same bytes, one pass
        across threads, nothing as large as the matrix allocated but the result),
        else through ``decode``."""
        if compiled_packer(raw):
            weight = cls.allocate(code, raw.shape[0], columns)
            weight.fill_rows(0, code, raw)
            return weight.settle_scales()
        return cls.from_decoded(decode(code, raw, columns), code.name)

    @classmethod
    def allocate(cls, code: GGMLType, rows: int, columns: int) -> PackedWeight:
        """An unfilled [rows, columns] matrix in ``code``'s packed layout, for
        ``fill_rows`` (several checkpoint tensors, such as q, k and v, packed
        straight into one matrix) and then ``settle_scales``."""
        (values, values_dtype), (scales, scales_dtype), has_corr = _packed_shapes(
            code, rows, columns
        )
        values = torch.empty(values, dtype=values_dtype)
        scales = torch.empty(scales, dtype=scales_dtype)
        corr = torch.empty_like(scales) if has_corr else None
        _, group, offset, _, _ = _LAYOUT[code]
        return cls(values, scales, corr, rows, group, code.name, offset)

    def fill_rows(self, row_start: int, code: GGMLType, raw: torch.Tensor) -> None:
        """Pack ``raw`` (``code`` blocks, uint8 [rows, row bytes]) into rows
        [row_start, row_start + rows), on the compiled packer; ``row_start`` is a whole
        tile, and a part that ends inside a tile must be the last."""
        from tandem.kernels import cpu as cpu_kernels

        columns = self.shape[1]
        check_row_bytes(code, raw, columns)
        if row_start % ROWS or row_start + raw.shape[0] > self.rows or code.name != self.source:
            raise ValueError(f"cannot pack {code.name} rows at {row_start} into {self.source}")
        first, last = row_start // ROWS, -(-(row_start + raw.shape[0]) // ROWS)
        corr = None if self.corr is None else self.corr[first:last]
        cpu_kernels.load().pack_ggml(
            raw, int(code), columns, self.values[first:last], self.scales[first:last], corr
        )

    def settle_scales(self) -> PackedWeight:
        """As from_decoded: float32 scales (and constants) become float16 when every
        one of them is one exactly (checked in slices: the first inexact one ends it)."""
        if self.scales.dtype != torch.float32:
            return self
        stored = [self.scales] + ([self.corr] if self.corr is not None else [])
        if all(_exact_half(t) for t in stored):
            self.scales = self.scales.half()
            self.corr = None if self.corr is None else self.corr.half()
        return self

    def decoded(self, tiles: torch.Tensor | None = None) -> Decoded:
        """The rows of all tiles (or of ``tiles``), padding included."""
        values, scales, corr = self.values, self.scales, self.corr
        if tiles is not None:
            values, scales = values[tiles], scales[tiles]
            corr = None if corr is None else corr[tiles]
        columns = self.shape[1]
        blocks = columns // BLOCK
        if self.nibbles:
            v = values.reshape(-1, blocks, 4, ROWS, 4).permute(0, 3, 1, 2, 4)
            q = torch.stack([v & 0x0F, v >> 4], dim=3)  # [tiles, rows, blocks, 2, 4, 4]
        else:
            q = values.reshape(-1, blocks, 8, ROWS, 4).permute(0, 3, 1, 2, 4)
        q = q.reshape(-1, columns)

        def untiled(t: torch.Tensor) -> torch.Tensor:
            return t.float().permute(0, 2, 1).reshape(-1, t.shape[1])

        scales = untiled(scales)
        mins = untiled(corr) if corr is not None else None
        if corr is None and self.offset:
            mins = -self.offset * scales
        return Decoded(q, scales, mins, 0, self.group)

    def dequantize(self) -> torch.Tensor:
        """float32 [N, K]."""
        return dequantize_decoded(self.decoded())[: self.rows]

    def dequantize_rows(self, index: torch.Tensor) -> torch.Tensor:
        """Selected rows dequantized (an embedding lookup): float32 [len(index), K];
        the compiled kernel when it is there (one call), else torch."""
        from tandem.kernels import cpu as cpu_kernels

        if cpu_kernels.available(index.device, torch.float32):
            out = torch.empty(len(index), self.shape[1])
            cpu_kernels.load().quant_rows(
                out, index.contiguous(), self.values, self.scales, self.corr, self.group,
                self.offset,
            )  # fmt: skip
            return out
        tiles, position = index // ROWS, index % ROWS
        unique, inverse = torch.unique(tiles, return_inverse=True)
        dense = dequantize_decoded(self.decoded(unique)).reshape(len(unique), ROWS, -1)
        return dense[inverse, position]

    def matmul(self, x: torch.Tensor, out: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        """out [T, N] (rows may be strided) = x [T, K] float32 @ W^T (+ bias), on the
        compiled kernel."""
        from tandem.kernels import cpu as cpu_kernels

        cpu_kernels.load().quant_linear(
            out, x, self.values, self.scales, self.corr, bias, self.rows, self.group, self.offset
        )


def _packed_shapes(code: GGMLType, rows: int, columns: int):
    """((values shape, dtype), (scales shape, dtype), whether corr is stored) of a
    [rows, columns] matrix of ``code`` packed (K formats with float32 scales, as
    ``allocate`` makes them before ``settle_scales``)."""
    nibbles, group, _, has_corr, file_scales = _LAYOUT[code]
    tiles = -(-rows // ROWS)
    values = ((tiles, columns * (8 if nibbles else 16)), torch.uint8 if nibbles else torch.int8)
    scales = ((tiles, columns // group, ROWS), torch.float16 if file_scales else torch.float32)
    return values, scales, has_corr


def packed_nbytes(code: GGMLType, rows: int, columns: int) -> int:
    """Bytes a [rows, columns] matrix of ``code`` takes packed (as ``allocate`` makes
    it; K formats counted with float32 scales, as real files have them)."""
    (values, _), (scales, scales_dtype), has_corr = _packed_shapes(code, rows, columns)
    scale_bytes = math.prod(scales) * scales_dtype.itemsize
    return math.prod(values) + scale_bytes * (2 if has_corr else 1)


def compiled_packer(raw: torch.Tensor) -> bool:
    """Whether the compiled packer takes ``raw`` (a CPU tensor, rows contiguous)."""
    from tandem.kernels import cpu as cpu_kernels

    return cpu_kernels.available(raw.device, torch.float32) and raw.stride(-1) == 1


def _exact_half(t: torch.Tensor) -> bool:
    return all(torch.equal(c.half().float(), c) for c in t.reshape(-1).split(1 << 20))


def quantize_activations(x: torch.Tensor) -> torch.Tensor:
    """x [T, K] -> the values the kernel multiplies: per block of 32, q * d with
    d = max|x| * (1 / 127) and q = round(x * (1 / d)), computed in float32 exactly as
    the kernel does (another rounding of d moves a few halfway values of q)."""
    blocks = x.float().reshape(x.shape[0], -1, BLOCK)
    d = blocks.abs().amax(-1, keepdim=True) * torch.tensor(1 / 127, dtype=torch.float32)
    inverse = torch.where(d > 0, 1 / torch.where(d > 0, d, 1), 0)
    q = torch.round(blocks * inverse)
    return (q.double() * d.double()).reshape(x.shape)


def reference(weight: PackedWeight, x: torch.Tensor) -> torch.Tensor:
    """What ``matmul`` computes, in float64 from the dequantized weights."""
    return quantize_activations(x) @ weight.dequantize().double().T
