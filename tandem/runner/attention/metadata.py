"""Attention metadata: where one forward's tokens sit in the paged cache and who attends
to what, built once per forward on the host from plain integers (no device syncs) and
shared by every layer.

A forward carries a flat batch of T tokens from S sequences, each at its own position:
whole prompts, prompt chunks that continue after cached tokens, single decode tokens.
Token t of sequence s, at position p, has its K/V written to cache slot
``block_table[s][p // block_size] * block_size + p % block_size``.

Sequences are grouped so that no group pays for another's shape:

    decodes          one query each, or a decode and its draft tokens (speculative
                     verification: ``verifying``); padded to [S, Lq] x [S, Lk]
    continuing       prompt chunks after cached tokens; padded to [S, Lq] x [S, Lk]
    fresh prompts    nothing cached: causal attention over this forward's own K/V,
                     batched by length (no gather, no padding, no mask unless a
                     sliding window is shorter than the prompt)

Sliding windows are per layer (``layer_windows``): Mistral slides in every layer,
Gemma 3 in five of every six. Each group builds the mask of each window it is asked
for once per forward, and every layer with that window shares it.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from tandem.runner.host_to_device import to_device


@dataclass
class AttentionGroup:
    """Sequences attended together, padded to [S, Lq] queries and [S, Lk] keys, with
    Lk = Nb * block_size."""

    query_index: torch.Tensor  # [S, Lq] token index into the flat batch (padding: 0)
    block_tables: torch.Tensor  # [S, Nb] blocks holding the context
    valid_rows: torch.Tensor | None  # rows of the [S*Lq] queries that are real; None: all
    valid_tokens: torch.Tensor  # flat-batch token index of each real row
    context_lens: torch.Tensor  # [S] tokens of context, the new ones included
    num_computed: torch.Tensor  # [S] of them cached before this forward
    block_size: int
    # When the group's queries are flat-batch tokens [first, first + S), one each, a
    # kernel reads and writes them in place (a slice, no gather or scatter).
    contiguous_from: int | None = None
    # The decodes group (speculative verification included): a kernel that reads the
    # blocks directly runs it, rows for decodes computed alike whatever the batch.
    decodes: bool = False
    # The same counts as plain integers (host side: reading them never syncs a device):
    # per sequence, its new tokens, the tokens cached before this forward, and the
    # flat-batch index of its first new token (its queries are rows [start, start+len)).
    host_query_lens: tuple[int, ...] = ()
    host_num_computed: tuple[int, ...] = ()
    host_query_starts: tuple[int, ...] = ()
    _masks: dict[int | None, torch.Tensor] = field(default_factory=dict, repr=False)

    def mask(self, window: int | None) -> torch.Tensor:
        """[S, 1, Lq, Lk] True where a query may attend a key (causal, within the
        context, within ``window`` positions when there is one)."""
        if window not in self._masks:
            self._masks[window] = self._mask(window)
        return self._masks[window]

    def _mask(self, window: int | None) -> torch.Tensor:
        device = self.block_tables.device
        max_q = self.query_index.shape[1]
        max_k = self.block_tables.shape[1] * self.block_size
        q_pos = self.num_computed[:, None] + torch.arange(max_q, device=device)[None, :]
        k_pos = torch.arange(max_k, device=device)
        k_real = k_pos[None, :] < self.context_lens[:, None]
        mask = (k_pos[None, None, :] <= q_pos[:, :, None]) & k_real[:, None, :]
        if window is not None:
            mask &= k_pos[None, None, :] > q_pos[:, :, None] - window
        return mask[:, None]


def sliding_causal_mask(length: int, window: int | None, device: torch.device):
    """[L, L] True where position q may attend position k (k <= q, k > q - window), or
    None when the window does not cut (plain causal attention needs no mask)."""
    if window is None or length <= window:
        return None
    pos = torch.arange(length, device=device)
    return (pos[None, :] <= pos[:, None]) & (pos[None, :] > pos[:, None] - window)


@dataclass
class FreshPromptGroup:
    """Prompts with nothing cached yet, all of one length: causal attention over this
    forward's own K/V."""

    token_index: torch.Tensor  # [S, L] flat-batch token indices
    _masks: dict[int | None, torch.Tensor | None] = field(default_factory=dict, repr=False)

    def mask(self, window: int | None) -> torch.Tensor | None:
        """The [L, L] sliding-window mask, None when plain causal attention is right."""
        if window not in self._masks:
            length = self.token_index.shape[1]
            self._masks[window] = sliding_causal_mask(length, window, self.token_index.device)
        return self._masks[window]


