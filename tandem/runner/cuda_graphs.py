"""CUDA graphs for decode steps: a step's few hundred kernel launches replayed as one.

A decode step of a small batch is too short to hide its launches: an 8B model's step
is some 400 kernels whose launches from Python take longer than the GPU needs to read
the weights. A graph records the launches once and replays them with one call.

A graph fixes every shape and address, so each is captured for a bucket:

    batch  the step's sequences rounded up to a bucket (1, 2, 4, 8, then steps of 16)
    width  its longest block table rounded up to a power of two (entries)

and reads its inputs from static device buffers: token ids, positions, cache slots,
query starts, cached counts and block tables, one int64 buffer filled from one pinned
host buffer by one asynchronous copy before each replay. Padding rows have slot -1
(their K/V are not written) and no queries (they attend nothing), so a padded step
computes the real rows exactly as an eager step of the padded batch would.

Graphs are captured when first needed (the first step of a bucket pays some tens of
milliseconds), largest-first order does not matter as all share one memory pool. A
replay's output lives in that pool until the next replay: the runner reads it (logits)
before the next step. The host buffer is refilled only after the previous step's
tokens came back (the step's end synchronizes), so a copy in flight is never
overwritten.

Only plain decode steps replay (one new token per sequence, no speculation rows);
anything else runs eagerly. A model whose forward cannot be captured (a mixture of
experts counts its tokens on the host) is never given graphs.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from tandem.runner.attention.metadata import sliding_windows
from tandem.runner.attention.triton_paged import FlatMetadata, TritonPagedAttention

logger = logging.getLogger("tandem.runner")


def batch_buckets(max_batch: int) -> tuple[int, ...]:
    small = [b for b in (1, 2, 4, 8) if b < max_batch]
    return (*small, *range(16, max_batch + 16, 16)) if max_batch > 8 else (*small, max_batch)


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    host: torch.Tensor  # pinned int64, the inputs' layout (``_split``)
    device: torch.Tensor  # the static inputs the graph reads
    hidden: torch.Tensor  # [batch, hidden] the graph writes


class DecodeGraphs:
    def __init__(
        self,
        model: nn.Module,
        kv_cache: torch.Tensor,
        block_size: int,
        layer_windows: Sequence[int | None],
        max_batch: int,
    ) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.layer_windows = sliding_windows(layer_windows)
        self.buckets = batch_buckets(max_batch)
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: dict[tuple[int, int], _Graph] = {}

    def fits(self, token_ids: Sequence[Sequence[int]], verifies: Sequence[bool]) -> bool:
        return (
            len(token_ids) <= self.buckets[-1]
            and all(len(t) == 1 for t in token_ids)
            and not any(verifies)
        )

    def run(
        self,
        token_ids: Sequence[int],
        num_computed: Sequence[int],
        block_tables: Sequence[Sequence[int]],
    ) -> torch.Tensor:
        """One decode step of len(token_ids) sequences -> hidden states [n, hidden]
        (valid until the next replay)."""
        n = len(token_ids)
        size = self.block_size
        done = np.fromiter(num_computed, np.int64, n)
        needed = int(done.max()) // size + 1  # block-table entries of the longest
        batch = next(b for b in self.buckets if b >= n)
        width = 1 << (needed - 1).bit_length()
        entry = self.graphs.get((batch, width))
        if entry is None:
            entry = self.graphs[batch, width] = self._capture(batch, width)
        ids, positions, slots, starts, computed, tables = _split(entry.host.numpy(), batch, width)
        # One decode row per sequence, filled in a Python loop: for the few sequences
        # of a graph's step it is cheaper than write_flat_metadata's numpy (one
        # sequence: 10 against 65 us on a 2-core Zen 3; 64: 264 against 221 us).
        ids[:n] = token_ids
        positions[:n] = computed[:n] = done
        for i, (position, table) in enumerate(zip(num_computed, block_tables, strict=True)):
            slots[i] = table[position // size] * size + position % size
            used = position // size + 1
            tables[i, :used] = table[:used]
            tables[i, used:] = table[used - 1]
        starts[: n + 1] = np.arange(n + 1)
        # Padding rows: token 0 at position 0, no slot, no queries, block 0.
        ids[n:], positions[n:], computed[n:], slots[n:], tables[n:] = 0, 0, 0, -1, 0
        starts[n + 1 :] = n
        entry.device.copy_(entry.host, non_blocking=True)
        entry.graph.replay()
        return entry.hidden[:n]

    def _capture(self, batch: int, width: int) -> _Graph:
        device = self.kv_cache.device
        total = 5 * batch + 1 + batch * width
        host = torch.zeros(total, dtype=torch.long, pin_memory=True)
        _split(host.numpy(), batch, width)[2][:] = -1  # no slot written while capturing
        static = host.to(device)
        ids, positions, slots, starts, computed, tables = _split(static, batch, width)
        metadata = FlatMetadata(
            positions=positions, slot_mapping=slots, query_starts=starts, num_computed=computed,
            block_tables=tables, num_seqs=batch, max_query_len=1,
            layer_windows=self.layer_windows, num_tokens=batch,
        )  # fmt: skip
        attention = TritonPagedAttention(metadata, self.kv_cache)
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):  # compile kernels, make handles: outside the graph
            self.model(ids, positions, attention)
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            hidden = self.model(ids, positions, attention)
        logger.debug("captured a decode graph for %d sequences, %d blocks each", batch, width)
        return _Graph(graph, host, static, hidden)


def _split(buffer, batch: int, width: int):
    """ids, positions, slots, starts [batch + 1], computed, tables [batch, width]."""
    edges = np.cumsum([0, batch, batch, batch, batch + 1, batch, batch * width])
    parts = [buffer[a:b] for a, b in itertools.pairwise(edges)]
    parts[-1] = parts[-1].reshape(batch, width)
    return parts
