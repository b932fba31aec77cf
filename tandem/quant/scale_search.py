"""Float weights -> Q3_K, Q2_K, IQ4_NL and IQ4_XS bytes, by the scale searches of
llama.cpp's reference quantizers (ggml-quants.c, the path llama-quantize takes when no
importance matrix is given).

At 2 to 4 bits, rounding to a scale taken from the largest value wastes levels; each of
these formats searches every group's scale (and Q2_K's minimum) for the least weighted
error, then rounds the group scales to the super-block's few bits and re-quantizes:

- Q3_K, groups of 16, levels -4..3: a least-squares scale weighted by x², improved by
  coordinate descent over the levels (make_q3_quants); group scales rounded to 6 signed
  bits of the super-block's d.
- Q2_K, groups of 16, levels 0..3 and a minimum: 16 candidate scales around the range,
  each fitted by weighted least squares with a minimum, kept when its absolute error
  (weighted by |x|) is lower (make_qkx2_quants); scales and minimums rounded to 4 bits.
- IQ4_NL (one block of 32) and IQ4_XS (8 blocks of 32 a super-block, 6-bit block
  scales): the nearest of the 16 non-linear levels, the scale chosen among 15 candidates
  by the x²-weighted least-squares fit.

Everything is vectorized over groups: a step that is sequential in the reference (the
coordinate descent over a group's 16 levels, the candidates kept only when strictly
better) runs in the same order over all groups at once, sums add first to last and
divisions are float32 divisions, as the reference's. Where the C compiler fuses a
multiply and an add the last bit can still differ, and a block can then take the other
of two near-equal candidates (`python -m benchmarks.quantizer_agreement` counts the
blocks equal to llama-quantize's bytes). kernels/quantize_ops.cpp is the same search in
C++ across threads, which quantize.py uses where the kernels are built.
"""

from __future__ import annotations

import torch

from tandem.quant.blocks import IQ4_NL_VALUES, f16_bytes

_EPS = 1e-15  # llama.cpp's GROUP_MAX_EPS: a group whose largest |x| is below is zero