def sliding_windows(layer_windows: Sequence[int | None]) -> tuple[int | None, ...]:
    """Per-layer windows as metadata keeps them: empty when no layer slides."""
    return tuple(layer_windows) if any(w is not None for w in layer_windows) else ()


@dataclass(kw_only=True)
class StepMetadata:
    """What every backend's metadata holds (each backend adds who attends to what)."""

    positions: torch.Tensor  # [T] position of each token in its sequence
    slot_mapping: torch.Tensor  # [T] cache slot each new token's K/V is written to
    # Per layer: keys more than this many positions back are not attended (None: all
    # are). Empty when no layer slides (``sliding_windows``).
    layer_windows: tuple[int | None, ...] = ()
    num_tokens: int = 0

    def window(self, layer_idx: int) -> int | None:
        return self.layer_windows[layer_idx] if self.layer_windows else None


@dataclass(kw_only=True)
class PagedAttentionMetadata(StepMetadata):
    groups: list[AttentionGroup]  # decodes; prompt chunks that continue after the cache
    fresh_prompts: list[FreshPromptGroup]


@dataclass
class HostLayout:
    """Where a forward's tokens go, as int64 numpy arrays on the host (every backend's
    metadata starts from it; one Python pass over the block tables, the rest
    vectorised: 10,000 decodes take a few milliseconds)."""

    query_lens: np.ndarray  # [S]
    num_computed: np.ndarray  # [S]
    starts: np.ndarray  # [S + 1] flat-batch index of each sequence's first token
    owner: np.ndarray  # [T] each token's sequence
    positions: np.ndarray  # [T]
    tables: np.ndarray  # [S, Nb] each sequence's blocks in use, then entries never read
    slots: np.ndarray  # [T] cache slot of each token's K/V


