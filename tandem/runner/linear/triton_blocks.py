"""GGUF block formats on a CUDA GPU: a file's block matrices stay in their blocks
(quant/split_blocks.py: values and scales apart) and are dequantized inside the matmul
(Triton), so the GPU holds the file's bytes and a decode step reads each weight once,
at the file's 4.5 to 8.5 bits. Two layouts, two kernel families of the same shape:
Q4_0 / Q8_0 as the file lays out their values (BlockWeight), and every other block
format in one layout of low nibbles, high bits and two-level scales
(SuperBlockWeight: Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K).

``block_matmul`` multiplies activations x [M, K] by such a matrix, each weight byte
read once per product:

    M <= GEMV_M   a GEMV kernel (no matrix units: each weight widened once, multiplied
                  with every row; Q4_0 / Q8_0 sum a block's products before its scale,
                  the other formats widen each weight whole), the same with K split
                  among 2, 4 or 8 programs (K_SPLITS), or the tile kernel,
                  whichever is measured fastest for the matrix's shape on this GPU
                  (timed on first use; ``chosen_kernels`` says which)
    M <= SMALL_M  the tile kernel: blocks widened in registers, then the matrix units
                  (tl.dot) with float32 accumulation; whole or with K split, the
                  faster as measured
    above         the matrix widened to the activations' type a slice of rows at a time
                  (``widen``: one Triton pass, each weight read once and written once)
                  and multiplied by cuBLAS (prefill is compute-bound: the widening pass
                  is a few percent of the product's time)

Each kernel's tile sizes are tuned per shape on first use (triton.autotune).
"""

from __future__ import annotations

import inspect

import torch

