"""The EAGLE proposer (method "eagle"): a trained draft head (eagle_head.py) guesses
from the target's own hidden states.

The features come out of the target's forward passes, not a second one: the runner
hands every step's final hidden states to ``observe`` (prompt chunks, decodes, and the
rows of a verification), and ``rollback`` drops those of rejected guesses. When a
request speculates, the head first reads the features it has not read yet (positions
``num_valid[r]`` to n - 2, each with the token after it: the whole prompt the first
time, then the last accepted tokens), and that last row's prediction gives the first
guess; each further guess feeds the previous prediction and guess back in.

The head's K/V live in a paged cache of one layer addressed by the target's block ids
(as the draft model's do, draft.py). Positions the target never computed for this
request (a prefix-cache hit) keep the head K/V the cached blocks were written with,
or nothing useful: that can lower acceptance, never change an output.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch

from tandem.models.loader import LoadedModel
from tandem.models.quantized import quantize_linear_layers
from tandem.runner.host_to_device import to_device
from tandem.runner.model_runner import SequenceChunk
from tandem.runner.proposing import MakeDraftRunner
from tandem.spec_decode.draft import DraftProposer
from tandem.spec_decode.eagle_head import load_head

# Features kept per request while it does not speculate (the head catches up on at
# most this many positions when it starts again).
MAX_PENDING = 1024


@dataclass
class PendingFeatures:
    """A request's target features the head has not read: positions start, start + 1,
    ... in pieces, as the steps produced them."""

    start: int
    pieces: list[torch.Tensor] = field(default_factory=list)

    @property
    def end(self) -> int:
        return self.start + sum(len(p) for p in self.pieces)

    def cut(self, position: int) -> None:
        """Forget positions from ``position`` on."""
        while self.pieces and self.end > position:
            last = self.pieces.pop()
            keep = position - self.end  # of the rows of the piece just taken off
            if keep > 0:
                self.pieces.append(last[:keep])
                break

    def rows(self, first: int, end: int) -> torch.Tensor:
        """Positions [first, end) (all held)."""
        joined = self.pieces[0] if len(self.pieces) == 1 else torch.cat(self.pieces)
        return joined[first - self.start : end - self.start]


class EagleProposer(DraftProposer):
    def __init__(self, folder: str, target: LoadedModel, make_runner: MakeDraftRunner, tp=None):
        """``tp``: the target is a tensor-parallel rank's shard; the head is whole on
        every rank (the runner aligns the ranks' drafts to rank 0's)."""
        full = target.shard.full if target.shard is not None else target.config
        head = load_head(folder, target.model, full, tp)
        if target.device.type == "cpu":  # int8 weights: a draft step reads a quarter
            quantize_linear_layers(head, "q8_0", target.device)
        loaded = LoadedModel(folder, head.config, head, None, torch.float32, target.device)
        self.runner = make_runner(loaded)
        self.head = head
        self.vocab_size = target.config.vocab_size
        self.num_valid: dict[str, int] = {}  # leading positions whose head K/V are exact
        self.pending: dict[str, PendingFeatures] = {}
        self._predicted: dict[int, torch.Tensor] = {}  # item -> the head's last prediction

    def observe(self, chunks: list[tuple[str, SequenceChunk]], hidden: torch.Tensor) -> None:
        """The target's final hidden states of a step, row by row of its chunks."""
        row = 0
        for request_id, chunk in chunks:
            count, position = len(chunk.token_ids), chunk.num_computed_tokens
            features = hidden[row : row + count].to(torch.float32, copy=True)
            row += count
            pending = self.pending.get(request_id)
            if pending is None or not pending.start <= position <= pending.end:
                pending = self.pending[request_id] = PendingFeatures(position)  # a gap
            pending.cut(position)
            pending.pieces.append(features)
            if pending.end - pending.start > 2 * MAX_PENDING:
                first = pending.end - MAX_PENDING
                self.pending[request_id] = PendingFeatures(
                    first, [pending.rows(first, pending.end).clone()]
                )

    def _first_logits(self, items):
        chunks, features, active = [], [], []
        for index, item in enumerate(items):
            request = item.request
            last = request.num_tokens - 1  # features are needed up to the one before it
            pending = self.pending.get(request.request_id)
            if pending is None or pending.end < last or not pending.pieces:
                continue  # the target has not computed them (yet): no guess this step
            first = max(pending.start, min(self.num_valid.get(request.request_id, 0), last - 1))
            tokens = request.all_token_ids[first + 1 : last + 1]
            chunks.append(SequenceChunk(tokens, first, item.block_table))
            features.append(pending.rows(first, last))
            active.append(index)
        if not active:
            return None, []
        predicted = self._run(chunks, features)
        ends = list(itertools.accumulate(len(c.token_ids) for c in chunks))
        return self._predict(active, predicted[to_device(ends, predicted.device) - 1]), active

    def _next_logits(self, items, active, drafts):
        chunks = [
            SequenceChunk(
                [drafts[i][-1]],
                items[i].request.num_tokens - 2 + len(drafts[i]),
                items[i].block_table,
            )
            for i in active
        ]
        predicted = self._run(chunks, [self._predicted[i][None] for i in active])
        return self._predict(active, predicted)

    def _run(self, chunks, features: list[torch.Tensor]) -> torch.Tensor:
        self.head.features = torch.cat(features)
        return self.runner.hidden_states(chunks)

    def _predict(self, active: list[int], predicted: torch.Tensor) -> torch.Tensor:
        """Remember each item's prediction; its logits over the whole vocabulary (-inf
        outside the draft vocabulary)."""
        self._predicted = {i: predicted[slot] for slot, i in enumerate(active)}
        draft_logits = self.head.compute_logits(predicted)
        logits = draft_logits.new_full((len(active), self.vocab_size), float("-inf"))
        logits[:, self.head.draft_vocab] = draft_logits
        return logits

    def _fed(self, items, drafts) -> None:
        """The head read the exact features up to the last token's: they are used up."""
        self._predicted = {}
        for item, guess in zip(items, drafts, strict=True):
            if guess:
                request_id, last = item.request.request_id, item.request.num_tokens - 1
                self.num_valid[request_id] = last
                self.pending[request_id] = PendingFeatures(last)

    def rollback(self, request_id: str, num_valid_tokens: int) -> None:
        super().rollback(request_id, num_valid_tokens)
        pending = self.pending.get(request_id)
        if pending is not None:
            pending.cut(num_valid_tokens)

    def forget(self, request_id: str) -> None:
        super().forget(request_id)
        self.pending.pop(request_id, None)
