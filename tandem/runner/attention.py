"""Attention backends: where a layer's q, k, v meet the KV cache.

``PagedAttention`` is the engine's path. One forward carries a flat batch of T tokens
from S sequences, each at its own position: whole prompts, prompt chunks that continue
after cached tokens, single decode tokens. Each layer

1. writes the new K/V rows into the paged cache through ``slot_mapping``
   (slot = block_id * block_size + offset), and
2. gathers every sequence's context back block by block through its block table and
   runs one batched ``scaled_dot_product_attention`` per group of sequences.

Sequences are grouped: decodes (1 query each), prompt chunks that continue after cached
tokens (each group padded to a rectangle with a mask), and fresh prompts (nothing
cached: causal attention over this forward's own K/V, batched by length, no gather).
So a decode batch never pays for a long prompt's padding. Grouped-query attention folds
the query heads that share a KV head into the query axis instead of repeating K/V::

    q [S, Lq, Hkv*G, D] -> [S, Hkv, G*Lq, D]     k/v [S, Lk, Hkv, D] -> [S, Hkv, Lk, D]

``CausalAttention`` is plain causal attention over equal-length sequences with no
cache: the naive recompute-everything baseline, and training.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tandem.runner import cpu_paged_attention


@dataclass
class AttentionGroup:
    """Sequences attended together, padded to [S, Lq] queries and [S, Lk] keys."""

    query_index: torch.Tensor  # [S, Lq] token index into the flat batch (padding: 0)
    block_tables: torch.Tensor  # [S, Nb] blocks holding the context; Lk = Nb * block_size
    mask: torch.Tensor  # [S, 1, Lq, Lk] True where query may attend key
    valid_rows: torch.Tensor | None  # rows of the [S*Lq] queries that are real; None: all
    valid_tokens: torch.Tensor  # flat-batch token index of each real row
    context_lens: torch.Tensor  # [S] tokens of context, the new ones included


@dataclass
class FreshPromptGroup:
    """Prompts with nothing cached yet, all of one length: plain causal attention over
    this forward's own K/V (no gather from the cache, no padding, no explicit mask)."""

    token_index: torch.Tensor  # [S, L] flat-batch token indices


@dataclass
class PagedAttentionMetadata:
    slot_mapping: torch.Tensor  # [T] cache slot each new token's K/V is written to
    groups: list[AttentionGroup]  # decodes; prompt chunks that continue after the cache
    fresh_prompts: list[FreshPromptGroup]
    sliding_window: int | None  # keys older than this many positions are not attended


