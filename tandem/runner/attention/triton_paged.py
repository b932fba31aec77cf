"""The CUDA backend: one Triton kernel attends the whole flat batch straight from the
paged cache (decodes, verification rows, prompt chunks after cached tokens and fresh
prompts alike), with no gather, no mask tensor and no per-group launches.

Per layer one launch writes the new K/V rows at their slots (rounded to the cache's
type, as the torch backend does, so a prompt's result does not depend on how it was
chunked; a negative slot, a CUDA graph's padding row, is skipped), then one launch
runs a grid of

    (sequence, tile of query rows, KV head)

where a tile's rows are (token, query head of this KV head) pairs: a decode's G query
heads sharing a KV head are the rows of one tile, so each KV block is read once per KV
head, not once per query head. A program walks its sequence's keys block-table entry
by entry up to its last query's position (causal), from its first query's window start
when the layer slides, with an online softmax in float32 (FlashAttention's recurrence).
K/V may be stored as the model's type, bfloat16, fp8 (e4m3, widened on load) or int8
rows with a float32 scale each (kv_cache.quantize_kv_rows: written by the same
rounding, read as values times scale).

Metadata (``FlatMetadata``) is plain integers built on the host, packed into one
pinned buffer and copied to the device in one asynchronous copy: building a step's
metadata never waits for the GPU.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from tandem.kernels.triton_support import tl, triton
from tandem.runner.attention.metadata import StepMetadata, host_layout, sliding_windows


@dataclass(kw_only=True)
class FlatMetadata(StepMetadata):
    """One forward's sequences as the kernel reads them (all int64 on the device)."""

    query_starts: torch.Tensor  # [S + 1] flat-batch index of each sequence's first token
    num_computed: torch.Tensor  # [S] tokens cached before this forward
    block_tables: torch.Tensor  # [S, Nb] padded with the last used entry (never read)
    num_seqs: int
    max_query_len: int


def build_flat_metadata(
    query_lens: Sequence[int] | np.ndarray,
    num_computed: Sequence[int] | np.ndarray,
    block_tables: Sequence[Sequence[int]] | np.ndarray,
    block_size: int,
    layer_windows: Sequence[int | None] = (),
    device: torch.device | str = "cpu",
    verifying: Sequence[bool] | None = None,  # (verification rows are ordinary rows here)
) -> FlatMetadata:
    """The metadata of ``build_paged_metadata``'s arguments (metadata.host_layout), in
    one pinned host buffer copied to ``device`` in one asynchronous copy."""
    device = torch.device(device)
    layout = host_layout(query_lens, num_computed, block_tables, block_size)
    num_seqs, width = layout.tables.shape
    num_tokens = len(layout.positions)
    sizes = (num_tokens, num_tokens, num_seqs + 1, num_seqs, num_seqs * width)
    host = torch.empty(sum(sizes), dtype=torch.long, pin_memory=device.type == "cuda")
    parts = (layout.positions, layout.slots, layout.starts, layout.num_computed, layout.tables)
    for out, values in zip(host.split(sizes), parts, strict=True):
        out.numpy()[:] = values.ravel()
    flat = host.to(device, non_blocking=True) if device.type == "cuda" else host
    positions, slots, starts, done, tables = flat.split(sizes)
    return FlatMetadata(
        positions=positions,
        slot_mapping=slots,
        query_starts=starts,
        num_computed=done,
        block_tables=tables.view(num_seqs, width),
        num_seqs=num_seqs,
        max_query_len=int(layout.query_lens.max()),
        layer_windows=sliding_windows(layer_windows),
        num_tokens=num_tokens,
    )


