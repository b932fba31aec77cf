"""GGUF block formats on a CUDA GPU: Q4_0 and Q8_0 matrices stay in their blocks
(quant/split_blocks.py: values and scales apart) and are dequantized inside the matmul
(Triton), so the GPU holds the file's bytes and a decode step reads each weight once,
at 4.5 or 8.5 bits.

``block_matmul`` multiplies activations x [M, K] by such a matrix, each weight byte
read once per product:

    M <= GEMV_M   a GEMV kernel (no matrix units: each weight widened once, multiplied
                  with every row, a block's products summed before its scale) or the
                  tile kernel, whichever is measured faster for the matrix's shape on
                  this GPU (timed on first use; ``chosen_kernels`` says which)
    M <= SMALL_M  the tile kernel: blocks widened in registers, then the matrix units
                  (tl.dot) with float32 accumulation
    above         the matrix widened to the activations' type a slice of rows at a time
                  and multiplied by cuBLAS (prefill is compute-bound: the widening pass
                  is a few percent of the product's time)

Each kernel's tile sizes are tuned per shape on first use (triton.autotune).
"""

from __future__ import annotations

import torch

from tandem.kernels.triton_support import tl, triton
from tandem.models.linear import Linear
from tandem.quant.split_blocks import BlockWeight, join

SMALL_M = 64  # rows of activations up to which the fused kernels run
WIDEN_ROWS = 4096  # rows of the matrix widened at a time above it


