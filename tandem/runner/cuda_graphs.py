"""CUDA graphs for decode and verification steps: a step's few hundred kernel launches
replayed as one.

A decode step of a small batch is too short to hide its launches: an 8B model's step
is some 400 kernels whose launches from Python take longer than the GPU needs to read
the weights. A graph records the launches once and replays them with one call. With
speculation nearly every step is a verification step (each sequence's last token and
its draft tokens, rows attended causally after its cache): those replay too, or
speculating on a GPU would trade graph steps for eager ones twice as slow.

A graph fixes every shape and address, so each is captured for a bucket:

    batch  the step's sequences rounded up to a bucket (1, 2, 4, 8, then steps of 16)
    rows   the step's most tokens of one sequence: 1 for plain decodes, 1 + drafts
           (exactly, up to MAX_ROWS: the attention kernel's tiling follows it, so the
           graph launches what an eager step of the same rows would)
    width  its longest block table rounded up to a power of two (entries)

and reads its inputs from static device buffers of batch x rows token slots: token
ids, positions, cache slots, query starts, cached counts and block tables, one int64
buffer filled from one pinned host buffer by one asynchronous copy before each replay.
The step's tokens fill the first slots in order (as the eager flat batch lays them
out, so its rows index the graph's output alike); the remaining token slots have slot
-1 (their K/V are not written) and belong to no sequence, and padding sequences have no
queries (they attend nothing), so a padded step computes the real rows as an eager step
of the same tokens would.

Graphs are captured when first needed (the first step of a bucket pays some tens of
milliseconds), largest-first order does not matter as all share one memory pool. A
replay's output lives in that pool until the next replay: the runner reads it (logits)
before the next step. The host buffer is refilled only after the previous step's
tokens came back (the step's end synchronizes), so a copy in flight is never
overwritten.

Prompt chunks run eagerly. A model whose forward cannot be captured (a mixture of
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

from tandem.runner.attention.metadata import host_layout, sliding_windows
from tandem.runner.attention.triton_paged import FlatMetadata, TritonPagedAttention

logger = logging.getLogger("tandem.runner")


MAX_ROWS = 16  # a verification step with more tokens per sequence runs eagerly
# From this many sequences a step's inputs are laid out by numpy (metadata.host_layout),
# below it in a Python loop, cheaper than numpy's fixed costs (fill_step_inputs, best
# of 5 on a 2-vCPU Zen 4: one sequence 3.7 us against 24.5, 8: 16 against 31, 64
# decodes: 117 against 84, 64 verifications of 5 rows: 164 against 95).
NUMPY_FROM = 32


def batch_buckets(max_batch: int) -> tuple[int, ...]:
    small = [b for b in (1, 2, 4, 8) if b < max_batch]
    return (*small, *range(16, max_batch + 16, 16)) if max_batch > 8 else (*small, max_batch)


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    host: torch.Tensor  # pinned int64, the inputs' layout (``_split``)
    device: torch.Tensor  # the static inputs the graph reads
    hidden: torch.Tensor  # [batch * rows, hidden] the graph writes


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
        self.graphs: dict[tuple[int, int, int], _Graph] = {}  # by (batch, rows, width)

    def fits(self, token_ids: Sequence[Sequence[int]], verifies: Sequence[bool]) -> bool:
        """A step of decodes, each alone or with its draft tokens, of few sequences."""
        return len(token_ids) <= self.buckets[-1] and all(
            len(tokens) == 1 or (verify and len(tokens) <= MAX_ROWS)
            for tokens, verify in zip(token_ids, verifies, strict=True)
        )

    def run(
        self,
        token_ids: Sequence[Sequence[int]],
        num_computed: Sequence[int],
        block_tables: Sequence[Sequence[int]],
    ) -> torch.Tensor:
        """One step of len(token_ids) sequences (a decode's token, or a decode's and its
        drafts) -> hidden states [tokens, hidden] in the flat batch's order (valid until
        the next replay)."""
        n = len(token_ids)
        rows = max(map(len, token_ids))
        last = max(done + len(t) - 1 for done, t in zip(num_computed, token_ids, strict=True))
        needed = last // self.block_size + 1  # block-table entries of the longest
        batch = next(b for b in self.buckets if b >= n)
        width = 1 << (needed - 1).bit_length()
        entry = self.graphs.get((batch, rows, width))
        if entry is None:
            entry = self.graphs[batch, rows, width] = self._capture(batch, rows, width)
        parts = _split(entry.host.numpy(), batch, rows, width)
        tokens = fill_step_inputs(parts, token_ids, num_computed, block_tables, self.block_size)
        entry.device.copy_(entry.host, non_blocking=True)
        entry.graph.replay()
        return entry.hidden[:tokens]

    def _capture(self, batch: int, rows: int, width: int) -> _Graph:
        device = self.kv_cache.device
        host, static, ids, positions, attention = static_step(
            batch, rows, width, self.layer_windows, self.kv_cache
        )
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):  # compile kernels, make handles: outside the graph
            self.model(ids, positions, attention)
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            hidden = self.model(ids, positions, attention)
        logger.debug(
            "captured a step graph for %d sequences of up to %d tokens, %d blocks each",
            batch, rows, width,
        )  # fmt: skip
        return _Graph(graph, host, static, hidden)


def static_step(batch: int, rows: int, width: int, layer_windows, kv_cache: torch.Tensor):
    """A graph's inputs for ``batch`` sequences of up to ``rows`` tokens, tables
    ``width`` wide: the host buffer (pinned on CUDA; ``fill_step_inputs`` fills its
    ``_split`` parts), its copy on the cache's device, and the token ids, positions and
    Triton attention that read that copy -> (host, device, ids, positions, attention).
    Every slot starts at -1: nothing is written while a graph is captured."""
    device = kv_cache.device
    slots = batch * rows
    size = 3 * slots + 2 * batch + 1 + batch * width  # (``_split``'s parts)
    host = torch.zeros(size, dtype=torch.long, pin_memory=device.type == "cuda")
    _split(host.numpy(), batch, rows, width)[2][:] = -1
    static = host.to(device)
    ids, positions, slot_mapping, starts, computed, tables = _split(static, batch, rows, width)
    metadata = FlatMetadata(
        positions=positions, slot_mapping=slot_mapping, query_starts=starts,
        num_computed=computed, block_tables=tables, num_seqs=batch, max_query_len=rows,
        layer_windows=layer_windows, num_tokens=slots,
    )  # fmt: skip
    return host, static, ids, positions, TritonPagedAttention(metadata, kv_cache)


def fill_step_inputs(
    parts: Sequence[np.ndarray],
    token_ids: Sequence[Sequence[int]],
    num_computed: Sequence[int],
    block_tables: Sequence[Sequence[int]],
    block_size: int,
) -> int:
    """Write a step's inputs into a graph's host buffer (``_split``'s parts: ids,
    positions and slots [batch * rows], starts [batch + 1], computed [batch], tables
    [batch, width]) -> the step's token count T. Tokens take the first T slots in the
    flat batch's order; the rest have token 0 at position 0 and slot -1 (nothing
    written) in no sequence; padding sequences have no queries, no cache, block 0.
    Each table's entries past its last in use repeat it (never read)."""
    ids, positions, slots, starts, computed, tables = parts
    n = len(token_ids)
    if n >= NUMPY_FROM:
        layout = host_layout([len(t) for t in token_ids], num_computed, block_tables, block_size)
        token = len(layout.positions)
        ids[:token] = list(itertools.chain.from_iterable(token_ids))
        positions[:token], slots[:token] = layout.positions, layout.slots
        starts[: n + 1], computed[:n] = layout.starts, layout.num_computed
        used = layout.tables.shape[1]
        tables[:n, :used], tables[:n, used:] = layout.tables, layout.tables[:, -1:]
    else:
        token = 0
        for i, (tokens, done, table) in enumerate(
            zip(token_ids, num_computed, block_tables, strict=True)
        ):
            starts[i] = token
            computed[i] = done
            for offset, token_id in enumerate(tokens):
                position = done + offset
                ids[token] = token_id
                positions[token] = position
                slots[token] = table[position // block_size] * block_size + position % block_size
                token += 1
            used = (done + len(tokens) - 1) // block_size + 1
            tables[i, :used] = table[:used]
            tables[i, used:] = table[used - 1]
    starts[n:] = token
    ids[token:], positions[token:], slots[token:] = 0, 0, -1
    computed[n:], tables[n:] = 0, 0
    return token


def _split(buffer, batch: int, rows: int, width: int):
    """ids, positions, slots [batch * rows], starts [batch + 1], computed [batch],
    tables [batch, width]."""
    slots = batch * rows
    edges = np.cumsum([0, slots, slots, slots, batch + 1, batch, batch * width])
    parts = [buffer[a:b] for a, b in itertools.pairwise(edges)]
    parts[-1] = parts[-1].reshape(batch, width)
    return parts
