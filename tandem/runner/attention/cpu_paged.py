"""The CPU backend: the torch backend with the compiled kernels (tandem.kernels.cpu)
for the two things every decode step does in every layer.

- The K/V write is one call over strided rows (q/k/v are views of the fused qkv
  projection) instead of two index_copy_ over copies.
- Decodes read each K/V row once, straight from the blocks through the block table,
  instead of gathering padded contexts first; when the decodes are a contiguous run of
  the flat batch (they are scheduled first, so usually) the kernel reads q and writes
  the output in place.

Prompt chunks still go through the torch backend's gather + SDPA: they are compute-
bound and SDPA's batched matmuls are the fast path for them.

A step of decodes only also offers ``decode_layer``: whole Llama layers in one call
(runner/fused_decode.py; TANDEM_FUSED_DECODE=0 turns it off, for comparisons).
"""

from __future__ import annotations

import os

import torch

from tandem.kernels import cpu as cpu_kernels
from tandem.runner.attention.metadata import AttentionGroup
from tandem.runner.attention.torch_sdpa import TorchPagedAttention
from tandem.runner.fused_decode import FusedDecode


class CpuPagedAttention(TorchPagedAttention):
    def __init__(self, metadata, kv_cache: torch.Tensor) -> None:
        super().__init__(metadata, kv_cache)
        # A decode-only step: whole layers in one compiled call (runner/fused_decode.py).
        if FusedDecode.applies(self) and os.environ.get("TANDEM_FUSED_DECODE", "1") != "0":
            self.decode_layer = FusedDecode(self)

    def write_kv(self, k, v, k_blocks, v_blocks) -> None:
        cpu_kernels.load().write_kv(k, v, k_blocks, v_blocks, self.metadata.slot_mapping)

    def attend_group(
        self, index: int, group: AttentionGroup, q, k_blocks, v_blocks, out, scale: float,
        window: int | None,
    ) -> None:  # fmt: skip
        if group.query_index.shape[1] != 1:
            return super().attend_group(index, group, q, k_blocks, v_blocks, out, scale, window)
        first = group.contiguous_from
        if first is not None:
            rows = slice(first, first + len(group.context_lens))
            cpu_kernels.decode_attention(
                q[rows], k_blocks, v_blocks, group.block_tables, group.context_lens, scale,
                window, out=out[rows],
            )  # fmt: skip
            return None
        group_out = cpu_kernels.decode_attention(
            q.index_select(0, group.valid_tokens), k_blocks, v_blocks, group.block_tables,
            group.context_lens, scale, window,
        )  # fmt: skip
        out.index_copy_(0, group.valid_tokens, group_out)
        return None


def supported(device: torch.device, dtype: torch.dtype) -> bool:
    return cpu_kernels.available(device, dtype)
