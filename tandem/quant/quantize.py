"""Float weights -> llama.cpp block bytes (Q8_0, Q4_0, Q4_K), for quantize-on-load and
GGUF export.

The output is the file format itself (blocks.py's layouts), so a quantized model is
packed for the kernel by the same decoder that reads GGUF files, and written to GGUF
as it is. Q8_0 and Q4_0 follow llama.cpp's reference quantizers (round to nearest,
Q4_0's scale from the value of largest magnitude, d = that / -8). Q4_K uses each
group of 32's own range (scale = (max - min) / 15, min <= 0) with the scales and mins
rounded to 6 bits of the super-block's d and dmin; llama.cpp searches each group's
scale and min iteratively (make_qkx2_quants), which lowers its error a little more.
"""

from __future__ import annotations

import torch

from tandem.quant.blocks import FORMATS as BLOCK_FORMATS
from tandem.quant.blocks import GGMLType

# What tandem writes (blocks.FORMATS' quantized_by_tandem), by the name users give.
FORMATS = {code.name.lower(): code for code, f in BLOCK_FORMATS.items() if f.quantized_by_tandem}


def _f16_bytes(x: torch.Tensor) -> torch.Tensor:
    """[...] float -> [..., 2] uint8 (float16, little-endian)."""
    return x.to(torch.float16).contiguous().view(torch.uint8).reshape(*x.shape, 2)


def _nibble_pairs(low: torch.Tensor, high: torch.Tensor) -> torch.Tensor:
    return (low.to(torch.uint8) & 0x0F) | (high.to(torch.uint8) << 4)


def quantize_q8_0(w: torch.Tensor) -> torch.Tensor:
    rows = w.shape[0]
    blocks = w.float().reshape(rows, -1, 32)
    d = blocks.abs().amax(-1, keepdim=True) / 127
    inverse = torch.where(d > 0, 1 / torch.where(d > 0, d, 1), 0)
    q = torch.round(blocks * inverse).to(torch.int8)
    raw = torch.cat([_f16_bytes(d.squeeze(-1)), q.view(torch.uint8)], dim=-1)
    return raw.reshape(rows, -1)


def quantize_q4_0(w: torch.Tensor) -> torch.Tensor:
    rows = w.shape[0]
    blocks = w.float().reshape(rows, -1, 32)
    index = blocks.abs().argmax(-1, keepdim=True)
    extreme = blocks.gather(-1, index)  # the signed value of largest magnitude
    d = extreme / -8
    inverse = torch.where(d != 0, 1 / torch.where(d != 0, d, 1), 0)
    q = torch.clamp(torch.floor(blocks * inverse + 8.5), 0, 15)
    packed = _nibble_pairs(q[..., :16], q[..., 16:])
    raw = torch.cat([_f16_bytes(d.squeeze(-1)), packed], dim=-1)
    return raw.reshape(rows, -1)


def quantize_q4_k(w: torch.Tensor) -> torch.Tensor:
    rows = w.shape[0]
    groups = w.float().reshape(rows, -1, 8, 32)  # super-blocks of 8 groups
    low = groups.amin(-1).clamp(max=0)
    scale = (groups.amax(-1) - low) / 15
    minimum = -low  # w = scale * q - minimum
    d = scale.amax(-1, keepdim=True) / 63
    dmin = minimum.amax(-1, keepdim=True) / 63
    # The stored (float16) d and dmin are what dequantization multiplies by.
    d = d.to(torch.float16).float()
    dmin = dmin.to(torch.float16).float()
    sc = torch.where(d > 0, torch.round(scale / torch.where(d > 0, d, 1)), 0).clamp(0, 63)
    mn = torch.where(dmin > 0, torch.round(minimum / torch.where(dmin > 0, dmin, 1)), 0)
    mn = mn.clamp(0, 63)
    step = (d * sc).unsqueeze(-1)
    offset = (dmin * mn).unsqueeze(-1)
    q = torch.where(step > 0, torch.round((groups + offset) / torch.where(step > 0, step, 1)), 0)
    q = q.clamp(0, 15)
    sc, mn = sc.to(torch.uint8), mn.to(torch.uint8)
    scales = torch.cat(
        [
            (sc[..., :4] & 0x3F) | ((sc[..., 4:] >> 4) << 6),
            (mn[..., :4] & 0x3F) | ((mn[..., 4:] >> 4) << 6),
            (sc[..., 4:] & 0x0F) | ((mn[..., 4:] & 0x0F) << 4),
        ],
        dim=-1,
    )
    # Each 32 bytes: group 2c's values in the low nibbles, group 2c + 1's in the high.
    qs = _nibble_pairs(q[..., 0::2, :], q[..., 1::2, :]).reshape(rows, -1, 128)
    raw = torch.cat([_f16_bytes(d.squeeze(-1)), _f16_bytes(dmin.squeeze(-1)), scales, qs], dim=-1)
    return raw.reshape(rows, -1)


QUANTIZERS = {
    GGMLType.Q8_0: quantize_q8_0,
    GGMLType.Q4_0: quantize_q4_0,
    GGMLType.Q4_K: quantize_q4_k,
}


def quantize(w: torch.Tensor, code: GGMLType) -> torch.Tensor:
    """w [N, K] -> uint8 [N, row bytes] in format ``code`` (K a multiple of its block)."""
    return QUANTIZERS[code](w)