if triton is not None:

    @triton.jit
    def _cached_rows(ptr, row, offsets, mask, row_real, HEAD_DIM: tl.constexpr, INT8: tl.constexpr):
        """K or V rows [BLOCK_N, BLOCK_D] read from the cache at ``row`` (each row's
        first element): as stored, or (INT8) its int8 values times the float32 scale
        stored after them, in float32 as the torch backend dequantizes them."""
        if INT8:
            values = tl.load(ptr + offsets, mask=mask, other=0).to(tl.int8, bitcast=True)
            scale_at = (ptr + row + HEAD_DIM).to(tl.pointer_type(tl.float32), bitcast=True)
            scales = tl.load(scale_at, mask=row_real, other=0.0)
            rows = values.to(tl.float32) * scales[:, None]
        else:  # (one return: the compiler types every return alike)
            rows = tl.load(ptr + offsets, mask=mask, other=0.0)
        return rows

    @triton.jit
    def _round_half_even(x):
        """torch.round's rounding (ties to even), in Triton's interpreter too."""
        floor = tl.floor(x)
        odd = floor - 2.0 * tl.floor(floor * 0.5)
        return tl.where(x - floor > 0.5, floor + 1.0, tl.where(x - floor < 0.5, floor, floor + odd))

    @triton.jit
    def _int8_row(x, cache_ptr, at, scale_at, real):
        """One K or V row stored as kv_cache.quantize_kv_rows does: int8 values of the
        row over its largest magnitude / 127, then that scale as float32."""
        x = x.to(tl.float32)
        scale = tl.max(tl.abs(x), 0) / 127.0
        inverse = tl.where(scale > 0, 1.0 / tl.where(scale > 0, scale, 1.0), 0.0)
        q = _round_half_even(x * inverse).to(tl.int8)
        tl.store(cache_ptr + at, q.to(tl.uint8, bitcast=True), mask=real)
        tl.store((cache_ptr + scale_at).to(tl.pointer_type(tl.float32), bitcast=True), scale)

    @triton.jit
    def _paged_attention(
        out_ptr, q_ptr, k_ptr, v_ptr, tables_ptr, starts_ptr, computed_ptr,
        part_acc_ptr, part_top_ptr, part_total_ptr, sinks_ptr,
        stride_qt, stride_qh, stride_ot, stride_oh,
        stride_kb, stride_ks, stride_kh, stride_table,
        scale, window, splits, keys_per_split,
        G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PAGE: tl.constexpr,
        PRECISION: tl.constexpr, SPLIT: tl.constexpr, INT8: tl.constexpr,
        SINKS: tl.constexpr,
    ):  # fmt: skip
        """Program (sequence, tile x split, KV head): a tile's rows over the keys of one
        split of the context (SPLIT: written as partial results for _combine_splits;
        else one split, normalised and written out). INT8: the cache's rows are int8
        values and their float32 scale (kv_cache.quantize_kv_rows), widened on load.
        SINKS: each query head's sink logit (float32 at ``sinks_ptr``) joins its rows'
        denominators, as one more key that adds no value (gpt-oss)."""
        seq = tl.program_id(0)
        tile = tl.program_id(1) // splits
        split = tl.program_id(1) % splits
        kv_head = tl.program_id(2)
        first_token = tl.load(starts_ptr + seq)
        q_len = tl.load(starts_ptr + seq + 1) - first_token
        done = tl.load(computed_ptr + seq)
        local = tl.arange(0, BLOCK_M)
        rows = tile * BLOCK_M + local
        tok = rows // G
        head = kv_head * G + rows % G
        row_real = tok < q_len
        dims = tl.arange(0, BLOCK_D)
        dim_real = dims < HEAD_DIM
        q_pos = done + tok
        q = tl.load(
            q_ptr + (first_token + tok)[:, None] * stride_qt + head[:, None] * stride_qh
            + dims[None, :],
            mask=row_real[:, None] & dim_real[None, :], other=0.0,
        )  # fmt: skip
        last_tok = tl.minimum((tile * BLOCK_M + BLOCK_M - 1) // G, q_len - 1)
        # keys [start, end) cover every row of the tile; none for a tile past the
        # sequence's rows (the grid is as tall as the longest sequence needs)
        end = tl.where(tile * BLOCK_M < q_len * G, done + last_tok + 1, 0)
        start = done * 0
        if window > 0:
            start = tl.maximum(done + tile * BLOCK_M // G - window + 1, 0)
        start = tl.maximum(start, split * keys_per_split)
        start = (start // BLOCK_N) * BLOCK_N
        end = tl.minimum(end, (split + 1) * keys_per_split)
        top = tl.full([BLOCK_M], float("-inf"), tl.float32)
        total = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        keys = tl.arange(0, BLOCK_N)
        for n in range(start, end, BLOCK_N):
            k_pos = n + keys
            k_real = (k_pos < end) & (k_pos >= start)
            block = tl.load(tables_ptr + seq * stride_table + k_pos // PAGE, mask=k_real, other=0)
            row = block * stride_kb + (k_pos % PAGE) * stride_ks + kv_head * stride_kh
            offsets = row[:, None] + dims[None, :]
            kv_mask = k_real[:, None] & dim_real[None, :]
            k = _cached_rows(k_ptr, row, offsets, kv_mask, k_real, HEAD_DIM, INT8).to(q.dtype)
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION)
            allowed = (k_pos[None, :] <= q_pos[:, None]) & k_real[None, :]
            if window > 0:
                allowed = allowed & (k_pos[None, :] > q_pos[:, None] - window)
            s = tl.where(allowed, s * scale, float("-inf"))
            new_top = tl.maximum(top, tl.max(s, 1))
            # Rows with nothing allowed yet keep -inf: exp(-inf - -inf) would be NaN.
            safe_top = tl.where(new_top == float("-inf"), 0.0, new_top)
            p = tl.exp(s - safe_top[:, None])
            correction = tl.exp(top - safe_top)
            total = total * correction + tl.sum(p, 1)
            v = _cached_rows(v_ptr, row, offsets, kv_mask, k_real, HEAD_DIM, INT8).to(q.dtype)
            acc = acc * correction[:, None] + tl.dot(p.to(q.dtype), v, input_precision=PRECISION)
            top = new_top
        if SPLIT:
            at = ((seq * tl.num_programs(2) + kv_head) * splits + split) * BLOCK_M + local
            tl.store(part_top_ptr + at, top)
            tl.store(part_total_ptr + at, total)
            tl.store(part_acc_ptr + at[:, None] * BLOCK_D + dims[None, :], acc)
        else:
            if SINKS:
                sink = tl.load(sinks_ptr + head, mask=row_real, other=float("-inf"))
                total += tl.exp(sink - tl.where(top == float("-inf"), 0.0, top))
            acc = acc / tl.where(total == 0.0, 1.0, total)[:, None]
            tl.store(
                out_ptr + (first_token + tok)[:, None] * stride_ot + head[:, None] * stride_oh
                + dims[None, :],
                acc.to(out_ptr.dtype.element_ty),
                mask=row_real[:, None] & dim_real[None, :],
            )  # fmt: skip

    @triton.jit
    def _combine_splits(
        out_ptr, starts_ptr, part_acc_ptr, part_top_ptr, part_total_ptr, sinks_ptr,
        stride_ot, stride_oh, splits,
        G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
        BLOCK_M: tl.constexpr, SPLITS: tl.constexpr, SINKS: tl.constexpr,
    ):  # fmt: skip
        """A decode tile's splits merged by their maxima and sums (flash-decoding), the
        sinks (SINKS) joining the sums."""
        seq = tl.program_id(0)
        kv_head = tl.program_id(1)
        first_token = tl.load(starts_ptr + seq)
        q_len = tl.load(starts_ptr + seq + 1) - first_token
        local = tl.arange(0, BLOCK_M)
        tok = local // G
        head = kv_head * G + local % G
        part = tl.arange(0, SPLITS)
        at = ((seq * tl.num_programs(1) + kv_head) * splits + part)[:, None] * BLOCK_M + local[
            None, :
        ]
        real = (part < splits)[:, None] & (local >= 0)[None, :]
        tops = tl.load(part_top_ptr + at, mask=real, other=float("-inf"))
        totals = tl.load(part_total_ptr + at, mask=real, other=0.0)
        best = tl.max(tops, 0)
        safe = tl.where(best == float("-inf"), 0.0, best)
        weight = tl.exp(tops - safe[None, :])
        total = tl.sum(weight * totals, 0)
        if SINKS:
            total += tl.exp(tl.load(sinks_ptr + head) - safe)
        dims = tl.arange(0, BLOCK_D)
        acc = tl.load(part_acc_ptr + at[:, :, None] * BLOCK_D + dims[None, None, :],
                      mask=real[:, :, None], other=0.0)  # fmt: skip
        out = tl.sum(weight[:, :, None] * acc, 0) / tl.where(total == 0.0, 1.0, total)[:, None]
        tl.store(
            out_ptr + (first_token + tok)[:, None] * stride_ot + head[:, None] * stride_oh
            + dims[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=(tok < q_len)[:, None] & (dims < HEAD_DIM)[None, :],
        )  # fmt: skip

    @triton.jit
    def _write_kv(
        k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slots_ptr,
        stride_kt, stride_kh, stride_vt, stride_vh, stride_cs, stride_ch,
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, FP8: tl.constexpr,
        INT8: tl.constexpr,
    ):  # fmt: skip
        """Token t's K/V rows of one KV head to its slot (none when the slot is < 0: a
        CUDA graph's padding rows); INT8: as int8 values and a scale each."""
        token = tl.program_id(0)
        head = tl.program_id(1)
        slot = tl.load(slots_ptr + token)
        if slot >= 0:
            dims = tl.arange(0, BLOCK_D)
            real = dims < HEAD_DIM
            k = tl.load(k_ptr + token * stride_kt + head * stride_kh + dims, mask=real, other=0.0)
            v = tl.load(v_ptr + token * stride_vt + head * stride_vh + dims, mask=real, other=0.0)
            row = slot * stride_cs + head * stride_ch
            if INT8:
                _int8_row(k, k_cache_ptr, row + dims, row + HEAD_DIM, real)
                _int8_row(v, v_cache_ptr, row + dims, row + HEAD_DIM, real)
            else:
                if FP8:  # saturate at e4m3's largest value, as cache_rows does
                    k = tl.clamp(k.to(tl.float32), -448.0, 448.0)
                    v = tl.clamp(v.to(tl.float32), -448.0, 448.0)
                tl.store(k_cache_ptr + row + dims, k.to(k_cache_ptr.dtype.element_ty), mask=real)
                tl.store(v_cache_ptr + row + dims, v.to(v_cache_ptr.dtype.element_ty), mask=real)


def write_kv(k, v, k_blocks, v_blocks, slot_mapping: torch.Tensor) -> None:
    """k/v [T, Hkv, D] (any strides but the last) to the cache's slots, rounded to
    its type; tokens whose slot is negative are skipped."""
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    _write_kv[(num_tokens, num_kv_heads)](
        k, v, k_blocks, v_blocks, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_blocks.stride(1), k_blocks.stride(2),
        HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim),
        FP8=k_blocks.dtype == torch.float8_e4m3fn, INT8=k_blocks.dtype == torch.uint8,
        num_warps=1,
    )  # fmt: skip


# A decode batch whose (sequence, KV head) programs are fewer than this splits each
# sequence's keys among several programs (flash-decoding): a batch of one on a GPU of
# 132 multiprocessors otherwise runs 8 programs, each walking the whole context.
SPLIT_BELOW_PROGRAMS = 512
KEYS_PER_SPLIT_MIN = 128


def paged_attention(
    q: torch.Tensor,
    k_blocks: torch.Tensor,
    v_blocks: torch.Tensor,
    metadata: FlatMetadata,
    scale: float,
    window: int | None,
    out: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [T, H, D] (T tokens of ``metadata``'s sequences), k/v_blocks [num_blocks,
    block_size, Hkv, D] holding every token's K/V already -> [T, H, D]: each token
    attends its sequence's positions up to its own (within ``window`` when given;
    ``sinks`` [H], each query head's sink logit, joining its softmax).

    The launch depends on host-side shapes only (sequences, longest query, block
    table width), so a CUDA graph replays it for any contents of the metadata."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads, page = k_blocks.shape[2], k_blocks.shape[1]
    g = num_heads // num_kv_heads
    if out is None:
        out = torch.empty_like(q)
    if q.stride(-1) != 1:
        q = q.contiguous()
    num_seqs = metadata.num_seqs
    prompt_like = metadata.max_query_len * g > 16
    block_m = 64 if prompt_like else 16
    block_n = 64 if prompt_like else 32
    block_d = max(16, triton.next_power_of_2(head_dim))
    tiles = -(-metadata.max_query_len * g // block_m)
    capacity = metadata.block_tables.shape[1] * page  # keys a sequence may have
    splits = 1
    if tiles == 1 and num_seqs * num_kv_heads < SPLIT_BELOW_PROGRAMS:
        wanted = -(-SPLIT_BELOW_PROGRAMS // (num_seqs * num_kv_heads))
        splits = max(1, min(wanted, capacity // KEYS_PER_SPLIT_MIN))
    keys_per_split = -(-capacity // splits)
    keys_per_split = -(-keys_per_split // block_n) * block_n
    parts = (None, None, None)
    sink_logits = out if sinks is None else sinks.detach().float().contiguous()
    if splits > 1:
        rows = num_seqs * num_kv_heads * splits * block_m
        parts = (
            q.new_empty(rows, block_d, dtype=torch.float32),
            q.new_empty(rows, dtype=torch.float32),
            q.new_empty(rows, dtype=torch.float32),
        )
    _paged_attention[(num_seqs, tiles * splits, num_kv_heads)](
        out, q, k_blocks, v_blocks, metadata.block_tables, metadata.query_starts,
        metadata.num_computed, *(p if p is not None else out for p in parts), sink_logits,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_blocks.stride(0), k_blocks.stride(1), k_blocks.stride(2),
        metadata.block_tables.stride(0),
        scale, window or 0, splits, keys_per_split,
        G=g, HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_M=block_m, BLOCK_N=block_n, PAGE=page,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32", SPLIT=splits > 1,
        INT8=k_blocks.dtype == torch.uint8, SINKS=sinks is not None,
        num_warps=4 if prompt_like else 2,
    )  # fmt: skip
    if splits > 1:
        _combine_splits[(num_seqs, num_kv_heads)](
            out, metadata.query_starts, *parts, sink_logits, out.stride(0), out.stride(1),
            splits, G=g, HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_M=block_m,
            SPLITS=triton.next_power_of_2(splits), SINKS=sinks is not None, num_warps=4,
        )  # fmt: skip
    return out


class TritonPagedAttention:
    """kv_cache: [num_layers, 2, num_blocks, block_size, Hkv, D] (see kv_cache.py)."""

    build_metadata = staticmethod(build_flat_metadata)

    def __init__(self, metadata: FlatMetadata, kv_cache: torch.Tensor) -> None:
        self.metadata = metadata
        self.kv_cache = kv_cache

    def attend(self, layer_idx, q, k, v, scale: float, sinks=None) -> torch.Tensor:
        k_blocks, v_blocks = self.kv_cache[layer_idx]
        write_kv(k, v, k_blocks, v_blocks, self.metadata.slot_mapping)
        return paged_attention(q, k_blocks, v_blocks, self.metadata, scale,
                               self.metadata.window(layer_idx), sinks=sinks)  # fmt: skip


def supported(device: torch.device, dtype: torch.dtype) -> bool:
    return triton is not None and device.type == "cuda"