from tandem.kernels.triton_support import tl, triton
from tandem.models.linear import Linear
from tandem.quant.split_blocks import SplitWeight, SuperBlockWeight, join

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
    def _scaled(values, scale, BLOCK_N: tl.constexpr, BLOCKS: tl.constexpr, WIDTH: tl.constexpr):
        """values [BLOCK_N, BLOCKS * WIDTH], each run of WIDTH times its block's scale
        (scale [BLOCK_N, BLOCKS]): a Q4_0 tile's nibbles (16 of a block's 32 a run) or a
        Q8_0 tile's values, as weights."""
        runs = tl.reshape(values, (BLOCK_N, BLOCKS, WIDTH)) * scale[:, :, None]
        return tl.reshape(runs, (BLOCK_N, BLOCKS * WIDTH))

    @triton.jit
    def _k_span(K, splits, BLOCK_K: tl.constexpr):
        """This program's columns [start, end) of K: split tl.program_id(2) of splits,
        whole tiles each (a split past K's end has none)."""
        span = tl.cdiv(tl.cdiv(K, splits), BLOCK_K) * BLOCK_K
        start = tl.program_id(2) * span
        return start, tl.minimum(K, start + span)

    @triton.jit
    def _block_product(
        out_ptr, x_ptr, values_ptr, scales_ptr, M, N, K,
        stride_xm, stride_om, stride_vn, stride_sn, stride_os, splits,
        BITS: tl.constexpr, DOT: tl.constexpr, BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):  # fmt: skip
        """out[M, N] = x[M, K] @ W[N, K]^T for a BlockWeight W. DOT: the tile's blocks
        widened in registers, then the matrix units (tl.dot); else (a GEMV for a few
        rows) each weight widened once and multiplied with every row in registers, a
        32-weight block's products summed before its scale multiplies them. splits > 1:
        split s of K writes its partial sums to out + s * stride_os."""
        m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        m_real, n_real = m < M, n < N
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        k_start, k_end = _k_span(K, splits, BLOCK_K)
        for k in range(k_start, k_end, BLOCK_K):
            scale = _block_scales(scales_ptr, n, n_real, k, K, stride_sn, BLOCK_K)
            if BITS == 4:
                low, high, x_low, x_high = _q4_tile(
                    values_ptr, x_ptr, m, m_real, n, n_real, k, K, stride_vn, stride_xm, BLOCK_K
                )
                if DOT:
                    w_low = _scaled(low, scale, BLOCK_N, BLOCK_K // 32, 16)
                    w_high = _scaled(high, scale, BLOCK_N, BLOCK_K // 32, 16)
                    acc += tl.dot(x_low, tl.trans(w_low.to(x_low.dtype)))
                    acc += tl.dot(x_high, tl.trans(w_high.to(x_high.dtype)))
                else:
                    products = x_low.to(tl.float32)[:, None, :] * low[None, :, :]
                    products += x_high.to(tl.float32)[:, None, :] * high[None, :, :]
                    per_block = tl.sum(
                        tl.reshape(products, (BLOCK_M, BLOCK_N, BLOCK_K // 32, 16)), 3
                    )
                    acc += tl.sum(per_block * scale[None, :, :], 2)
            else:
                q, x = _q8_tile(
                    values_ptr, x_ptr, m, m_real, n, n_real, k, K, stride_vn, stride_xm, BLOCK_K
                )
                if DOT:
                    w = _scaled(q, scale, BLOCK_N, BLOCK_K // 32, 32)
                    acc += tl.dot(x, tl.trans(w.to(x.dtype)))
                else:
                    products = x.to(tl.float32)[:, None, :] * q[None, :, :]
                    per_block = tl.sum(
                        tl.reshape(products, (BLOCK_M, BLOCK_N, BLOCK_K // 32, 32)), 3
                    )
                    acc += tl.sum(per_block * scale[None, :, :], 2)
        _store_product(out_ptr, acc, m, m_real, n, n_real, stride_om, stride_os)

    @triton.jit
    def _store_product(out_ptr, acc, m, m_real, n, n_real, stride_om, stride_os):
        """A program's sums into out [M, N] (its split's slice: tl.program_id(2))."""
        tl.store(
            out_ptr + tl.program_id(2) * stride_os + m[:, None] * stride_om + n[None, :],
            acc.to(out_ptr.dtype.element_ty),
            mask=m_real[:, None] & n_real[None, :],
        )

    @triton.jit
    def _super_half(
        q, first, n, n_real, K, d_ptr, sub_ptr, dm_ptr, sub_min_ptr,
        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SUPER: tl.constexpr,
        GROUP: tl.constexpr, OFFSET: tl.constexpr, HAS_SUB: tl.constexpr,
        HAS_MIN: tl.constexpr,
    ):  # fmt: skip
        """q [BLOCK_N, BLOCK_K/2]: one half of each chunk's values (int32), whose runs
        of 16 start at columns ``first`` [chunks, 2] -> float32 weights, each run's
        scale and minimum loaded once and broadcast."""
        CHUNKS: tl.constexpr = BLOCK_K // 64
        n3, col = n[:, None, None], first[None, :, :]
        real = n_real[:, None, None] & (col < K)
        scale = tl.load(d_ptr + n3 * (K // SUPER) + col // SUPER, mask=real, other=0.0)
        scale = scale.to(tl.float32)
        if HAS_SUB:
            sub = tl.load(sub_ptr + n3 * (K // GROUP) + col // GROUP, mask=real, other=0)
            scale = scale * sub.to(tl.float32)
        w = (tl.reshape(q, (BLOCK_N, CHUNKS, 2, 16)).to(tl.float32) - OFFSET) * scale[:, :, :, None]
        if HAS_MIN:
            mins = tl.load(dm_ptr + n3 * (K // SUPER) + col // SUPER, mask=real, other=0.0)
            mins = mins.to(tl.float32)
            if HAS_SUB:
                at = sub_min_ptr + n3 * (K // GROUP) + col // GROUP
                sub_min = tl.load(at, mask=real, other=0)
                mins = mins * sub_min.to(tl.float32)
            w += mins[:, :, :, None]
        return tl.reshape(w, (BLOCK_N, BLOCK_K // 2))

    @triton.jit
    def _super_tile(
        low_ptr, high_ptr, d_ptr, sub_ptr, dm_ptr, sub_min_ptr, x_ptr,
        m, m_real, n, n_real, k, K, stride_xm,
        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SUPER: tl.constexpr,
        GROUP: tl.constexpr, HIGH_BITS: tl.constexpr, OFFSET: tl.constexpr,
        HAS_SUB: tl.constexpr, HAS_MIN: tl.constexpr,
    ):  # fmt: skip
        """A SuperBlockWeight tile (quant/split_blocks.py) as float32 weights, its
        64-weight chunks' first and second halves apart [BLOCK_N, BLOCK_K/2] (slot c:
        chunk c // 32, weights c % 32 and c % 32 + 32), and the rows of x at those
        columns."""
        c = tl.arange(0, BLOCK_K // 2)
        low_col = k + (c // 32) * 64 + c % 32
        cols_real = (low_col < K)[None, :]  # K is whole chunks: a chunk is in or out
        tile_real = n_real[:, None] & cols_real
        packed = tl.load(
            low_ptr + n[:, None] * (K // 2) + (k // 2 + c)[None, :], mask=tile_real, other=0
        ).to(tl.int32)  # fmt: skip
        q_low, q_high = packed & 15, packed >> 4
        if HIGH_BITS > 0:
            PER_BYTE: tl.constexpr = 8 // (2 * HIGH_BITS)  # slots a byte
            MASK: tl.constexpr = (1 << HIGH_BITS) - 1
            slot = k // 2 + c
            bits = tl.load(
                high_ptr + n[:, None] * (K // (2 * PER_BYTE)) + (slot // PER_BYTE)[None, :],
                mask=tile_real, other=0,
            ).to(tl.int32)  # fmt: skip
            shift = ((slot % PER_BYTE) * (2 * HIGH_BITS))[None, :]
            q_low |= ((bits >> shift) & MASK) << 4
            q_high |= ((bits >> (shift + HIGH_BITS)) & MASK) << 4
        # Each 16 slots' first column: k + 64 (chunk) + 16 (half of its 32 slots).
        first = k + 64 * tl.arange(0, BLOCK_K // 64)[:, None] + 16 * tl.arange(0, 2)[None, :]
        w_low = _super_half(
            q_low, first, n, n_real, K, d_ptr, sub_ptr, dm_ptr, sub_min_ptr,
            BLOCK_N, BLOCK_K, SUPER, GROUP, OFFSET, HAS_SUB, HAS_MIN,
        )  # fmt: skip
        w_high = _super_half(
            q_high, first + 32, n, n_real, K, d_ptr, sub_ptr, dm_ptr, sub_min_ptr,
            BLOCK_N, BLOCK_K, SUPER, GROUP, OFFSET, HAS_SUB, HAS_MIN,
        )  # fmt: skip
        x_at = x_ptr + m[:, None] * stride_xm + low_col[None, :]
        x_low = tl.load(x_at, mask=m_real[:, None] & cols_real, other=0.0)
        x_high = tl.load(x_at + 32, mask=m_real[:, None] & cols_real, other=0.0)
        return w_low, w_high, x_low, x_high

    @triton.jit
    def _super_product(
        out_ptr, x_ptr, low_ptr, high_ptr, d_ptr, sub_ptr, dm_ptr, sub_min_ptr, M, N, K,
        stride_xm, stride_om, stride_os, splits,
        SUPER: tl.constexpr, GROUP: tl.constexpr, HIGH_BITS: tl.constexpr,
        OFFSET: tl.constexpr, HAS_SUB: tl.constexpr, HAS_MIN: tl.constexpr,
        DOT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):  # fmt: skip
        """out[M, N] = x[M, K] @ W[N, K]^T for a SuperBlockWeight W, the tile widened
        in registers; DOT: then the matrix units (tl.dot), else (a GEMV for a few rows)
        each weight multiplied with every row in registers. splits > 1: split s of K
        writes its partial sums to out + s * stride_os."""
        m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        m_real, n_real = m < M, n < N
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        k_start, k_end = _k_span(K, splits, BLOCK_K)
        for k in range(k_start, k_end, BLOCK_K):
            w_low, w_high, x_low, x_high = _super_tile(
                low_ptr, high_ptr, d_ptr, sub_ptr, dm_ptr, sub_min_ptr, x_ptr,
                m, m_real, n, n_real, k, K, stride_xm,
                BLOCK_N, BLOCK_K, SUPER, GROUP, HIGH_BITS, OFFSET, HAS_SUB, HAS_MIN,
            )  # fmt: skip
            if DOT:
                acc += tl.dot(x_low, tl.trans(w_low.to(x_low.dtype)))
                acc += tl.dot(x_high, tl.trans(w_high.to(x_high.dtype)))
            else:
                products = x_low.to(tl.float32)[:, None, :] * w_low[None, :, :]
                products += x_high.to(tl.float32)[:, None, :] * w_high[None, :, :]
                acc += tl.sum(products, 2)
        _store_product(out_ptr, acc, m, m_real, n, n_real, stride_om, stride_os)

    # Widening for prefill: the tile helpers above with no rows of x (every x load
    # masked off, so none is made), the weights stored in the activations' type.
    NO_ROWS = tl.constexpr(16)

    @triton.jit
    def _block_widen(
        out_ptr, values_ptr, scales_ptr, N, K, stride_on, stride_vn, stride_sn,
        BITS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):  # fmt: skip
        """out[N, K] = a BlockWeight's values times their block's scale, one tile of
        (BLOCK_N rows, BLOCK_K columns) a program."""
        n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        k = tl.program_id(1) * BLOCK_K
        n_real = n < N
        none = tl.arange(0, NO_ROWS)
        scale = _block_scales(scales_ptr, n, n_real, k, K, stride_sn, BLOCK_K)
        dtype = out_ptr.dtype.element_ty
        if BITS == 4:
            low, high, _, _ = _q4_tile(
                values_ptr, out_ptr, none, none < 0, n, n_real, k, K, stride_vn, 0, BLOCK_K
            )
            w_low = _scaled(low, scale, BLOCK_N, BLOCK_K // 32, 16)
            w_high = _scaled(high, scale, BLOCK_N, BLOCK_K // 32, 16)
            c = tl.arange(0, BLOCK_K // 2)
            low_col = k + (c // 16) * 32 + c % 16
            real = n_real[:, None] & (low_col < K)[None, :]
            at = out_ptr + n[:, None] * stride_on + low_col[None, :]
            tl.store(at, w_low.to(dtype), mask=real)
            tl.store(at + 16, w_high.to(dtype), mask=real)
        else:
            q, _ = _q8_tile(
                values_ptr, out_ptr, none, none < 0, n, n_real, k, K, stride_vn, 0, BLOCK_K
            )
            w = _scaled(q, scale, BLOCK_N, BLOCK_K // 32, 32)
            cols = k + tl.arange(0, BLOCK_K)
            real = n_real[:, None] & (cols < K)[None, :]
            tl.store(out_ptr + n[:, None] * stride_on + cols[None, :], w.to(dtype), mask=real)

    @triton.jit
    def _super_widen(
        out_ptr, low_ptr, high_ptr, d_ptr, sub_ptr, dm_ptr, sub_min_ptr, N, K, stride_on,
        SUPER: tl.constexpr, GROUP: tl.constexpr, HIGH_BITS: tl.constexpr,
        OFFSET: tl.constexpr, HAS_SUB: tl.constexpr, HAS_MIN: tl.constexpr,
        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):  # fmt: skip
        """out[N, K] = a SuperBlockWeight's weights, one tile a program."""
        n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        k = tl.program_id(1) * BLOCK_K
        n_real = n < N
        none = tl.arange(0, NO_ROWS)
        w_low, w_high, _, _ = _super_tile(
            low_ptr, high_ptr, d_ptr, sub_ptr, dm_ptr, sub_min_ptr, out_ptr,
            none, none < 0, n, n_real, k, K, 0,
            BLOCK_N, BLOCK_K, SUPER, GROUP, HIGH_BITS, OFFSET, HAS_SUB, HAS_MIN,
        )  # fmt: skip
        c = tl.arange(0, BLOCK_K // 2)
        low_col = k + (c // 32) * 64 + c % 32
        real = n_real[:, None] & (low_col < K)[None, :]
        at = out_ptr + n[:, None] * stride_on + low_col[None, :]
        dtype = out_ptr.dtype.element_ty
        tl.store(at, w_low.to(dtype), mask=real)
        tl.store(at + 32, w_high.to(dtype), mask=real)

    # A product of a few rows is a pass over the weights: the tile that keeps the most
    # bytes in flight depends on the matrix and the GPU, so each (N, K, BLOCK_M) is
    # timed once over these on first use (outside any CUDA graph: the runner's warm-up
    # before capture) and the fastest kept (``.cache``).
    def _autotuned(kernel, shapes, format_args):
        """``kernel`` timed on first use per (N, K, BLOCK_M, the format's constants)
        over these (BLOCK_N, BLOCK_K, warps, stages)."""
        configs = [
            triton.Config({"BLOCK_N": n, "BLOCK_K": k}, num_warps=w, num_stages=st)
            for n, k, w, st in shapes
        ]
        keep = {"cache_results": True} if _KEEPS_TILES else {}
        return triton.autotune(
            configs=configs, key=["N", "K", "BLOCK_M", *format_args], do_bench=_quick_bench,
            **keep,
        )(kernel)  # fmt: skip

    # Tiles tuned once a machine: kept on disk beside Triton's compiled kernels (Triton
    # 3.3 and later), so a restarted server or the next benchmark does not tune again.
    _KEEPS_TILES = "cache_results" in inspect.signature(triton.autotune).parameters

    def _quick_bench(kernel_call, quantiles):
        """Each config over 20 ms of runs, not Triton's default 100 (after 25 of
        warm-up): a product takes 5-100 us, so hundreds of runs still make the median,
        and a model's first steps tune some 35 shapes x 5 kernels x 7-9 configs."""
        return triton.testing.do_bench(kernel_call, warmup=5, rep=20, quantiles=quantiles)

    DOT_SHAPES = [
        (16, 256, 4, 4), (32, 256, 4, 4), (64, 256, 4, 3), (32, 512, 4, 3),
        (16, 512, 2, 4), (64, 128, 4, 4), (128, 128, 8, 3),
    ]  # fmt: skip
    # The GEMV holds rows x BLOCK_N x BLOCK_K/2 products in registers: compiled for an
    # H100 (tests/gpu_kernel_builds.py, cuobjdump's resource usage), Q4_0 at 8 rows
    # takes 225-255 registers a thread in the first seven tiles and spills in two
    # (32x256, 16x512); the last two keep 96 and 128, more warps resident a processor.
    GEMV_SHAPES = [
        (8, 256, 2, 4), (16, 256, 4, 4), (32, 256, 4, 3), (16, 512, 4, 3),
        (32, 128, 4, 4), (64, 128, 8, 3), (8, 512, 4, 4), (8, 128, 2, 4), (16, 128, 4, 4),
    ]  # fmt: skip
    SUPER_ARGS = ["SUPER", "GROUP", "HIGH_BITS", "OFFSET", "HAS_SUB", "HAS_MIN"]
    # name -> (the kernel, tuned) for BlockWeight and for SuperBlockWeight
    _KERNELS = {
        "dot": (_block_product, _autotuned(_block_product, DOT_SHAPES, ["BITS", "DOT", "splits"])),
        "gemv": (
            _block_product,
            _autotuned(_block_product, GEMV_SHAPES, ["BITS", "DOT", "splits"]),
        ),
    }
    _SUPER_KERNELS = {
        "dot": (
            _super_product,
            _autotuned(_super_product, DOT_SHAPES, [*SUPER_ARGS, "DOT", "splits"]),
        ),
        "gemv": (
            _super_product,
            _autotuned(_super_product, GEMV_SHAPES, [*SUPER_ARGS, "DOT", "splits"]),
        ),
    }

GEMV_M = 8  # rows up to which the GEMV kernel is a candidate
# Splits of K timed beside each kernel whole: a matrix of few output rows gives few
# programs (N / BLOCK_N: 128 for a 4096-row matrix in tiles of 32, on a GPU of 132
# multiprocessors; the tile kernel's rows of activations do not add any), each walking
# all of K with few loads in flight; split among S programs, each writes its partial
# sums (float32), added in order by a second pass.
K_SPLITS = (2, 4, 8)
# (N, K, rows of a program, format) -> (the kernel chosen, each candidate's time in
# us), measured on this GPU on first use
_CHOSEN: dict[tuple[int, int, int, str], tuple[str, dict[str, float]]] = {}


def chosen_kernels() -> dict[str, str]:
    """What was measured and chosen per (N, K, rows of a program, format), for
    benchmarks."""
    chosen = {}
    for key, (kernel, times) in _CHOSEN.items():
        timed = ", ".join(f"{name} {us:.1f} us" for name, us in times.items())
        chosen[str(key)] = f"{kernel} ({timed})"
    return chosen


WIDEN_TILE = (32, 256)  # (rows, columns) a widening program writes


def widen(weight: SplitWeight, dtype: torch.dtype, rows: slice) -> torch.Tensor:
    """``weight``'s rows [rows.start, rows.stop) widened to ``dtype`` in one Triton pass
    (each weight: its block's float32 formula, rounded once), for the prefill path's
    cuBLAS product -> [rows, K]. ``weight.dequantize`` is the same in torch ops."""
    count = rows.stop - rows.start
    grid = (triton.cdiv(count, WIDEN_TILE[0]), triton.cdiv(weight.columns, WIDEN_TILE[1]))
    tile = dict(BLOCK_N=WIDEN_TILE[0], BLOCK_K=WIDEN_TILE[1])
    if isinstance(weight, SuperBlockWeight):
        spec = weight.format
        fields = [(weight.low if f is None else f)[rows] for f in weight.fields()]
        out = weight.low.new_empty(count, weight.columns, dtype=dtype)
        _super_widen[grid](
            out, *fields, count, weight.columns, out.stride(0),
            SUPER=spec.super, GROUP=spec.group, HIGH_BITS=spec.high_bits, OFFSET=spec.offset,
            HAS_SUB=spec.has_sub, HAS_MIN=spec.has_min, **tile,
        )  # fmt: skip
        return out
    values, scales = weight.values[rows], weight.scales[rows]
    out = values.new_empty(count, weight.columns, dtype=dtype)
    _block_widen[grid](
        out, values, scales, count, weight.columns, out.stride(0), values.stride(0),
        scales.stride(0), BITS=weight.bits, **tile,
    )  # fmt: skip
    return out


def tuned_tiles() -> dict[str, dict[str, str]]:
    """Each kernel's tiles as tuned per shape on this GPU (its autotuner's key ->
    config), for benchmarks."""
    tiles = {}
    if triton is None:
        return tiles
    for family, kernels in (("Q4_0/Q8_0", _KERNELS), ("K and other formats", _SUPER_KERNELS)):
        for name, (_, tuned) in kernels.items():
            tiles[f"{family} {name}"] = {str(k): str(v) for k, v in tuned.cache.items()}
    return tiles


def _launch(x: torch.Tensor, weight: SplitWeight, out: torch.Tensor):
    """The kernels for ``weight``'s layout, their arguments and format constants."""
    m, n = x.shape[0], weight.rows
    if isinstance(weight, SuperBlockWeight):
        spec = weight.format
        fields = [weight.low if f is None else f for f in weight.fields()]  # unread if None
        args = (out, x, *fields, m, n, weight.columns, x.stride(0), out.stride(0))
        constants = dict(
            SUPER=spec.super, GROUP=spec.group, HIGH_BITS=spec.high_bits, OFFSET=spec.offset,
            HAS_SUB=spec.has_sub, HAS_MIN=spec.has_min,
        )  # fmt: skip
        return _SUPER_KERNELS, args, constants, weight.code.name
    args = (
        out, x, weight.values, weight.scales, m, n, weight.columns,
        x.stride(0), out.stride(0), weight.values.stride(0), weight.scales.stride(0),
    )  # fmt: skip
    return _KERNELS, args, dict(BITS=weight.bits), f"Q{weight.bits}_0"


def _program_rows(kind: str, m: int) -> int:
    """Rows of activations a program of ``kind`` takes (the tile kernel: tl.dot's 16
    at least)."""
    if kind == "gemv":
        return triton.next_power_of_2(m)
    return 16 if m <= 16 else 32 if m <= 32 else 64


def _run(name: str, x: torch.Tensor, weight: SplitWeight, out: torch.Tensor) -> None:
    """out = x @ W^T by kernel ``name``: "dot", "gemv", or "gemv/S" (K split among S
    programs). On the GPU each kernel's tiles are tuned per shape on first use; in
    Triton's interpreter (TRITON_INTERPRET=1, tests) the tiles are fixed."""
    m, n = x.shape[0], weight.rows
    kind, _, split = name.partition("/")
    splits = int(split or 1)
    target = out
    if splits > 1:  # each split's partial sums, [splits * m, n]
        target = torch.empty(splits * m, n, dtype=torch.float32, device=x.device)
    kernels, args, constants, _ = _launch(x, weight, target)
    # (splits and stride_os are run-time values: no compile a split count)
    constants.update(splits=splits, stride_os=m * n, DOT=kind == "dot")
    rows = _program_rows(kind, m)
    if x.is_cuda:
        grid = lambda meta: (triton.cdiv(m, rows), triton.cdiv(n, meta["BLOCK_N"]), splits)  # noqa: E731
        kernels[kind][1][grid](*args, **constants, BLOCK_M=rows)
    else:
        grid = (triton.cdiv(m, rows), triton.cdiv(n, 32), splits)
        kernels[kind][0][grid](*args, **constants, BLOCK_M=rows, BLOCK_N=32, BLOCK_K=256)
    if splits > 1:
        out.copy_(target.view(splits, m, n).sum(0))


def block_matmul(
    x: torch.Tensor,
    weight: SplitWeight,
    out: torch.Tensor | None = None,
    kernel: str | None = None,
) -> torch.Tensor:
    """x [M, K] (float16 / bfloat16 / float32, last dim contiguous) -> [M, N] in x's
    type; ``out`` may be a column slice of a wider matrix. ``kernel``: "dot", "gemv",
    "dot/S" or "gemv/S" (K split among S programs) whatever was measured (tests)."""
    m = x.shape[0]
    if out is None:
        out = x.new_empty(m, weight.rows)
    if m > SMALL_M or triton is None:
        for first in range(0, weight.rows, WIDEN_ROWS):
            rows = slice(first, min(first + WIDEN_ROWS, weight.rows))
            if triton is None:
                wide = weight.dequantize(x.dtype, rows)
            else:
                wide = widen(weight, x.dtype, rows)
            out[:, rows] = x @ wide.t()
        return out
    few = m <= GEMV_M
    if kernel is None and not x.is_cuda:  # (the interpreter: nothing to time)
        kernel = "gemv" if few else "dot"
    if kernel is None:
        fmt = _launch(x, weight, out)[3]
        kind = "gemv" if few else "dot"
        key = (weight.rows, weight.columns, _program_rows(kind, m), fmt)
        if key not in _CHOSEN:  # timed once, outside any CUDA graph (the capture's warm-up)
            splits = [f"{kind}/{s}" for s in K_SPLITS if weight.columns // s >= 256]
            candidates = [kind, *splits, *(["dot"] if few else [])]
            for name in candidates:  # (the first runs tune each kernel's tiles)
                _run(name, x, weight, out)
            times = {}
            for name in candidates:
                run = lambda name=name: _run(name, x, weight, out)  # noqa: E731
                times[name] = 1e3 * triton.testing.do_bench(run, warmup=5, rep=20)
            _CHOSEN[key] = (min(times, key=times.get), times)
        kernel = _CHOSEN[key][0]
    _run(kernel, x, weight, out)
    return out


class BlockLinearMethod:
    """Linear layers whose matrices are GGUF blocks on the GPU (``layer.block_parts``:
    (first output row, BlockWeight or SuperBlockWeight), set by the loader)."""

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
