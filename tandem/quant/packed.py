"""PackedWeight: a quantized matrix in the layout the integer-dot kernel reads.

Any GGML format decodes (blocks.py) to ``w = scale * (q - offset) + min`` per group;
packing keeps ``q`` as it is stored, at the file's bits (4: Q4_0 / Q4_1 / Q4_K, two a
byte; 5: the Q5 formats and 6: Q6_K, as those nibbles plus planes of the high bits;
8: Q8_0's int8), the offset as a number the kernel takes off in integers, and the
scales in the file's own precision, so that one kernel (tandem/kernels/quant_ops.cpp,
which documents the layout) serves every format:

- Q4_0, Q4_1, Q5_0, Q5_1, Q8_0: float16 scales [tiles, K/32, 16], the file's bits;
  Q4_1 and Q5_1's minimums the same way (``corr``, the file's ``m``).
- the K formats: a scale is a float16 ``d`` per super-block of 256 weights times an
  8-bit sub-scale per group (and a minimum ``-(dmin * sub-min)``), which no float16
  holds. They are kept factored, one record per tile and super-block (uint8
  [tiles, K/256 * record bytes], corr None), and the kernel multiplies them out in
  float32 as blocks.py does, so the weights are the same numbers:
      Q4_K, Q5_K (group 32): d[16], dmin[16] (float16), sub-scales [8][16] and
                             sub-mins [8][16] (uint8): 320 bytes
      Q6_K (group 16):       d[16] (float16), sub-scales [16][16] (int8): 288 bytes
                             (Q3_K's, the ternary types' and IQ4_XS's too)
      Q2_K (group 16):       d[16], dmin[16] (float16), [16][16] bytes of a
                             sub-scale (low nibble) and a sub-min (high), as the
                             file packs them: 320 bytes
  (Q4_K: 4.625 bits a weight against the file's 4.5; Q6_K 6.5625 as the file; IQ4_XS,
  its levels as int8, 8.5625 against 4.25.)
- the codebook i-quants (IQ3_XXS, IQ3_S, IQ2_*, IQ1_*): the file's blocks, a tile's 16
  rows side by side per super-block (uint8 [tiles, K/256 * 16 * block bytes], scales
  empty, ``table`` the type's code: ``codebook``), at the file's bits. The kernel
  decodes each tile through its grid as it multiplies it, into int8 values under Q6_K's
  records (what ``from_decoded`` holds them as, the same products bit for bit); d / 4
  and d / 8 are the file's d and a power of two apart (``factor``), which the kernel
  multiplies each output by.

Where the kernels read the compact layouts (``layout_bits``: the AVX2 and portable
paths), IQ4_NL, IQ4_XS and MXFP4 keep their 4-bit indices into a table of 16 levels,
read through a byte shuffle (``table_layout``), as Q4_0's nibbles under their own scales
(4.5 / 4.5625 / 4.5 bits a weight), and Q2_K and the ternary types keep 2 bits a value,
Q3_K 3 (crumbs and a plane: 2.625, 2.5625, 3.5625); elsewhere the table formats' levels
as int8 (MXFP4's as Q5_0's values) and the 2- and 3-bit values a nibble each.

``nbytes`` reports what is held. ``reference`` is the exact math the kernel must
reproduce: the activations quantized to int8 per block of 32 as the kernel does,
times the dequantized weights, in float64.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from tandem.quant.blocks import (
    FORMATS,
    TABLES,
    Decoded,
    GGMLType,
    check_row_bytes,
    decode,
    dequantize_decoded,
    grid,
)

BLOCK = 32
ROWS = 16  # rows per tile (the kernel's layout)
SUPER = 256  # weights per K-format super-block
# Value vector s = 4h + p's crumbs sit at bit 2p of crumb vector h (quant_ops.cpp).
_CRUMB_SHIFTS = (2 * torch.arange(4, dtype=torch.uint8)).view(1, 1, 1, 1, 4, 1)


def _low_bits(bits: int) -> int:
    """The low bits a value of ``bits`` takes from the nibble or crumb vectors
    (quant_ops.cpp's values::low): 4, or 2 for 2- and 3-bit values."""
    return 2 if bits < 4 else 4


def _nibbles(group: int, mins: bool) -> bool:
    """Whether a record keeps a group's sub-scale and sub-min in one byte (quant_ops.cpp's
    record::nibbles: groups of 16 with minimums, Q2_K's, as the file packs them)."""
    return group == 16 and mins


def record_bytes(group: int, mins: bool) -> int:
    """Bytes of one tile's record per super-block (quant_ops.cpp's quant::record): d
    (and dmin) as float16, then a byte per group's sub-scale (and sub-min: its own byte,
    or, for groups of 16, the sub-scale's high nibble), each item for the tile's 16 rows
    side by side: 320 for groups of 32 (always with minimums) and for groups of 16 with
    minimums (Q2_K), 288 for groups of 16."""
    items = 1 + mins
    return ROWS * (2 * items + SUPER // group * (1 if _nibbles(group, mins) else items))


def kernels_read_compact() -> bool:
    """Whether the CPU kernels here read the compact layouts: 4-bit table indices, 2-
    and 3-bit values (kernels/cpu.py's reads_compact_layouts: known without building
    them)."""
    from tandem.kernels import cpu as cpu_kernels

    return cpu_kernels.reads_compact_layouts()


def layout_bits(code: GGMLType) -> int:
    """Bits a value of ``code`` takes packed: its FORMATS row's compact bits where the
    kernels read them, else its packed bits."""
    spec = FORMATS[code]
    return spec.compact_bits if spec.compact_bits and kernels_read_compact() else spec.packed_bits


def table_layout(code: GGMLType) -> int:
    """The table ``code``'s packed values index (its FORMATS row's, where the kernels
    read compact layouts), 0: its values are held as they decode."""
    table = FORMATS[code].table
    return table if table and kernels_read_compact() else 0


def _tile(t: torch.Tensor, rows: int) -> torch.Tensor:
    """[N, ...] -> [ceil(N / 16), 16, ...], padding rows with zeros."""
    pad = -rows % ROWS
    if pad:
        t = torch.cat([t, t.new_zeros(pad, *t.shape[1:])])
    return t.reshape(-1, ROWS, *t.shape[1:])


@dataclass
class PackedWeight:
    """A [rows, columns] matrix in tiles of 16 rows (layout in quant_ops.cpp)."""

    values: torch.Tensor  # uint8 [tiles, K * 2 * bits] (2-6 bits) or int8 [tiles, K*16]
    scales: torch.Tensor  # float16 [tiles, K/group, 16], or uint8 super-block records
    corr: torch.Tensor | None  # like float16 scales: the minimums; None: none, or in records
    rows: int
    group: int
    source: str  # the format it came from, e.g. "Q4_1"
    offset: float = 0.0  # the values': Q4_0 8, Q5_0 16, Q6_K 32
    record: int = 0  # bytes of a tile's super-block record (record_bytes); 0: float16 scales
    factor: float = 1.0  # a power of two every scale takes (SuperScales.factor)
    # The TABLES entry its 4-bit values index (table_layout); a codebook type's GGML code,
    # whose blocks the values are (codebook_layout); 0: none.
    table: int = 0

    @property
    def codebook(self) -> GGMLType | None:
        """The codebook type whose blocks ``values`` holds, decoded as the kernel
        multiplies (quant_ops.cpp's expand_codebook); None for the other layouts."""
        return GGMLType(self.table) if self.table not in TABLES and self.table else None

    @property
    def records(self) -> bool:
        """Scales kept as K-format super-block records (see the module's docstring)."""
        return self.record > 0

    @property
    def shape(self) -> tuple[int, int]:
        if self.codebook is not None:
            return self.rows, self.values.shape[1] // (ROWS * FORMATS[self.codebook].nbytes) * SUPER
        if self.records:
            return self.rows, self.scales.shape[1] // self.record * SUPER
        return self.rows, self.scales.shape[1] * self.group

    @property
    def bits(self) -> int:
        """Bits a value takes: 2 to 6 (uint8 crumbs or nibbles, and planes) or 8 (int8, and
        the codebook types' values, as their blocks decode)."""
        if self.values.dtype == torch.int8 or self.codebook is not None:
            return 8
        return self.values.shape[1] // (2 * self.shape[1])

    @property
    def nbytes(self) -> int:
        extra = 0 if self.corr is None else self.corr.nbytes
        return self.values.nbytes + self.scales.nbytes + extra

    @classmethod
    def from_decoded(cls, dec: Decoded, source: str) -> PackedWeight:
        rows = dec.values.shape[0]
        code = GGMLType[source] if source in GGMLType.__members__ else None
        table = table_layout(code) if code is not None else 0
        bits = layout_bits(code) if code is not None else dec.bits
        q = _table_indices(dec, table) if table else dec.values
        values = _pack_values(_tile(q, rows), bits)
        offset = 0.0 if table else float(dec.offset)
        if dec.supers is not None:
            record = record_bytes(dec.group, dec.supers.dmin is not None)
            records = _records(dec, rows)
            factor = dec.supers.factor
            return cls(values, records, None, rows, dec.group, source, offset, record, factor,
                       table)  # fmt: skip

        def tiled(t: torch.Tensor) -> torch.Tensor:
            half = t.half()
            if not torch.equal(half.float(), t):
                raise ValueError(f"{source}'s scales are not float16 numbers")
            return _tile(half, rows).permute(0, 2, 1).contiguous()

        corr = None if dec.mins is None else tiled(dec.mins)
        return cls(values, tiled(dec.scales), corr, rows, dec.group, source, offset, table=table)

    @classmethod
    def from_ggml(cls, code: GGMLType, raw: torch.Tensor, columns: int) -> PackedWeight:
        """raw: uint8 [rows, row bytes] (the file's blocks; rows may be strided) ->
        packed, by the compiled packer when it is built (the same bytes, one pass
        across threads, nothing as large as the matrix allocated but the result),
        else through ``decode``."""
        if compiled_packer(raw):
            weight = cls.allocate(code, raw.shape[0], columns)
            weight.fill_rows(0, code, raw)
            return weight
        if codebook_layout(code):
            weight = cls.allocate(code, raw.shape[0], columns)
            weight.values.copy_(_tile_blocks(raw, FORMATS[code].nbytes))
            return weight
        return cls.from_decoded(decode(code, raw, columns), code.name)

    @classmethod
    def allocate(cls, code: GGMLType, rows: int, columns: int) -> PackedWeight:
        """An unfilled [rows, columns] matrix in ``code``'s packed layout, for
        ``fill_rows`` (several checkpoint tensors, such as q, k and v, packed
        straight into one matrix)."""
        (values, values_dtype), (scales, scales_dtype), has_corr = _packed_shapes(
            code, rows, columns
        )
        values = torch.empty(values, dtype=values_dtype)
        scales = torch.empty(scales, dtype=scales_dtype)
        corr = torch.empty_like(scales) if has_corr else None
        spec, table = FORMATS[code], table_layout(code)
        group, offset, record = spec.group, 0.0 if table else spec.offset, spec.record_bytes
        if codebook_layout(code):
            _give_kernels_grid(code)
            table, record = int(code), 0
        return cls(values, scales, corr, rows, group, code.name, offset, record, spec.factor,
                   table)  # fmt: skip

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

    def decoded(self, tiles: torch.Tensor | None = None) -> Decoded:
        """The rows of all tiles (or of ``tiles``), padding included."""
        values, scales, corr = self.values, self.scales, self.corr
        if tiles is not None:
            values, scales = values[tiles], scales[tiles]
            corr = None if corr is None else corr[tiles]
        if self.codebook is not None:
            return decode(self.codebook, _untile_blocks(values, FORMATS[self.codebook].nbytes),
                          self.shape[1])  # fmt: skip
        q = _unpack_values(values, self.bits).reshape(-1, self.shape[1])
        bits = self.bits
        if self.table:  # the indices' levels, as int8 values
            q, bits = TABLES[self.table][q.long()], 8

        def untiled(t: torch.Tensor) -> torch.Tensor:
            return t.float().permute(0, 2, 1).reshape(-1, t.shape[1])

        offset = int(self.offset)
        if self.records:
            scales, mins = _unrecord(scales, self.group, self.record)
            mins = None if mins is None else untiled(mins)
            return Decoded(q, untiled(scales) * self.factor, mins, offset, self.group, bits)
        mins = untiled(corr) if corr is not None else None
        return Decoded(q, untiled(scales), mins, offset, self.group, bits)

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
                self.offset, self.factor, self.table,
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
            out, x, self.values, self.scales, self.corr, bias, self.rows, self.group,
            self.offset, self.factor, self.table,
        )  # fmt: skip


def codebook_layout(code: GGMLType) -> bool:
    """Whether ``code`` is held as its file's blocks (the codebook types: 1.56-3.06 bits a
    weight where int8 values take 8.56), each tile decoded as the kernel multiplies it."""
    return FORMATS[code].codebook


def _give_kernels_grid(code: GGMLType) -> None:
    """The compiled kernels, where there are any, given ``code``'s grid (once a module:
    they keep it)."""
    from tandem.kernels import cpu as cpu_kernels

    if not cpu_kernels.available(torch.device("cpu"), torch.float32):
        return
    kernels = cpu_kernels.load()
    if (id(kernels), code) not in _GRIDS_GIVEN:
        kernels.set_codebook_grid(int(code), grid(code))
        _GRIDS_GIVEN.add((id(kernels), code))


_GRIDS_GIVEN: set[tuple[int, GGMLType]] = set()  # (the module's id, the type)


def _tile_blocks(raw: torch.Tensor, block_bytes: int) -> torch.Tensor:
    """A codebook type's rows of blocks (uint8 [rows, K/256 * block bytes]) in the
    kernel's layout (quant_ops.cpp's codebook_offset): per tile and super-block, its 16
    rows' blocks side by side; padding rows zero."""
    tiled = _tile(raw, raw.shape[0])  # [tiles, 16, supers * bytes]
    tiled = tiled.reshape(tiled.shape[0], ROWS, -1, block_bytes).transpose(1, 2)
    return tiled.reshape(tiled.shape[0], -1)


def _untile_blocks(values: torch.Tensor, block_bytes: int) -> torch.Tensor:
    """_tile_blocks undone: uint8 [tiles * 16, K/256 * block bytes]."""
    tiles = values.reshape(values.shape[0], -1, ROWS, block_bytes).transpose(1, 2)
    return tiles.reshape(values.shape[0] * ROWS, -1)


def _table_indices(dec: Decoded, table: int) -> torch.Tensor:
    """A table format's decoded levels back to their 4-bit indices into TABLES[table]
    (uint8; MXFP4's 0 as index 0, as the compiled packer writes its -0)."""
    index = torch.zeros(256, dtype=torch.uint8)
    for i, level in reversed(list(enumerate(TABLES[table].tolist()))):
        index[level + 128] = i
    return index[dec.values.long() - dec.offset + 128]


def _pack_values(q: torch.Tensor, bits: int) -> torch.Tensor:
    """Tiled values [tiles, 16, K] (uint8, or int8 for 8 bits) -> [tiles, K * 2 * bits]
    in the kernel's layout (quant_ops.cpp): per block of 32, ``bits`` vectors of
    [16 rows, 4] bytes."""
    tiles, _, columns = q.shape
    q = q.reshape(tiles, ROWS, columns // BLOCK, 8, 4)  # (row, block, vector s, i)
    if bits == 8:  # vector s: weights 4s..4s+3
        vectors = q
    else:
        # Nibble vector p: weights 4p+i (low nibble) and 16+4p+i (high); or (2 and 3
        # bits) crumb vector h: value vector s = 4h + p's at bit 2p; then the high bits
        # of the eight value vectors s, hb = bits - low each, s's at bit hb*s of the
        # planes.
        low_bits = _low_bits(bits)
        low, high = q & ((1 << low_bits) - 1), q >> low_bits
        if low_bits == 4:
            vectors = low[:, :, :, :4] | (low[:, :, :, 4:] << 4)
        else:
            crumbs = low.reshape(tiles, ROWS, -1, 2, 4, 4) << _CRUMB_SHIFTS
            vectors = crumbs.sum(4, dtype=torch.uint8)
        hb = bits - low_bits
        if hb:
            per_byte = 8 // hb
            shifts = (hb * torch.arange(per_byte, dtype=torch.uint8)).view(1, 1, 1, 1, -1, 1)
            planes = high.reshape(tiles, ROWS, -1, hb, per_byte, 4) << shifts
            vectors = torch.cat([vectors, planes.sum(4, dtype=torch.uint8)], dim=3)
    return vectors.permute(0, 2, 3, 1, 4).reshape(tiles, -1).contiguous()


def _unpack_values(values: torch.Tensor, bits: int) -> torch.Tensor:
    """_pack_values undone: [tiles, K * 2 * bits] -> [tiles, 16, K]."""
    tiles = values.shape[0]
    v = values.reshape(tiles, -1, bits, ROWS, 4).permute(0, 3, 1, 2, 4)  # (row, block, vector)
    if bits == 8:
        return v.reshape(tiles, ROWS, -1)
    low_bits = _low_bits(bits)
    if low_bits == 4:
        nibbles = v[:, :, :, :4]
        low = torch.cat([nibbles & 0x0F, nibbles >> 4], dim=3)  # value vectors s = 4h + p
    else:
        crumbs = (v[:, :, :, :2].unsqueeze(4) >> _CRUMB_SHIFTS) & 0x03  # (.., h, p, i)
        low = crumbs.reshape(*v.shape[:3], 8, 4)
    hb = bits - low_bits
    if hb:
        per_byte = 8 // hb
        shifts = (hb * torch.arange(per_byte, dtype=torch.uint8)).view(1, 1, 1, 1, -1, 1)
        planes = v[:, :, :, low_bits:].unsqueeze(4) >> shifts  # (row, block, plane, s in it, i)
        high = (planes & ((1 << hb) - 1)).reshape(low.shape)
        low = low | (high << low_bits)
    return low.reshape(tiles, ROWS, -1)


def _records(dec: Decoded, rows: int) -> torch.Tensor:
    """A K format's factored scales -> uint8 [tiles, K/256 * record bytes] (the
    module's docstring), padding rows zero."""
    supers = dec.supers

    def per_row(t: torch.Tensor, each: int) -> torch.Tensor:
        """[rows, K/256 * each] -> uint8 [tiles, K/256, each * 16]: per super-block,
        item by item, the tile's 16 rows side by side."""
        t = _tile(t, rows)  # [tiles, 16, K/256 * each]
        t = t.reshape(t.shape[0], ROWS, -1, each).permute(0, 2, 3, 1)
        return t.contiguous().view(torch.uint8).reshape(t.shape[0], t.shape[1], -1)

    subs = SUPER // dec.group
    parts = [per_row(supers.d.half(), 1)]
    if supers.dmin is not None and _nibbles(dec.group, True):
        parts.append(per_row(supers.dmin.half(), 1))
        parts.append(per_row(supers.sub | (supers.sub_mins << 4), subs))
    elif supers.dmin is not None:
        parts.append(per_row(supers.dmin.half(), 1))
        parts += [per_row(supers.sub, subs), per_row(supers.sub_mins, subs)]
    else:
        parts.append(per_row(supers.sub.view(torch.uint8), subs))
    records = torch.cat(parts, dim=-1)
    return records.reshape(records.shape[0], -1)


def _unrecord(
    records: torch.Tensor, group: int, record: int
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """uint8 records [tiles, K/256 * record] -> float32 scales and minimums
    [tiles, K/group, 16] (None without minimums), multiplied out as blocks.py does;
    sub-scales of groups of 16 are int8, of 32 uint8."""
    tiles, subs = records.shape[0], SUPER // group
    mins = record == record_bytes(group, True)
    r = records.reshape(tiles, -1, record)

    def halves(item: int) -> torch.Tensor:
        part = r[..., 2 * ROWS * item : 2 * ROWS * (item + 1)]
        return part.contiguous().view(torch.float16).float().unsqueeze(2)

    start = 2 * ROWS * (1 + mins)
    sub = r[..., start : start + subs * ROWS].reshape(tiles, -1, subs, ROWS)
    if _nibbles(group, mins):
        sub, low = sub & 0x0F, sub >> 4
    elif mins:
        low = r[..., start + subs * ROWS :].reshape(tiles, -1, subs, ROWS)
    if group == 16:
        sub = sub.contiguous().view(torch.int8)
    scales = (halves(0) * sub.float()).reshape(tiles, -1, ROWS)
    if not mins:
        return scales, None
    return scales, (-(halves(1) * low.float())).reshape(tiles, -1, ROWS)


def _packed_shapes(code: GGMLType, rows: int, columns: int):
    """((values shape, dtype), (scales shape, dtype), whether corr is stored) of a
    [rows, columns] matrix of ``code`` packed (as ``allocate`` makes it)."""
    spec = FORMATS[code]
    bits, group, has_corr, record = layout_bits(code), spec.group, spec.has_corr, spec.record_bytes
    tiles = -(-rows // ROWS)
    if codebook_layout(code):  # its blocks, no scales beside them
        blocks = (tiles, columns // SUPER * ROWS * spec.nbytes)
        return (blocks, torch.uint8), ((tiles, 0), torch.uint8), False
    values = ((tiles, columns * 2 * bits), torch.int8 if bits == 8 else torch.uint8)
    if record:
        scales = ((tiles, columns // SUPER * record), torch.uint8)
    else:
        scales = ((tiles, columns // group, ROWS), torch.float16)
    return values, scales, has_corr


def packed_nbytes(code: GGMLType, rows: int, columns: int) -> int:
    """Bytes a [rows, columns] matrix of ``code`` takes packed (as ``allocate`` makes
    it)."""
    (values, _), (scales, scales_dtype), has_corr = _packed_shapes(code, rows, columns)
    scale_bytes = math.prod(scales) * scales_dtype.itemsize
    return math.prod(values) + scale_bytes * (2 if has_corr else 1)


def compiled_packer(raw: torch.Tensor) -> bool:
    """Whether the compiled packer takes ``raw`` (a CPU tensor, rows contiguous)."""
    from tandem.kernels import cpu as cpu_kernels

    return cpu_kernels.available(raw.device, torch.float32) and raw.stride(-1) == 1


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
