"""Float weights -> llama.cpp block bytes, for quantize-on-load (Q8_0, Q4_0, Q4_K) and
GGUF export (those, and Q3_K, Q2_K, IQ4_NL, IQ4_XS, MXFP4, Q5_0).

The output is the file format itself (blocks.py's layouts), so a quantized model is
packed for the kernel by the same decoder that reads GGUF files, and written to GGUF
as it is. Q8_0 and Q4_0 follow llama.cpp's reference quantizers (round to nearest,
Q4_0's scale from the value of largest magnitude, d = that / -8). Q4_K uses each
group of 32's own range (scale = (max - min) / 15, min <= 0) with the scales and mins
rounded to 6 bits of the super-block's d and dmin; llama.cpp searches each group's
scale and min iteratively (make_qkx2_quants), which lowers its error a little more.
The 2- to 4-bit formats that need no importance matrix to be useful search their scales
as llama.cpp's reference quantizers do (scale_search.py); MXFP4 (a power-of-two scale
a block, the nearest FP4 value) and Q5_0 are gguf-py's ports of llama.cpp's.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from tandem.quant import scale_search
from tandem.quant.blocks import GGMLType, f16_bytes


def _nibble_pairs(low: torch.Tensor, high: torch.Tensor) -> torch.Tensor:
    return (low.to(torch.uint8) & 0x0F) | (high.to(torch.uint8) << 4)


def quantize_q8_0(w: torch.Tensor) -> torch.Tensor:
    rows = w.shape[0]
    blocks = w.float().reshape(rows, -1, 32)
    d = blocks.abs().amax(-1, keepdim=True) / 127
    inverse = torch.where(d > 0, 1 / torch.where(d > 0, d, 1), 0)
    q = torch.round(blocks * inverse).to(torch.int8)
    raw = torch.cat([f16_bytes(d.squeeze(-1)), q.view(torch.uint8)], dim=-1)
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
    raw = torch.cat([f16_bytes(d.squeeze(-1)), packed], dim=-1)
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
    raw = torch.cat([f16_bytes(d.squeeze(-1)), f16_bytes(dmin.squeeze(-1)), scales, qs], dim=-1)
    return raw.reshape(rows, -1)


def by_gguf_py(code: GGMLType) -> Callable[[torch.Tensor], torch.Tensor]:
    """gguf-py's quantizer for ``code`` (llama.cpp's reference, ported to numpy)."""

    def run(w: torch.Tensor) -> torch.Tensor:
        import gguf
        from gguf import quants

        raw = quants.quantize(w.float().numpy(), gguf.GGMLQuantizationType(int(code)))
        return torch.from_numpy(raw)

    return run


def searched(code: GGMLType, in_torch: Callable[[torch.Tensor], torch.Tensor]):
    """A scale-searching quantizer: kernels/quantize_ops.cpp across threads, or, where
    the kernels are not built, scale_search.py's torch version of the same search."""

    def run(w: torch.Tensor) -> torch.Tensor:
        from tandem.kernels import cpu as cpu_kernels

        if cpu_kernels.available(w.device, torch.float32):
            return cpu_kernels.load().quantize_ggml(w.float().contiguous(), int(code))
        return in_torch(w)

    return run


QUANTIZERS = {
    GGMLType.Q8_0: quantize_q8_0,
    GGMLType.Q4_0: quantize_q4_0,
    GGMLType.Q4_K: quantize_q4_k,
    GGMLType.Q3_K: searched(GGMLType.Q3_K, scale_search.quantize_q3_k),
    GGMLType.Q2_K: searched(GGMLType.Q2_K, scale_search.quantize_q2_k),
    GGMLType.IQ4_NL: searched(GGMLType.IQ4_NL, scale_search.quantize_iq4_nl),
    GGMLType.IQ4_XS: searched(GGMLType.IQ4_XS, scale_search.quantize_iq4_xs),
    GGMLType.MXFP4: by_gguf_py(GGMLType.MXFP4),
    GGMLType.Q5_0: by_gguf_py(GGMLType.Q5_0),  # (llama-quantize's Q4_K rows of 32s)
}

# What tandem writes, by the name users give (``tandem quantize --type``).
FORMATS = {code.name.lower(): code for code in QUANTIZERS}

_CHUNK = 1 << 22  # weights quantized at once (the searches hold a few copies of them)


def quantize(w: torch.Tensor, code: GGMLType) -> torch.Tensor:
    """w [N, K] -> uint8 [N, row bytes] in format ``code`` (K a multiple of its block),
    a few rows at a time."""
    step = max(1, _CHUNK // max(1, w.shape[1]))
    if w.shape[0] <= step:
        return QUANTIZERS[code](w)
    return torch.cat([QUANTIZERS[code](w[i : i + step]) for i in range(0, w.shape[0], step)])
