"""The CPU backend: the torch backend with the compiled kernels (tandem.kernels.cpu)
for the two things every decode step does in every layer.

- The K/V write is one call over strided rows (q/k/v are views of the fused qkv
  projection) instead of two index_copy_ over copies.
- Decodes read each K/V row once, straight from the blocks through the block table,
  instead of gathering padded contexts first; when the decodes are a contiguous run of
  the flat batch (they are scheduled first, so usually) the kernel reads q and writes
  the output in place.

- Speculative verification (the last token and its drafts, in the decodes group) runs
  as rows of the same kernel, each with its own causal length, the sequence's K/V read
  once for all of them: a decode's row is computed exactly as without drafts.

Prompt chunks still go through the torch backend's gather + SDPA: they are compute-
bound and SDPA's batched matmuls are the fast path for them.

A step of decodes only also offers ``decode_layer``: whole Llama layers in one call,
and ``decode_stack``: all of them in one (runner/fused_decode.py;
TANDEM_FUSED_DECODE=layers keeps one call a layer, 0 turns both off, for comparisons).
"""

from __future__ import annotations

import os

import torch

from tandem.kernels import cpu as cpu_kernels
from tandem.runner.attention.metadata import AttentionGroup
from tandem.runner.attention.torch_sdpa import TorchPagedAttention
from tandem.runner.fused_decode import FusedDecode

# Verifications of up to this many tokens read the blocks directly (beyond: SDPA).
ROWS_MAX = 16


class CpuPagedAttention(TorchPagedAttention):
    def __init__(self, metadata, kv_cache: torch.Tensor) -> None:
        super().__init__(metadata, kv_cache)
        self._rows: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        # A decode-only step (drafts verified included): whole layers in one compiled
        # call (runner/fused_decode.py).
        # TANDEM_FUSED_DECODE: 0 off, "layers" one call a layer, else the whole stack
        # where it applies.
        mode = os.environ.get("TANDEM_FUSED_DECODE", "1")
        if FusedDecode.applies(self, ROWS_MAX) and mode != "0":
            group = metadata.groups[0]
            rows = None if group.query_index.shape[1] == 1 else self._query_rows(0, group)
            self.decode_layer = FusedDecode(self, rows)
            if mode != "layers":
                self.decode_stack = self.decode_layer.stack

    def write_kv(self, k, v, k_blocks, v_blocks) -> None:
        cpu_kernels.load().write_kv(k, v, k_blocks, v_blocks, self.metadata.slot_mapping)

    def attend_group(
        self, index: int, group: AttentionGroup, q, k_blocks, v_blocks, out, scale: float,
        window: int | None, sinks=None,
    ) -> None:  # fmt: skip
        num_queries = group.query_index.shape[1]
        if not group.decodes or num_queries > ROWS_MAX:
            return super().attend_group(
                index, group, q, k_blocks, v_blocks, out, scale, window, sinks
            )
        if num_queries > 1:
            row_lens, row_starts = self._query_rows(index, group)
            group_out = cpu_kernels.paged_attention_rows(
                q.index_select(0, group.valid_tokens), k_blocks, v_blocks, group.block_tables,
                row_lens, row_starts, scale, window, sinks,
            )  # fmt: skip
            out.index_copy_(0, group.valid_tokens, group_out)
            return None
        first = group.contiguous_from
        if first is not None:
            rows = slice(first, first + len(group.context_lens))
            cpu_kernels.decode_attention(
                q[rows], k_blocks, v_blocks, group.block_tables, group.context_lens, scale,
                window, out=out[rows], sinks=sinks,
            )  # fmt: skip
            return None
        group_out = cpu_kernels.decode_attention(
            q.index_select(0, group.valid_tokens), k_blocks, v_blocks, group.block_tables,
            group.context_lens, scale, window, sinks=sinks,
        )  # fmt: skip
        out.index_copy_(0, group.valid_tokens, group_out)
        return None

    def _query_rows(self, index: int, group: AttentionGroup) -> tuple[torch.Tensor, torch.Tensor]:
        if index not in self._rows:
            self._rows[index] = _query_rows(group)
        return self._rows[index]


def _query_rows(group: AttentionGroup) -> tuple[torch.Tensor, torch.Tensor]:
    """Per real query row (in ``valid_tokens`` order, which runs sequence by sequence):
    the context it attends to (its position + 1), and where each sequence's rows start."""
    num_seqs, num_queries = group.query_index.shape
    rows = group.valid_rows
    if rows is None:
        rows = torch.arange(num_seqs * num_queries, device=group.block_tables.device)
    seq = torch.div(rows, num_queries, rounding_mode="floor")
    row_lens = group.num_computed.index_select(0, seq) + rows % num_queries + 1
    counts = torch.bincount(seq, minlength=num_seqs)
    row_starts = torch.zeros(num_seqs + 1, dtype=torch.long, device=rows.device)
    torch.cumsum(counts, 0, out=row_starts[1:])
    return row_lens.contiguous(), row_starts


def supported(device: torch.device, dtype: torch.dtype) -> bool:
    return cpu_kernels.available(device, dtype)