def _over(numerator: float | torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """numerator / t in float32, 0 where t is 0. (torch's ``number / tensor`` multiplies
    by a reciprocal, an ulp away from the division the reference makes.)"""
    safe = torch.where(t != 0, t, 1)
    return torch.where(t != 0, torch.as_tensor(numerator, dtype=torch.float32) / safe, 0)


def _through_f16(x: torch.Tensor) -> torch.Tensor:
    """float32 -> the float32 value of its float16 rounding (what a block stores)."""
    return x.to(torch.float16).float()


def _in_order(t: torch.Tensor) -> torch.Tensor:
    """The sum over the last dimension, first to last, as the reference's loop adds
    (torch's ``sum`` adds in another order: another last bit, now and then another
    choice between two near-equal candidates)."""
    return t.cumsum(-1)[..., -1]


def _signed_extreme(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The largest |x| over the last dimension and the signed value holding it (the
    first such, as the reference's strict ``>`` keeps)."""
    index = x.abs().argmax(-1, keepdim=True)
    extreme = x.gather(-1, index).squeeze(-1)
    return extreme.abs(), extreme


def _pack_pairs(levels: torch.Tensor) -> torch.Tensor:
    """[..., 256] 2-bit levels -> [..., 64] bytes: weight 128h + 32j + l in bits 2j of
    byte 32h + l (Q2_K's and Q3_K's qs)."""
    q = levels.to(torch.uint8).reshape(*levels.shape[:-1], 2, 4, 32)
    shifted = q << torch.arange(0, 8, 2, dtype=torch.uint8).view(4, 1)
    return (shifted[..., 0, :] | shifted[..., 1, :] | shifted[..., 2, :] | shifted[..., 3, :]
            ).reshape(*levels.shape[:-1], 64)  # fmt: skip


# -- Q3_K -------------------------------------------------------------------------------


def _q3_group_scales(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """make_q3_quants(16, 4, rmse): x [G, 16] -> (scale [G], levels [G, 16] in 0..7)."""
    amax, extreme = _signed_extreme(x)
    live = amax >= _EPS
    iscale = torch.where(live, _over(-4, extreme), 0)
    level = torch.round(iscale.unsqueeze(-1) * x).clamp(-4, 3)
    w = x * x
    sumlx = _in_order(w * x * level)
    suml2 = _in_order(w * level * level)
    for _ in range(5):  # coordinate descent, each level in turn, improvements only
        for i in range(x.shape[-1]):
            xi, wi, li = x[:, i], w[:, i], level[:, i]
            rest_lx = sumlx - wi * xi * li  # the sums without level i
            rest_l2 = suml2 - wi * li * li
            positive = rest_lx > 0
            candidate = torch.round(xi * rest_l2 / torch.where(positive, rest_lx, 1)).clamp(-4, 3)
            slx = rest_lx + wi * xi * candidate
            sl2 = rest_l2 + wi * candidate * candidate
            take = positive & live & (candidate != li) & (sl2 > 0)
            take &= slx * slx * suml2 > sumlx * sumlx * sl2
            level[:, i] = torch.where(take, candidate, li)
            sumlx = torch.where(take, slx, sumlx)
            suml2 = torch.where(take, sl2, suml2)
    scale = torch.where(suml2 > 0, sumlx / torch.where(suml2 > 0, suml2, 1), 0)
    levels = torch.where(live.unsqueeze(-1), level + 4, 0)
    return torch.where(live, scale, 0), levels


def quantize_q3_k(w: torch.Tensor) -> torch.Tensor:
    """w [N, K] -> Q3_K bytes [N, K / 256 * 110] (quantize_row_q3_K_ref)."""
    rows = w.shape[0]
    x = w.float().reshape(-1, 16, 16)  # super-blocks of 16 groups of 16
    scales, levels = _q3_group_scales(x.reshape(-1, 16))
    scales, levels = scales.reshape(-1, 16), levels.reshape(-1, 16, 16)
    _, max_scale = _signed_extreme(scales)
    live = max_scale != 0
    iscale = _over(-32, max_scale)
    sub = torch.round(iscale.unsqueeze(-1) * scales).clamp(-32, 31) + 32  # 0..63
    sub = torch.where(live.unsqueeze(-1), sub, 0)
    d = _through_f16(_over(1, iscale))
    dl = d.unsqueeze(-1) * (sub - 32)
    again = torch.round(x / torch.where(dl != 0, dl, 1).unsqueeze(-1)).clamp(-4, 3) + 4
    levels = torch.where((dl != 0).unsqueeze(-1), again, levels).reshape(-1, 256)
    high = levels > 3
    bit = torch.arange(8, dtype=torch.uint8).view(8, 1)
    hmask = (high.to(torch.uint8).reshape(-1, 8, 32) << bit).sum(1, dtype=torch.uint8)
    # (weight j's high bit: bit j // 32 of byte j % 32)
    qs = _pack_pairs(levels - 4 * high)
    s = sub.to(torch.uint8)
    top = s >> 4  # scale j's top two bits: byte 8 + j % 4, bits 2 * (j // 4)
    packed = torch.cat([
        (s[:, :8] & 0x0F) | ((s[:, 8:] & 0x0F) << 4),
        top[:, 0:4] | (top[:, 4:8] << 2) | (top[:, 8:12] << 4) | (top[:, 12:16] << 6),
    ], dim=-1)  # fmt: skip
    raw = torch.cat([hmask, qs, packed, f16_bytes(d)], dim=-1)
    return raw.reshape(rows, -1)


# -- Q2_K -------------------------------------------------------------------------------


# The candidate ranges' numerators, rmin + rdelta * step + nmax in float32 arithmetic.
_STEPS = torch.tensor(-0.5) + torch.tensor(0.1) * torch.arange(16.0) + 3


def _q2_group_scales(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """make_qkx2_quants(16, 3, weights |x|, rmin -0.5, rdelta 0.1, 15 steps, absolute
    error): x [G, 16] -> (scale [G], minimum [G] (subtracted: w = scale*l - minimum),
    levels [G, 16] in 0..3)."""
    weight = x.abs()
    high = x.amax(-1)
    minimum = x.amin(-1).clamp(max=0)
    flat = high == minimum
    sum_w, sum_x = _in_order(weight), _in_order(weight * x)

    def levels_for(numerator: float) -> torch.Tensor:
        # (the range starts at the best minimum so far, as the reference's does)
        iscale = _over(numerator, high - minimum)
        return torch.round(iscale.unsqueeze(-1) * (x - minimum.unsqueeze(-1))).clamp(0, 3)

    def error(scale, minimum, level):
        diff = scale.unsqueeze(-1) * level + minimum.unsqueeze(-1) - x
        return _in_order(weight * diff.abs())

    scale = _over(1, _over(3, high - minimum))
    level = levels_for(3)
    best = error(scale, minimum, level)
    for step in range(16):
        trial = levels_for(_STEPS[step])
        sum_l, sum_l2 = _in_order(weight * trial), _in_order(weight * trial * trial)
        sum_xl = _in_order(weight * trial * x)
        det = sum_w * sum_l2 - sum_l * sum_l
        ok = det > 0
        det = torch.where(ok, det, 1)
        this_scale = (sum_w * sum_xl - sum_x * sum_l) / det
        this_min = (sum_l2 * sum_x - sum_l * sum_xl) / det
        positive = this_min > 0
        this_min = torch.where(positive, 0, this_min)
        this_scale = torch.where(positive, sum_xl / torch.where(sum_l2 > 0, sum_l2, 1), this_scale)
        current = error(this_scale, this_min, trial)
        take = ok & (current < best) & ~flat
        level = torch.where(take.unsqueeze(-1), trial, level)
        best = torch.where(take, current, best)
        scale = torch.where(take, this_scale, scale)
        minimum = torch.where(take, this_min, minimum)
    level = torch.where(flat.unsqueeze(-1), 0, level)
    return torch.where(flat, 0, scale), -minimum, level


def quantize_q2_k(w: torch.Tensor) -> torch.Tensor:
    """w [N, K] -> Q2_K bytes [N, K / 256 * 84] (quantize_row_q2_K_ref): per super-block
    scales[16] (low nibble the group's scale, high its minimum, in steps of d and dmin),
    qs[64], d, dmin; w = d*sc*q - dmin*m."""
    rows = w.shape[0]
    x = w.float().reshape(-1, 16, 16)
    scales, minimums, levels = _q2_group_scales(x.reshape(-1, 16))
    scales, minimums = scales.reshape(-1, 16), minimums.reshape(-1, 16)
    levels = levels.reshape(-1, 16, 16)

    def four_bits(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        top = values.clamp(min=0).amax(-1)
        live = top > 0
        steps = torch.round(_over(15, top).unsqueeze(-1) * values).clamp(0, 15)
        step = _through_f16(torch.where(live, top / 15, 0))
        return torch.where(live.unsqueeze(-1), steps, 0), step

    sc, d = four_bits(scales)
    mn, dmin = four_bits(minimums)
    step = d.unsqueeze(-1) * sc
    shift = (dmin.unsqueeze(-1) * mn).unsqueeze(-1)
    again = torch.round((x + shift) / torch.where(step != 0, step, 1).unsqueeze(-1)).clamp(0, 3)
    levels = torch.where((step != 0).unsqueeze(-1), again, levels).reshape(-1, 256)
    packed = sc.to(torch.uint8) | (mn.to(torch.uint8) << 4)
    raw = torch.cat([packed, _pack_pairs(levels), f16_bytes(d), f16_bytes(dmin)], dim=-1)
    return raw.reshape(rows, -1)


# -- IQ4_NL and IQ4_XS -------------------------------------------------------------------

_LEVELS = IQ4_NL_VALUES.float()
_MIDPOINTS = (_LEVELS[1:] + _LEVELS[:-1]) / 2


def _nearest_level(x: torch.Tensor) -> torch.Tensor:
    """best_index_int8: the index of the nearest of the 16 levels, a tie to the upper
    (the midpoints are exact in float32)."""
    return torch.bucketize(x, _MIDPOINTS, right=True)


def _iq4_block_scales(x: torch.Tensor) -> torch.Tensor:
    """x [B, 32] -> each block's scale (quantize_row_iq4_nl_impl, no importance: the
    x²-weighted fit, searched over 15 inverse scales around -127 / max)."""
    weight = x * x
    amax, extreme = _signed_extreme(x)
    live = amax >= _EPS
    extreme = torch.where(live, extreme, 1)

    def fit(inverse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q = _LEVELS[_nearest_level(inverse.unsqueeze(-1) * x)]
        return _in_order(weight * q * x), _in_order(weight * q * q)

    sumqx, sumq2 = fit(_over(1, extreme / 127))
    d = torch.where(sumq2 > 0, sumqx / torch.where(sumq2 > 0, sumq2, 1), 0)
    best = d * sumqx
    for trial in range(-7, 8):
        sumqx, sumq2 = fit(_over(trial - 127, extreme))
        take = (sumq2 > 0) & (sumqx * sumqx > best * sumq2)
        d = torch.where(take, sumqx / torch.where(sumq2 > 0, sumq2, 1), d)
        best = torch.where(take, d * sumqx, best)
    return torch.where(live, d, 0)


def _iq4_nibbles(levels: torch.Tensor) -> torch.Tensor:
    """[..., 32] level indices -> [..., 16] bytes, Q4_0's order (low nibbles 0..15)."""
    q = levels.to(torch.uint8)
    return q[..., :16] | (q[..., 16:] << 4)


def quantize_iq4_nl(w: torch.Tensor) -> torch.Tensor:
    """w [N, K] -> IQ4_NL bytes [N, K / 32 * 18]: d, then the level indices."""
    rows = w.shape[0]
    x = w.float().reshape(-1, 32)
    d = _iq4_block_scales(x)
    levels = _nearest_level(_over(1, d).unsqueeze(-1) * x)
    raw = torch.cat([f16_bytes(d), _iq4_nibbles(levels)], dim=-1)
    return raw.reshape(rows, -1)


def quantize_iq4_xs(w: torch.Tensor) -> torch.Tensor:
    """w [N, K] -> IQ4_XS bytes [N, K / 256 * 136]: d, scales_h (u16: 2 high bits a
    block), scales_l[4] (a low nibble a block), qs[128]; w = d*(ls-32)*level."""
    rows = w.shape[0]
    x = w.float().reshape(-1, 8, 32)
    block_scales = _iq4_block_scales(x.reshape(-1, 32)).reshape(-1, 8)
    _, max_scale = _signed_extreme(block_scales)
    d = -max_scale / 32  # (the block scales are rounded against d before float16)
    ls = torch.round(_over(1, d).unsqueeze(-1) * block_scales).clamp(-32, 31)
    dl = d.unsqueeze(-1) * ls
    levels = _nearest_level(_over(1, dl).unsqueeze(-1) * x)
    ls = (ls + 32).to(torch.int32)
    low = (ls & 0x0F).to(torch.uint8)
    scales_l = low[:, 0::2] | (low[:, 1::2] << 4)
    top = (ls >> 4).to(torch.uint8).reshape(-1, 2, 4) << torch.arange(0, 8, 2, dtype=torch.uint8)
    scales_h = top.sum(-1, dtype=torch.uint8)  # little-endian u16: blocks 0..3, then 4..7
    raw = torch.cat([f16_bytes(d), scales_h, scales_l, _iq4_nibbles(levels).reshape(-1, 128)], -1)
    return raw.reshape(rows, -1)
