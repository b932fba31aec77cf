"""Triton kernels for the small per-token operations of a forward on a CUDA GPU.

A decode step's matmuls are few and large; what multiplies its kernel count are the
operations between them, each several torch kernels when written in torch (an RMS norm
is a cast, a square, a mean, an add, a reciprocal square root and two multiplies;
rotary embedding a dozen slices, negations, concatenations and products). Each kernel
costs a few microseconds on the GPU however little it does, so a small model's step
was mostly such gaps. Here each operation is one launch:

    rms_norm     a row's norm (and the residual add before it, written back in place)
    rotary       q and k rotated in place, every head of a token in one program
    act_and_mul  a gated MLP's activation times its up projection

Each rounds to the model's dtype where the torch path does (the torch path follows
transformers' reference operation by operation), so results agree with it to float32
rounding of the reductions. They run where ``enabled`` says: a CUDA tensor, Triton
installed, and autograd off (training keeps the torch ops, which have gradients).
"""

from __future__ import annotations

import torch

from tandem.kernels.triton_support import tl, triton


def enabled(x: torch.Tensor) -> bool:
    return triton is not None and x.is_cuda and not torch.is_grad_enabled()


if triton is not None:

    @triton.jit
    def _rms_norm(
        out_ptr, x_ptr, residual_ptr, weight_ptr, eps, heads,
        stride_xt, stride_xh, stride_rt, stride_ot, stride_oh,
        DIM: tl.constexpr, BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
    ):  # fmt: skip
        row = tl.program_id(0)
        token, head = row // heads, row % heads
        cols = tl.arange(0, BLOCK)
        real = cols < DIM
        x = tl.load(x_ptr + token * stride_xt + head * stride_xh + cols, mask=real, other=0.0)
        dtype = x.dtype
        if HAS_RESIDUAL:  # the stream: x + residual in the model's dtype, kept
            r = tl.load(residual_ptr + token * stride_rt + cols, mask=real, other=0.0)
            x = (x.to(tl.float32) + r.to(tl.float32)).to(dtype)
            tl.store(residual_ptr + token * stride_rt + cols, x, mask=real)
        x32 = x.to(tl.float32)
        inv = 1.0 / tl.sqrt(tl.sum(x32 * x32, 0) / DIM + eps)
        normed = (x32 * inv).to(dtype).to(tl.float32)
        w = tl.load(weight_ptr + cols, mask=real, other=0.0).to(tl.float32)
        out = out_ptr + token * stride_ot + head * stride_oh + cols
        tl.store(out, (w * normed).to(dtype), mask=real)

    @triton.jit
    def _rotate(
        x_ptr, token, cos, sin, heads, stride_t, stride_h, half,
        HEADS: tl.constexpr, HALF: tl.constexpr,
    ):  # fmt: skip
        h = tl.arange(0, HEADS)
        d = tl.arange(0, HALF)
        real = (h < heads)[:, None] & (d < half)[None, :]
        first = x_ptr + token * stride_t + h[:, None] * stride_h + d[None, :]
        x1 = tl.load(first, mask=real, other=0.0)
        x2 = tl.load(first + half, mask=real, other=0.0)
        dtype = x1.dtype
        c, s = cos[None, :], sin[None, :]
        a1, a2 = x1.to(tl.float32), x2.to(tl.float32)
        # rot * cos + rotate_half(rot) * sin, each product rounded to the dtype first
        out1 = (a1 * c).to(dtype).to(tl.float32) + (-a2 * s).to(dtype).to(tl.float32)
        out2 = (a2 * c).to(dtype).to(tl.float32) + (a1 * s).to(dtype).to(tl.float32)
        tl.store(first, out1.to(dtype), mask=real)
        tl.store(first + half, out2.to(dtype), mask=real)

    @triton.jit
    def _rotary(
        q_ptr, k_ptr, positions_ptr, table_ptr, q_heads, k_heads, half,
        stride_qt, stride_qh, stride_kt, stride_kh, stride_table,
        Q_HEADS: tl.constexpr, K_HEADS: tl.constexpr, HALF: tl.constexpr,
        ROUND_TABLE: tl.constexpr,
    ):  # fmt: skip
        token = tl.program_id(0)
        position = tl.load(positions_ptr + token)
        d = tl.arange(0, HALF)
        row = table_ptr + position * stride_table + d
        cos = tl.load(row, mask=d < half, other=0.0)
        sin = tl.load(row + half, mask=d < half, other=0.0)
        if ROUND_TABLE:  # the torch path multiplies by cos and sin in the model dtype
            cos = cos.to(q_ptr.dtype.element_ty).to(tl.float32)
            sin = sin.to(q_ptr.dtype.element_ty).to(tl.float32)
        _rotate(q_ptr, token, cos, sin, q_heads, stride_qt, stride_qh, half, Q_HEADS, HALF)
        _rotate(k_ptr, token, cos, sin, k_heads, stride_kt, stride_kh, half, K_HEADS, HALF)

    @triton.jit
    def _act_and_mul(
        out_ptr, x_ptr, size, stride_x, stride_o, GELU: tl.constexpr, BLOCK: tl.constexpr
    ):
        token = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        real = cols < size
        gate = tl.load(x_ptr + token * stride_x + cols, mask=real, other=0.0)
        up = tl.load(x_ptr + token * stride_x + size + cols, mask=real, other=0.0)
        g = gate.to(tl.float32)
        if GELU:  # tanh approximation
            inner = 0.7978845608028654 * (g + 0.044715 * g * g * g)
            act = 0.5 * g * (1.0 + (2.0 / (1.0 + tl.exp(-2.0 * inner)) - 1.0))
        else:
            act = g / (1.0 + tl.exp(-g))
        act = act.to(gate.dtype).to(tl.float32)
        tl.store(out_ptr + token * stride_o + cols, (act * up.to(tl.float32)).to(gate.dtype),
                 mask=real)  # fmt: skip


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor:
    """x [T, D] (with ``residual`` [T, D]: normed x + residual, the sum written into
    ``residual``) or x [T, H, D] per head -> a new tensor of x's shape."""
    dim = x.shape[-1]
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    tokens = x.shape[0]
    heads = x.shape[1] if x.dim() == 3 else 1
    if tokens == 0:
        return out
    stride_h = x.stride(1) if x.dim() == 3 else 0
    out_h = out.stride(1) if x.dim() == 3 else 0
    block = triton.next_power_of_2(dim)
    _rms_norm[(tokens * heads,)](
        out, x, residual if residual is not None else x, weight, eps, heads,
        x.stride(0), stride_h, residual.stride(0) if residual is not None else 0,
        out.stride(0), out_h,
        DIM=dim, BLOCK=block, HAS_RESIDUAL=residual is not None,
        num_warps=max(1, min(16, block // 256)),
    )  # fmt: skip
    return out


def rotary(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor
) -> None:
    """Neox-style rotary embedding of q [T, H, D] and k [T, Hkv, D] in place, over their
    first ``cos_sin.shape[1]`` dims; cos_sin [P, rotary_dim] float32 (cos | sin)."""
    tokens = q.shape[0]
    if tokens == 0:
        return
    half = cos_sin.shape[1] // 2
    _rotary[(tokens,)](
        q, k, positions, cos_sin, q.shape[1], k.shape[1], half,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos_sin.stride(0),
        Q_HEADS=triton.next_power_of_2(q.shape[1]), K_HEADS=triton.next_power_of_2(k.shape[1]),
        HALF=triton.next_power_of_2(half), ROUND_TABLE=q.dtype != torch.float32,
        num_warps=4,
    )  # fmt: skip


def act_and_mul(x: torch.Tensor, gelu: bool) -> torch.Tensor:
    """[T, 2N] -> act(x[:, :N]) * x[:, N:] (SiLU, or GELU's tanh approximation)."""
    size = x.shape[-1] // 2
    out = x.new_empty(x.shape[0], size)
    if x.shape[0] == 0:
        return out
    block = 1024
    _act_and_mul[(x.shape[0], triton.cdiv(size, block))](
        out, x, size, x.stride(0), out.stride(0), GELU=gelu, BLOCK=block, num_warps=4
    )
    return out
