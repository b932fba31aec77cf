"""The torch backend for the paged cache: index_copy_ writes, block gathers and
``scaled_dot_product_attention``; runs on any device and dtype.

Per layer it writes the new K/V rows at their slots, then per group gathers each
sequence's context whole blocks at a time (as rows of a 2-D view, so index_select
copies contiguous runs at memcpy speed) and runs one masked, batched attention; fresh
prompts attend causally over this forward's own K/V (as the cache holds them: rounded
to its type, so a prompt's result does not depend on how it was chunked).
Grouped-query heads are folded into the query axis instead of repeating K/V::

    q [S, Lq, Hkv*G, D] -> [S, Hkv, G*Lq, D]     k/v [S, Lk, Hkv, D] -> [S, Hkv, Lk, D]

A long prompt chunk after a long cached prefix would need a mask of G*Lq x Lk per
sequence (SDPA turns a boolean mask into a float one: 1 GB for a 2k chunk at 32k
tokens of context with 4 query heads per KV head), so on the CPU such chunks go
another way (``split_chunk_attention``): the prefix with no mask at all, the chunk
over itself causally, both through torch's tiled flash-attention kernel, which
returns each row's log-sum-exp, and the two merged by it. The prefix is read from the
blocks a span of PREFIX_SPAN tokens at a time, each span merged in as it comes: no mask
is read and no copy of a long context is held (so do chunks of any length once the
context passes PREFIX_SPAN). The chunk's queries go QUERY_SLICE rows at a time, so its
temporaries beside the output are a slice's, whatever the chunk's length.

Attention sinks (gpt-oss: a learned logit per query head that joins every row's
softmax and adds no value) need each row's log-sum-exp: a row's output is then its
sink-free output times sigmoid(lse - sink) (``with_sinks``). Those paths run torch's
tiled CPU flash kernel, which returns it, or on other devices the explicit softmax.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tandem.runner.attention.metadata import AttentionGroup, PagedAttentionMetadata
from tandem.runner.kv_cache import as_cached, cache_rows, dequantize_kv_rows, quantize_kv_rows


def with_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """Rows' attention without sinks -> with them: out [..., L, D], its rows' log-sum-exp
    of scaled scores lse [..., L], ``sinks`` each row's sink logit (broadcast to lse's
    shape). The sink's term joins a row's softmax denominator and adds no value, so the
    row is scaled by exp(lse) / (exp(lse) + exp(sink)) = sigmoid(lse - sink)."""
    keep = torch.sigmoid(lse.float() - sinks.float())
    return (out.float() * keep[..., None]).to(out.dtype)


def _attention(q, k, v, mask, scale: float, causal: bool, sinks=None) -> torch.Tensor:
    """F.scaled_dot_product_attention over q/k/v [B, H, L, D] (as many heads each; mask
    boolean, True where allowed), with each row's sink (``sinks`` broadcast to
    [B, H, L]) when given (``with_sinks``)."""
    if sinks is None:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=causal and mask is None, scale=scale
        )
    if q.device.type == "cpu":
        additive = None
        if mask is not None:
            additive = torch.zeros(mask.shape, dtype=q.dtype, device=q.device)
            additive.masked_fill_(~mask, float("-inf"))
        out, lse = _flash(q, k, v, causal and mask is None, scale, additive)
        return with_sinks(out, lse, sinks)
    scores = (q.float() @ k.float().transpose(-1, -2)) * scale  # (no lse from SDPA here)
    if causal and mask is None:
        mask = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).tril()
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, -1)
    out = (torch.softmax(scores, -1).nan_to_num_(0.0) @ v.float()).to(q.dtype)
    return with_sinks(out, lse, sinks)


def _grouped_attention(q, k, v, mask, scale: float, sinks=None) -> torch.Tensor:
    """q [S, Lq, H, D], k/v [S, Lk, Hkv, D], mask [S, 1, G*Lq, Lk] -> [S, Lq, H, D]."""
    s, lq, h, d = q.shape
    hkv = k.shape[2]
    g = h // hkv
    qg = q.view(s, lq, hkv, g, d).permute(0, 2, 3, 1, 4).reshape(s, hkv, g * lq, d)
    # A folded row's sink is its query head's: rows run (head of the group, token).
    if sinks is not None:
        sinks = sinks.view(hkv, g, 1).expand(hkv, g, lq).reshape(hkv, g * lq)
    out = _attention(qg, k.transpose(1, 2), v.transpose(1, 2), mask, scale, False, sinks)
    return out.view(s, hkv, g, lq, d).permute(0, 3, 1, 2, 4).reshape(s, lq, h, d)


def causal_attention(
    q, k, v, num_seqs: int, length: int, scale: float, mask=None, causal: bool = True,
    sinks=None,
):  # fmt: skip
    """num_seqs sequences of ``length`` tokens, flattened: q [n*L, H, D], k/v
    [n*L, Hkv, D] -> [n*L, H, D]; causal unless an explicit ``mask`` is given, or
    ``causal`` is False (an encoder's: every token attends to its whole sequence);
    ``sinks`` [H]: each query head's sink logit (``with_sinks``)."""
    h, hkv = q.shape[1], k.shape[1]
    if sinks is not None:  # the K/V heads repeated for their query heads
        k, v = (x.repeat_interleave(h // hkv, 1) for x in (k, v))
        out = _attention(
            *(x.reshape(num_seqs, length, h, -1).transpose(1, 2) for x in (q, k, v)),
            mask, scale, causal, sinks[:, None],
        )  # fmt: skip
        return out.transpose(1, 2).reshape(num_seqs * length, h, -1)
    out = F.scaled_dot_product_attention(
        q.reshape(num_seqs, length, h, -1).transpose(1, 2),
        k.reshape(num_seqs, length, hkv, -1).transpose(1, 2),
        v.reshape(num_seqs, length, hkv, -1).transpose(1, 2),
        attn_mask=mask,
        is_causal=causal and mask is None,
        scale=scale,
        enable_gqa=h != hkv,
    )
    return out.transpose(1, 2).reshape(num_seqs * length, h, -1)


# Chunks whose mask would hold at least this many elements take split_chunk_attention.
SPLIT_MASK_ELEMENTS = 1 << 22
# ... and so do chunks whose context is longer than this: their prefix is read this many
# tokens at a time, each span gathered into one small workspace, so a chunk after a 32k
# prefix holds a few MB of K/V beside the cache, not a copy of its whole context.
PREFIX_SPAN = 4096
# ... and its query rows this many at a time (split_chunk_attention), so that a 2,048-token
# chunk's attention holds slices of a few MB beside its output, not copies of the chunk.
QUERY_SLICE = 512


def _flash(q, k, v, causal: bool, scale: float, mask=None):
    """torch's tiled CPU flash kernel: q [B, H, Lq, D], k/v [B, H, Lk, D] (``mask``
    additive, q's dtype) -> the output [B, H, Lq, D] and each row's log-sum-exp
    [B, H, Lq] (0 for a row that attends nothing, whose output is 0)."""
    kernel = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    return kernel(q, k, v, 0.0, causal, attn_mask=mask, scale=scale)


def split_chunk_attention(q, own_k, own_v, prefix_spans, scale: float, sinks=None) -> torch.Tensor:
    """One sequence's prompt chunk after cached tokens: q [Lq, H, D], own_k/own_v
    [Lq, Hkv, D] (the chunk's own K/V), ``prefix_spans`` the cached prefix as (k, v)
    pieces [n, Hkv, D] in any order -> [Lq, H, D]. Every row sees the whole prefix and
    the chunk up to itself. The chunk's rows go QUERY_SLICE at a time: each slice over
    its own rows (square and causal), then over each piece of the prefix and over the
    chunk's earlier rows (no mask), attended apart by the flash kernel and merged into
    the slice's output by their log-sum-exps as they come. Only one piece is held at a
    time, and every temporary but the output is a slice's size, not the chunk's.
    ``sinks`` [H]: each query head's sink logit, merged last (``with_sinks``)."""
    lq, h, d = q.shape
    hkv = own_k.shape[1]
    g = h // hkv
    slices = [(a, min(a + QUERY_SLICE, lq)) for a in range(0, lq, QUERY_SLICE)]
    out = q.new_empty((h, lq, d), dtype=torch.float32)
    lse = q.new_empty((h, lq), dtype=torch.float32)
    for a, b in slices:  # each KV head repeated for its query heads
        own = (x[a:b].repeat_interleave(g, 1).transpose(0, 1).unsqueeze(0) for x in (own_k, own_v))
        piece, piece_lse = _flash(q[a:b].transpose(0, 1).unsqueeze(0), *own, True, scale)
        out[:, a:b], lse[:, a:b] = piece[0], piece_lse[0]

    def merge(a: int, b: int, k, v) -> None:
        # The G query heads of a KV head folded into the query axis: K/V not repeated.
        folded = q[a:b].reshape(b - a, hkv, g, d).permute(1, 2, 0, 3).reshape(1, hkv, -1, d)
        piece, piece_lse = _flash(
            folded, k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0), False, scale
        )
        piece, piece_lse = piece.reshape(h, b - a, d).float(), piece_lse.reshape(h, b - a)
        rows, rows_lse = out[:, a:b], lse[:, a:b]
        top = torch.maximum(rows_lse, piece_lse)
        w_rows, w_piece = (rows_lse - top).exp_(), (piece_lse - top).exp_()
        total = w_rows + w_piece
        rows.mul_((w_rows / total)[..., None]).add_(piece.mul_((w_piece / total)[..., None]))
        rows_lse.copy_(top.add_(total.log_()))

    for k, v in prefix_spans:  # each piece read once, for every slice
        for a, b in slices:
            merge(a, b, k, v)
    for a, b in slices[1:]:
        merge(a, b, own_k[:a], own_v[:a])
    if sinks is not None:
        out = with_sinks(out, lse, sinks[:, None])
    return out.to(q.dtype).transpose(0, 1)


def _copyable(t: torch.Tensor) -> torch.Tensor:
    """fp8 tensors as their bytes: torch's CPU index_copy_ / index_select have no fp8."""
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


class TorchPagedAttention:
    """kv_cache: [num_layers, 2, num_blocks, block_size, Hkv, D] (see kv_cache.py)."""

    # Callables running a whole decoder layer, and every layer at once, when the backend
    # has them for this step (cpu_paged.py); models ask for them and otherwise run their
    # layers themselves.
    decode_layer = None
    decode_stack = None

    def __init__(self, metadata: PagedAttentionMetadata, kv_cache: torch.Tensor) -> None:
        self.metadata = metadata
        self.kv_cache = kv_cache
        # Gather buffers and head-repeated masks, one per group, reused by every layer
        # of this forward: fresh multi-MB allocations per layer cost page faults on CPU.
        self._workspaces: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        # split_chunk_attention's: a chunk's own rows ("own") and a prefix span ("span").
        self._span_workspaces: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self._masks: dict[tuple[int, int | None], torch.Tensor] = {}

    def attend(self, layer_idx, q, k, v, scale: float, sinks=None) -> torch.Tensor:
        """``sinks`` [H]: each query head's sink logit (gpt-oss), or None."""
        k_blocks, v_blocks = self.kv_cache[layer_idx]  # [num_blocks, block_size, Hkv, D]
        self.write_kv(k, v, k_blocks, v_blocks)
        out = q.new_empty(q.shape[0], q.shape[1], q.shape[2])
        window = self.metadata.window(layer_idx)
        for index, group in enumerate(self.metadata.groups):
            self.attend_group(index, group, q, k_blocks, v_blocks, out, scale, window, sinks)
        for group in self.metadata.fresh_prompts:
            num_seqs, length = group.token_index.shape
            tokens = group.token_index.flatten()
            group_out = causal_attention(
                q.index_select(0, tokens),
                as_cached(k.index_select(0, tokens), k_blocks.dtype),
                as_cached(v.index_select(0, tokens), v_blocks.dtype),
                num_seqs,
                length,
                scale,
                group.mask(window),
                sinks=sinks,
            )
            out.index_copy_(0, tokens, group_out)
        return out

    def write_kv(self, k, v, k_blocks, v_blocks) -> None:
        num_kv_heads, width = k_blocks.shape[-2:]
        slots = self.metadata.slot_mapping
        if k_blocks.dtype == torch.uint8:  # int8 rows with their scales (kv_cache.py)
            k, v = quantize_kv_rows(k), quantize_kv_rows(v)
        else:  # a cache type of its own (bfloat16, fp8) rounds here
            k, v = cache_rows(k, k_blocks.dtype), cache_rows(v, v_blocks.dtype)
        k_blocks, v_blocks, k, v = (_copyable(t) for t in (k_blocks, v_blocks, k, v))
        k_blocks.view(-1, num_kv_heads, width).index_copy_(0, slots, k)
        v_blocks.view(-1, num_kv_heads, width).index_copy_(0, slots, v)

    def attend_group(
        self, index: int, group: AttentionGroup, q, k_blocks, v_blocks, out, scale: float,
        window: int | None, sinks=None,
    ) -> None:  # fmt: skip
        num_kv_heads, width = k_blocks.shape[-2:]
        stored = k_blocks.dtype
        k_rows = _copyable(k_blocks).view(k_blocks.shape[0], -1)
        v_rows = _copyable(v_blocks).view(v_blocks.shape[0], -1)
        num_seqs, num_q = group.query_index.shape
        heads_per_kv = q.shape[1] // num_kv_heads
        padded_context = group.block_tables.shape[1] * group.block_size
        if (
            window is None
            and not group.decodes
            and q.device.type == "cpu"
            and (
                heads_per_kv * num_q * padded_context >= SPLIT_MASK_ELEMENTS
                or padded_context > PREFIX_SPAN
            )
        ):
            self._attend_split(group, q, k_blocks, v_blocks, out, scale, sinks)
            return
        blocks = group.block_tables.flatten()
        if index not in self._workspaces:
            shape = (len(blocks), k_rows.shape[1])
            self._workspaces[index] = (k_rows.new_empty(shape), v_rows.new_empty(shape))
        k_buffer, v_buffer = self._workspaces[index]
        kv_shape = (num_seqs, -1, num_kv_heads, width)
        keys = torch.index_select(k_rows, 0, blocks, out=k_buffer).view(kv_shape)
        values = torch.index_select(v_rows, 0, blocks, out=v_buffer).view(kv_shape)
        if stored == torch.uint8:
            keys, values = dequantize_kv_rows(keys, q.dtype), dequantize_kv_rows(values, q.dtype)
        elif stored != q.dtype:
            keys, values = keys.view(stored).to(q.dtype), values.view(stored).to(q.dtype)
        queries = q.index_select(0, group.query_index.flatten()).view(num_seqs, num_q, *q.shape[1:])
        if (index, window) not in self._masks:
            # The query heads sharing a KV head are stacked on the query axis, so the
            # mask repeats once per head of the group (built once per forward).
            self._masks[index, window] = group.mask(window).repeat(1, 1, heads_per_kv, 1)
        mask = self._masks[index, window]
        group_out = _grouped_attention(queries, keys, values, mask, scale, sinks)
        group_out = group_out.flatten(0, 1)
        if group.valid_rows is not None:
            group_out = group_out.index_select(0, group.valid_rows)
        out.index_copy_(0, group.valid_tokens, group_out)

    def _attend_split(
        self, group: AttentionGroup, q, k_blocks, v_blocks, out, scale, sinks
    ) -> None:
        """Prompt chunks after a long prefix (split_chunk_attention), a sequence at a
        time, the prefix read from the blocks PREFIX_SPAN tokens at a time."""
        for table, q_len, computed, start in zip(
            group.block_tables, group.host_query_lens, group.host_num_computed,
            group.host_query_starts, strict=True,
        ):  # fmt: skip

            def rows(first: int, end: int, slot: str, table=table):
                return self._context_rows(k_blocks, v_blocks, table, first, end, q.dtype, slot)

            own_k, own_v = rows(computed, computed + q_len, "own")
            spans = (
                rows(first, min(first + PREFIX_SPAN, computed), "span")
                for first in range(0, computed, PREFIX_SPAN)
            )
            # A sequence's queries are the flat batch's rows [start, start + q_len).
            mine = slice(start, start + q_len)
            out[mine] = split_chunk_attention(q[mine], own_k, own_v, spans, scale, sinks)

    def _context_rows(self, k_blocks, v_blocks, table, start: int, end: int, dtype, slot: str):
        """One sequence's cached K/V rows [start, end) -> k, v [end - start, Hkv, D] in
        ``dtype``, gathered whole blocks at a time into the workspace ``slot`` (reused by
        every call of this forward, grown to the largest span asked for: a result is
        valid until the slot's next call)."""
        block_size = k_blocks.shape[1]
        num_kv_heads, width = k_blocks.shape[-2:]
        first, last = start // block_size, -(-end // block_size)
        blocks = table[first:last]
        held = self._span_workspaces.get(slot)
        if held is None or held[0].shape[0] < len(blocks):
            shape = (len(blocks), k_blocks[0].numel())
            k_flat, v_flat = _copyable(k_blocks), _copyable(v_blocks)
            held = (k_flat.new_empty(shape), v_flat.new_empty(shape))
            self._span_workspaces[slot] = held
        picked = []
        for cache, buffer in zip((k_blocks, v_blocks), held, strict=True):
            rows = _copyable(cache).view(cache.shape[0], -1)
            gathered = torch.index_select(rows, 0, blocks, out=buffer[: len(blocks)])
            offset = start - first * block_size
            part = gathered.view(-1, num_kv_heads, width)[offset : offset + end - start]
            if cache.dtype == torch.uint8:
                part = dequantize_kv_rows(part, dtype)
            elif cache.dtype != dtype:
                part = part.view(cache.dtype).to(dtype)
            picked.append(part)
        return picked[0], picked[1]