def host_layout(
    query_lens: Sequence[int] | np.ndarray,
    num_computed: Sequence[int] | np.ndarray,
    block_tables: Sequence[Sequence[int]] | np.ndarray,
    block_size: int,
) -> HostLayout:
    """``block_tables``: each sequence's blocks, or one int64 array [S, >= the most
    blocks in use] whose every entry is a block of the cache (its rows are taken as
    they are: entries past a sequence's own are never read)."""
    num_seqs = len(query_lens)
    q_lens = _int64(query_lens, num_seqs)
    computed = _int64(num_computed, num_seqs)
    used = (computed + q_lens + block_size - 1) // block_size
    starts = np.zeros(num_seqs + 1, np.int64)
    np.cumsum(q_lens, out=starts[1:])
    num_tokens = int(starts[-1])
    if num_tokens == num_seqs:  # one token each (a decode step): fewer numpy calls
        owner, positions = np.arange(num_seqs), computed
    else:
        owner = np.repeat(np.arange(num_seqs), q_lens)
        positions = computed[owner] + np.arange(num_tokens) - starts[owner]
    width = int(used.max())
    if isinstance(block_tables, np.ndarray):
        tables = block_tables[:, :width].astype(np.int64, copy=False)
    else:
        flat = np.fromiter(
            itertools.chain.from_iterable(
                t[:n] for t, n in zip(block_tables, used.tolist(), strict=True)
            ),
            np.int64,
            int(used.sum()),
        )  # fmt: skip
        first = np.cumsum(used) - used  # each sequence's first entry in ``flat``
        tables = flat[np.minimum(np.arange(width)[None, :], used[:, None] - 1) + first[:, None]]
    slots = tables[owner, positions // block_size] * block_size + positions % block_size
    return HostLayout(q_lens, computed, starts, owner, positions, tables, slots)


def _int64(values: Sequence[int] | np.ndarray, count: int) -> np.ndarray:
    """A copy (the metadata's tensors may share its memory: the caller's array may
    change after the step)."""
    if isinstance(values, np.ndarray):
        return np.array(values, np.int64)
    return np.fromiter(values, np.int64, count)


def build_paged_metadata(
    query_lens: Sequence[int] | np.ndarray,
    num_computed: Sequence[int] | np.ndarray,
    block_tables: Sequence[Sequence[int]] | np.ndarray,
    block_size: int,
    layer_windows: Sequence[int | None] = (),
    device: torch.device | str = "cpu",
    verifying: Sequence[bool] | None = None,
) -> PagedAttentionMetadata:
    """Metadata for S sequences contributing ``query_lens[s]`` tokens each, positioned
    after ``num_computed[s]`` cached tokens, their blocks in ``block_tables[s]``;
    ``verifying[s]``: sequence s runs a decode and its draft tokens (it joins the
    decodes)."""
    device = torch.device(device)
    host = host_layout(query_lens, num_computed, block_tables, block_size)
    q_lens, computed = host.query_lens, host.num_computed
    is_decode = q_lens == 1
    if verifying is not None:
        is_decode |= np.fromiter(verifying, bool, len(q_lens))
    fresh_prompts: list[FreshPromptGroup] = []
    if is_decode.all():  # a decode step: one group of every sequence
        groups = [_group(slice(None), host, block_size, device, True)]
    else:
        is_fresh = ~is_decode & (computed == 0)
        groups = [
            _group(np.flatnonzero(members), host, block_size, device, is_decodes)
            for members, is_decodes in ((is_decode, True), (~is_decode & ~is_fresh, False))
            if members.any()
        ]
        fresh_prompts = groups_by_length(np.flatnonzero(is_fresh), host, device)
    return PagedAttentionMetadata(
        positions=_tensor(host.positions, device),
        slot_mapping=_tensor(host.slots, device),
        groups=groups,
        fresh_prompts=fresh_prompts,
        layer_windows=sliding_windows(layer_windows),
        num_tokens=len(host.positions),
    )


def groups_by_length(
    sequences: np.ndarray, host: HostLayout, device: torch.device
) -> list[FreshPromptGroup]:
    """``sequences`` (whose tokens in this forward are their whole prompt) grouped by
    length, in order of first appearance: one [S, L] token index each."""
    by_length: dict[int, list[int]] = {}
    for s in sequences.tolist():
        by_length.setdefault(int(host.query_lens[s]), []).append(s)
    return [
        FreshPromptGroup(_tensor(host.starts[members][:, None] + np.arange(length), device))
        for length, members in by_length.items()
    ]


def _tensor(values: np.ndarray, device: torch.device) -> torch.Tensor:
    return to_device(torch.from_numpy(np.ascontiguousarray(values, np.int64)), device)


def _group(
    members: np.ndarray | slice,
    host: HostLayout,
    block_size: int,
    device: torch.device,
    decodes: bool,
) -> AttentionGroup:
    """``members``: the sequences' indices, ascending (a slice: all of them)."""
    q_lens, computed = host.query_lens[members], host.num_computed[members]
    starts = host.starts[:-1][members]
    context = computed + q_lens
    max_q = int(q_lens.max())
    width = -(-int(context.max()) // block_size)
    if max_q == 1:  # one query each: its own token
        query_index, valid_tokens, real = starts[:, None], starts, None
        # (starts ascend: the queries are one run when the last is n - 1 past the first)
        contiguous = int(starts[-1] - starts[0]) == len(starts) - 1
    else:
        rows = np.arange(max_q)[None, :]
        real = rows < q_lens[:, None]
        query_index = np.where(real, starts[:, None] + rows, 0)
        valid_tokens = query_index[real]  # row by row: the flat batch's order
        real = None if real.all() else real
        contiguous = False
    first = int(valid_tokens[0])
    return AttentionGroup(
        query_index=_tensor(query_index, device),
        block_tables=_tensor(host.tables[members, :width], device),
        valid_rows=None if real is None else _tensor(np.flatnonzero(real), device),
        valid_tokens=_tensor(valid_tokens, device),
        context_lens=_tensor(context, device),
        num_computed=_tensor(computed, device),
        block_size=block_size,
        contiguous_from=first if contiguous else None,
        decodes=decodes,
        host_query_lens=tuple(q_lens.tolist()),
        host_num_computed=tuple(computed.tolist()),
        host_query_starts=tuple(starts.tolist()),
    )