if triton is not None:

    @triton.jit
    def _block_scales(scales_ptr, n, n_real, k, K, stride_sn, BLOCK_K: tl.constexpr):
        """The scales [BLOCK_N, BLOCK_K / 32] of a tile's blocks, as float32."""
        groups = tl.arange(0, BLOCK_K // 32)
        return tl.load(
            scales_ptr + n[:, None] * stride_sn + (k // 32 + groups)[None, :],
            mask=n_real[:, None] & ((k + groups * 32) < K)[None, :], other=0.0,
        ).to(tl.float32)  # fmt: skip

    @triton.jit
    def _q4_tile(
        values_ptr, x_ptr, m, m_real, n, n_real, k, K, stride_vn, stride_xm,
        BLOCK_K: tl.constexpr,
    ):  # fmt: skip
        """A Q4_0 tile's values - 8 as float32, low and high nibbles [BLOCK_N, BLOCK_K/2]
        (byte c: block c // 16, weights c % 16 and c % 16 + 16), and the rows of x at
        those columns."""
        c = tl.arange(0, BLOCK_K // 2)
        low_col = (c // 16) * 32 + c % 16
        cols_real = ((k + low_col) < K)[None, :]
        packed = tl.load(
            values_ptr + n[:, None] * stride_vn + (k // 2 + c)[None, :],
            mask=n_real[:, None] & cols_real, other=0,
        )  # fmt: skip
        x_at = x_ptr + m[:, None] * stride_xm + k + low_col[None, :]
        x_low = tl.load(x_at, mask=m_real[:, None] & cols_real, other=0.0)
        x_high = tl.load(x_at + 16, mask=m_real[:, None] & cols_real, other=0.0)
        low = (packed & 15).to(tl.float32) - 8.0
        high = (packed >> 4).to(tl.float32) - 8.0
        return low, high, x_low, x_high

    @triton.jit
    def _q8_tile(
        values_ptr, x_ptr, m, m_real, n, n_real, k, K, stride_vn, stride_xm,
        BLOCK_K: tl.constexpr,
    ):  # fmt: skip
        """A Q8_0 tile's values as float32 [BLOCK_N, BLOCK_K], and the rows of x."""
        cols = k + tl.arange(0, BLOCK_K)
        q = tl.load(
            values_ptr + n[:, None] * stride_vn + cols[None, :],
            mask=n_real[:, None] & (cols < K)[None, :], other=0,
        )  # fmt: skip
        x = tl.load(
            x_ptr + m[:, None] * stride_xm + cols[None, :],
            mask=m_real[:, None] & (cols < K)[None, :], other=0.0,
        )  # fmt: skip
        return q.to(tl.float32), x

    @triton.jit
    def _block_matmul(
        out_ptr, x_ptr, values_ptr, scales_ptr, M, N, K,
        stride_xm, stride_om, stride_vn, stride_sn,
        BITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):  # fmt: skip
        """out[M, N] = x[M, K] @ W[N, K]^T, W's blocks widened in registers, then the
        matrix units (tl.dot)."""
        m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        m_real, n_real = m < M, n < N
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k in range(0, K, BLOCK_K):
            scale = _block_scales(scales_ptr, n, n_real, k, K, stride_sn, BLOCK_K)[:, :, None]
            if BITS == 4:
                low, high, x_low, x_high = _q4_tile(
                    values_ptr, x_ptr, m, m_real, n, n_real, k, K, stride_vn, stride_xm, BLOCK_K
                )
                shape: tl.constexpr = (BLOCK_N, BLOCK_K // 32, 16)
                w_low = tl.reshape(tl.reshape(low, shape) * scale, (BLOCK_N, BLOCK_K // 2))
                w_high = tl.reshape(tl.reshape(high, shape) * scale, (BLOCK_N, BLOCK_K // 2))
                acc += tl.dot(x_low, tl.trans(w_low.to(x_low.dtype)))
                acc += tl.dot(x_high, tl.trans(w_high.to(x_high.dtype)))
            else:
                q, x = _q8_tile(
                    values_ptr, x_ptr, m, m_real, n, n_real, k, K, stride_vn, stride_xm, BLOCK_K
                )
                w = tl.reshape(
                    tl.reshape(q, (BLOCK_N, BLOCK_K // 32, 32)) * scale, (BLOCK_N, BLOCK_K)
                )
                acc += tl.dot(x, tl.trans(w.to(x.dtype)))
        tl.store(
            out_ptr + m[:, None] * stride_om + n[None, :],
            acc.to(out_ptr.dtype.element_ty),
            mask=m_real[:, None] & n_real[None, :],
        )

    @triton.jit
    def _block_gemv(
        out_ptr, x_ptr, values_ptr, scales_ptr, M, N, K,
        stride_xm, stride_om, stride_vn, stride_sn,
        BITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):  # fmt: skip
        """out[M, N] = x[M, K] @ W[N, K]^T for a few rows M, without the matrix units:
        each weight widened once and multiplied with every row in registers; each
        32-weight block's products summed before its scale multiplies them."""
        m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        m_real, n_real = m < M, n < N
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k in range(0, K, BLOCK_K):
            scale = _block_scales(scales_ptr, n, n_real, k, K, stride_sn, BLOCK_K)
            if BITS == 4:
                low, high, x_low, x_high = _q4_tile(
                    values_ptr, x_ptr, m, m_real, n, n_real, k, K, stride_vn, stride_xm, BLOCK_K
                )
                products = x_low.to(tl.float32)[:, None, :] * low[None, :, :]
                products += x_high.to(tl.float32)[:, None, :] * high[None, :, :]
                per_block = tl.sum(tl.reshape(products, (BLOCK_M, BLOCK_N, BLOCK_K // 32, 16)), 3)
            else:
                q, x = _q8_tile(
                    values_ptr, x_ptr, m, m_real, n, n_real, k, K, stride_vn, stride_xm, BLOCK_K
                )
                products = x.to(tl.float32)[:, None, :] * q[None, :, :]
                per_block = tl.sum(tl.reshape(products, (BLOCK_M, BLOCK_N, BLOCK_K // 32, 32)), 3)
            acc += tl.sum(per_block * scale[None, :, :], 2)
        tl.store(
            out_ptr + m[:, None] * stride_om + n[None, :],
            acc.to(out_ptr.dtype.element_ty),
            mask=m_real[:, None] & n_real[None, :],
        )

    # A product of a few rows is a pass over the weights: the tile that keeps the most
    # bytes in flight depends on the matrix and the GPU, so each (N, K, BLOCK_M) is
    # timed once over these on first use (outside any CUDA graph: the runner's warm-up
    # before capture) and the fastest kept (``.cache``).
    def _autotuned(kernel, shapes):
        """``kernel`` timed on first use per (N, K, BLOCK_M) over these (BLOCK_N,
        BLOCK_K, warps, stages)."""
        configs = [
            triton.Config({"BLOCK_N": n, "BLOCK_K": k}, num_warps=w, num_stages=st)
            for n, k, w, st in shapes
        ]
        return triton.autotune(configs=configs, key=["N", "K", "BLOCK_M"])(kernel)

    _tuned = _autotuned(_block_matmul, [
        (16, 256, 4, 4), (32, 256, 4, 4), (64, 256, 4, 3), (32, 512, 4, 3),
        (16, 512, 2, 4), (64, 128, 4, 4), (128, 128, 8, 3),
    ])  # fmt: skip
    _tuned_gemv = _autotuned(_block_gemv, [
        (8, 256, 2, 4), (16, 256, 4, 4), (32, 256, 4, 3), (16, 512, 4, 3),
        (32, 128, 4, 4), (64, 128, 8, 3), (8, 512, 4, 4),
    ])  # fmt: skip

GEMV_M = 8  # rows up to which the GEMV kernel is a candidate
# (N, K, GEMV rows, bits) -> ("gemv" or "dot", the two kernels' times in us), measured
# on this GPU on first use
_CHOSEN: dict[tuple[int, int, int, int], tuple[str, tuple[float, float]]] = {}


def chosen_kernels() -> dict[str, str]:
    """What was measured and chosen per (N, K, GEMV rows, bits), for benchmarks."""
    return {
        str(key): f"{kernel} (gemv {gemv_us:.1f} us, dot {dot_us:.1f} us)"
        for key, (kernel, (gemv_us, dot_us)) in _CHOSEN.items()
    }


def block_matmul(
    x: torch.Tensor,
    weight: BlockWeight,
    out: torch.Tensor | None = None,
    kernel: str | None = None,
) -> torch.Tensor:
    """x [M, K] (float16 / bfloat16 / float32, last dim contiguous) -> [M, N] in x's
    type; ``out`` may be a column slice of a wider matrix. ``kernel``: "gemv" or "dot"
    whatever was measured (tests)."""
    m = x.shape[0]
    if out is None:
        out = x.new_empty(m, weight.rows)
    if m > SMALL_M or triton is None:
        for first in range(0, weight.rows, WIDEN_ROWS):
            rows = slice(first, min(first + WIDEN_ROWS, weight.rows))
            out[:, rows] = x @ weight.dequantize(x.dtype, rows).t()
        return out
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    gemv_rows = triton.next_power_of_2(m)  # the GEMV's rows per program
    n = weight.rows
    args = (
        out, x, weight.values, weight.scales, m, n, weight.columns,
        x.stride(0), out.stride(0), weight.values.stride(0), weight.scales.stride(0),
    )  # fmt: skip
    if kernel is None and m > GEMV_M:
        kernel = "dot"
    if not x.is_cuda:  # Triton's interpreter (TRITON_INTERPRET=1), in tests: fixed tiles
        gemv = kernel == "gemv" or kernel is None
        rows = gemv_rows if gemv else block_m
        grid = (triton.cdiv(m, rows), triton.cdiv(n, 32))
        (_block_gemv if gemv else _block_matmul)[grid](
            *args, BITS=weight.bits, BLOCK_M=rows, BLOCK_N=32, BLOCK_K=256
        )
        return out

    def run(name: str) -> None:
        tuned, rows = (_tuned_gemv, gemv_rows) if name == "gemv" else (_tuned, block_m)
        grid = lambda meta: (triton.cdiv(m, rows), triton.cdiv(n, meta["BLOCK_N"]))  # noqa: E731
        tuned[grid](*args, BITS=weight.bits, BLOCK_M=rows)

    if kernel is None:
        key = (n, weight.columns, gemv_rows, weight.bits)
        if key not in _CHOSEN:  # timed once, outside any CUDA graph (the capture's warm-up)
            run("gemv"), run("dot")  # (the first runs tune each kernel's tiles)
            gemv_us, dot_us = (
                1e3 * triton.testing.do_bench(lambda name=name: run(name), warmup=5, rep=20)
                for name in ("gemv", "dot")
            )
            _CHOSEN[key] = ("gemv" if gemv_us <= dot_us else "dot", (gemv_us, dot_us))
        kernel = _CHOSEN[key][0]
    run(kernel)
    return out


class BlockLinearMethod:
    """Linear layers whose matrices are GGUF Q4_0 / Q8_0 blocks on the GPU
    (``layer.block_parts``: (first output row, BlockWeight), set by the loader)."""

    def process_weights_after_loading(self, layer: Linear) -> None:
        parts = join(sorted(layer.block_parts, key=lambda part: part[0]))
        covered = sum(weight.rows for _, weight in parts)
        if covered != layer.out_features:
            raise ValueError(f"block parts cover {covered} of {layer.out_features} output rows")
        layer.block_parts = parts

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if x2.stride(-1) != 1:
            x2 = x2.contiguous()
        parts = layer.block_parts
        if len(parts) == 1:
            out = block_matmul(x2, parts[0][1])
        else:
            out = x2.new_empty(x2.shape[0], layer.out_features)
            for start, weight in parts:
                block_matmul(x2, weight, out[:, start : start + weight.rows])
        if layer.bias is not None:
            out += layer.bias
        return out.reshape(*shape[:-1], layer.out_features)