def build_paged_metadata(
    query_lens: torch.Tensor,
    num_computed: torch.Tensor,
    block_tables: torch.Tensor,
    block_size: int,
    sliding_window: int | None = None,
) -> tuple[PagedAttentionMetadata, torch.Tensor]:
    """Metadata for S sequences contributing ``query_lens[s]`` tokens each, positioned
    after ``num_computed[s]`` cached tokens; returns it with the flat token positions.

    All inputs are int64 tensors on the model's device; block_tables is [S, max_blocks]
    (rows padded with any valid block id)."""
    device = query_lens.device
    starts = torch.cumsum(query_lens, 0) - query_lens
    seq_of_token = torch.repeat_interleave(torch.arange(len(query_lens), device=device), query_lens)
    positions = (
        num_computed[seq_of_token]
        + torch.arange(len(seq_of_token), device=device)
        - starts[seq_of_token]
    )
    block_ids = block_tables[seq_of_token, positions // block_size]
    slot_mapping = block_ids * block_size + positions % block_size
    is_decode = query_lens == 1
    fresh = (num_computed == 0) & ~is_decode
    if sliding_window is not None:
        fresh &= query_lens <= sliding_window
    groups = []
    for members in (
        torch.nonzero(is_decode).flatten(),
        torch.nonzero(~is_decode & ~fresh).flatten(),
    ):
        if len(members):
            groups.append(
                _build_group(
                    members,
                    query_lens,
                    num_computed,
                    starts,
                    block_tables,
                    block_size,
                    sliding_window,
                )
            )
    fresh_prompts = []
    fresh_members = torch.nonzero(fresh).flatten()
    if len(fresh_members):
        lengths = query_lens[fresh_members]
        for length in torch.unique(lengths).tolist():
            same = fresh_members[lengths == length]
            offsets = torch.arange(length, device=device)
            fresh_prompts.append(FreshPromptGroup(starts[same][:, None] + offsets[None, :]))
    metadata = PagedAttentionMetadata(slot_mapping, groups, fresh_prompts, sliding_window)
    return metadata, positions


def _build_group(
    members: torch.Tensor,
    query_lens: torch.Tensor,
    num_computed: torch.Tensor,
    starts: torch.Tensor,
    block_tables: torch.Tensor,
    block_size: int,
    sliding_window: int | None,
) -> AttentionGroup:
    device = members.device
    q_lens = query_lens[members]
    computed = num_computed[members]
    context_lens = computed + q_lens
    max_q = int(q_lens.max())
    num_key_blocks = -(-int(context_lens.max()) // block_size)
    max_k = num_key_blocks * block_size
    q_offsets = torch.arange(max_q, device=device)
    q_real = q_offsets[None, :] < q_lens[:, None]  # [S, Lq]
    query_index = torch.where(q_real, starts[members][:, None] + q_offsets[None, :], 0)
    q_pos = computed[:, None] + q_offsets[None, :]  # [S, Lq]
    k_pos = torch.arange(max_k, device=device)
    k_real = k_pos[None, :] < context_lens[:, None]  # [S, Lk]
    mask = (k_pos[None, None, :] <= q_pos[:, :, None]) & k_real[:, None, :]
    if sliding_window is not None:
        mask &= k_pos[None, None, :] > q_pos[:, :, None] - sliding_window
    flat_real = q_real.flatten()
    all_real = bool(flat_real.all())
    valid_rows = None if all_real else torch.nonzero(flat_real).flatten()
    valid_tokens = query_index.flatten() if all_real else query_index.flatten()[valid_rows]
    group_tables = block_tables[members, :num_key_blocks].contiguous()
    return AttentionGroup(
        query_index, group_tables, mask[:, None], valid_rows, valid_tokens, context_lens
    )


def _grouped_attention(q, k, v, mask, scale: float) -> torch.Tensor:
    """q [S, Lq, H, D], k/v [S, Lk, Hkv, D], mask [S, 1, G*Lq, Lk] -> [S, Lq, H, D]."""
    s, lq, h, d = q.shape
    hkv = k.shape[2]
    g = h // hkv
    qg = q.view(s, lq, hkv, g, d).permute(0, 2, 3, 1, 4).reshape(s, hkv, g * lq, d)
    out = F.scaled_dot_product_attention(
        qg, k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, scale=scale
    )
    return out.view(s, hkv, g, lq, d).permute(0, 3, 1, 2, 4).reshape(s, lq, h, d)


class PagedAttention:
    """kv_cache: [num_layers, 2, num_blocks, block_size, Hkv, D] (see kv_cache.py).

    ``decode_kernel``: read the decode group's K/V straight from the blocks with the
    compiled CPU kernel (cpu_paged_attention.py) instead of gathering them first."""

    def __init__(
        self,
        metadata: PagedAttentionMetadata,
        kv_cache: torch.Tensor,
        decode_kernel: bool = False,
    ) -> None:
        self.metadata = metadata
        self.kv_cache = kv_cache
        self.decode_kernel = decode_kernel
        # Gather buffers, one K and one V per group, reused by every layer of this
        # forward: fresh multi-MB allocations per layer cost page faults on CPU.
        self._workspaces: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._masks: dict[int, torch.Tensor] = {}

    def attend(self, layer_idx, q, k, v, scale: float) -> torch.Tensor:
        k_blocks, v_blocks = self.kv_cache[layer_idx]  # [num_blocks, block_size, Hkv, D]
        num_kv_heads, head_dim = k_blocks.shape[-2:]
        k_blocks.view(-1, num_kv_heads, head_dim).index_copy_(0, self.metadata.slot_mapping, k)
        v_blocks.view(-1, num_kv_heads, head_dim).index_copy_(0, self.metadata.slot_mapping, v)
        out = torch.empty_like(q)
        k_rows = k_blocks.view(k_blocks.shape[0], -1)
        v_rows = v_blocks.view(v_blocks.shape[0], -1)
        for index, group in enumerate(self.metadata.groups):
            # Gather whole blocks as rows of a 2-D view: index_select then copies
            # contiguous runs at memcpy speed (several times faster than tensor[index]).
            num_seqs, num_q = group.query_index.shape
            if num_q == 1 and self.decode_kernel:
                group_out = cpu_paged_attention.decode_attention(
                    q.index_select(0, group.valid_tokens),
                    k_blocks,
                    v_blocks,
                    group.block_tables,
                    group.context_lens,
                    scale,
                    self.metadata.sliding_window,
                )
                out.index_copy_(0, group.valid_tokens, group_out)
                continue
            blocks = group.block_tables.flatten()
            if index not in self._workspaces:
                shape = (len(blocks), k_rows.shape[1])
                self._workspaces[index] = (k_rows.new_empty(shape), v_rows.new_empty(shape))
            k_buffer, v_buffer = self._workspaces[index]
            kv_shape = (num_seqs, -1, num_kv_heads, head_dim)
            keys = torch.index_select(k_rows, 0, blocks, out=k_buffer).view(kv_shape)
            values = torch.index_select(v_rows, 0, blocks, out=v_buffer).view(kv_shape)
            queries = q.index_select(0, group.query_index.flatten()).view(
                num_seqs, num_q, *q.shape[1:]
            )
            if index not in self._masks:
                # The query heads sharing a KV head are stacked on the query axis, so
                # the mask repeats once per head of the group (built once per forward).
                self._masks[index] = group.mask.repeat(1, 1, q.shape[1] // num_kv_heads, 1)
            group_out = _grouped_attention(
                queries, keys, values, self._masks[index], scale
            ).flatten(0, 1)
            if group.valid_rows is not None:
                group_out = group_out.index_select(0, group.valid_rows)
            out.index_copy_(0, group.valid_tokens, group_out)
        for group in self.metadata.fresh_prompts:
            num_seqs, length = group.token_index.shape
            tokens = group.token_index.flatten()
            group_out = causal_attention(
                q.index_select(0, tokens),
                k.index_select(0, tokens),
                v.index_select(0, tokens),
                num_seqs,
                length,
                scale,
            )
            out.index_copy_(0, tokens, group_out)
        return out


def causal_attention(q, k, v, num_seqs: int, length: int, scale: float, mask=None):
    """num_seqs sequences of ``length`` tokens, flattened: q [n*L, H, D], k/v
    [n*L, Hkv, D] -> [n*L, H, D]; causal unless an explicit ``mask`` is given."""
    h, hkv = q.shape[1], k.shape[1]
    out = F.scaled_dot_product_attention(
        q.view(num_seqs, length, h, -1).transpose(1, 2),
        k.view(num_seqs, length, hkv, -1).transpose(1, 2),
        v.view(num_seqs, length, hkv, -1).transpose(1, 2),
        attn_mask=mask,
        is_causal=mask is None,
        scale=scale,
        enable_gqa=h != hkv,
    )
    return out.transpose(1, 2).reshape(num_seqs * length, h, -1)


class CausalAttention:
    """No cache: B sequences of L tokens each, flattened to B*L tokens."""

    def __init__(self, batch_size: int, seq_len: int, sliding_window: int | None = None) -> None:
        self.batch_size = batch_size
        self.seq_len = seq_len
        self.mask = None
        if sliding_window is not None and seq_len > sliding_window:
            pos = torch.arange(seq_len)
            self.mask = (pos[None, :] <= pos[:, None]) & (
                pos[None, :] > pos[:, None] - sliding_window
            )

    def attend(self, layer_idx, q, k, v, scale: float) -> torch.Tensor:
        mask = None if self.mask is None else self.mask.to(q.device)
        return causal_attention(q, k, v, self.batch_size, self.seq_len, scale, mask)
