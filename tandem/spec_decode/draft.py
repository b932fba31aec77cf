"""The draft-model proposer: a smaller model with the target's tokenizer proposes k
tokens autoregressively, from the same sampling settings as the target.

Its K/V live in a paged cache of its own (a second runner, which the worker builds:
runner/proposing.py's MakeDraftRunner) that uses the target's
block ids: the target's block table for this step already covers every position the
draft writes (up to the last draft token), so the draft needs no allocation of its own.
Per request it remembers how many leading tokens have valid draft K/V; each proposal
first runs the tokens it has not seen (the whole prompt the first time, then the last
accepted tokens), then one token per further guess. After verification that count is
cut back to what the target accepted (``rollback``).
"""

from __future__ import annotations

import torch

from tandem.errors import InvalidParameterError
from tandem.models.loader import load_model
from tandem.runner.host_to_device import to_device
from tandem.runner.model_runner import SequenceChunk
from tandem.runner.proposing import MakeDraftRunner
from tandem.runner.sampler import argmax_rows, draw, processed_logits, sampling_probs


class DraftProposer:
    def __init__(self, folder: str, target, make_runner: MakeDraftRunner) -> None:
        loaded = load_model(folder, dtype=target.dtype, device=target.device)
        if loaded.config.vocab_size != target.config.vocab_size:
            raise InvalidParameterError(
                "speculative_config.model",
                f"the draft's vocabulary ({loaded.config.vocab_size}) differs from the "
                f"target's ({target.config.vocab_size}); they must share a tokenizer",
            )
        self.runner = make_runner(loaded)
        self.num_valid: dict[str, int] = {}  # request -> leading tokens with draft K/V

    @torch.inference_mode()
    def propose(self, items, make_row, shared_generator):
        """One forward for every item's first guess (``_first_logits``), then one per
        further guess over the items still short of theirs (``_next_logits``)."""
        drafts: list[list[int]] = [[] for _ in items]
        probs: list[list[torch.Tensor]] = [[] for _ in items]
        logits, active = self._first_logits(items)
        while active:
            rows = [make_row(items[i].request, drafts[i]) for i in active]
            processed = processed_logits(logits.float(), rows)
            tokens = argmax_rows(processed)
            q = None
            if not all(row.params.greedy for row in rows):
                q = sampling_probs(processed, rows)
                sampled = draw(q, rows, shared_generator)
                greedy = to_device([r.params.greedy for r in rows], tokens.device)
                tokens = torch.where(greedy, tokens, sampled)
            for slot, (i, token) in enumerate(zip(active, tokens.tolist(), strict=True)):
                drafts[i].append(token)
                if q is not None and not rows[slot].params.greedy:
                    probs[i].append(q[slot])
            active = [i for i in active if len(drafts[i]) < items[i].num_spec_tokens]
            if active:
                logits = self._next_logits(items, active, drafts)
        self._fed(items, drafts)
        return [
            (guess, torch.stack(p) if p else None) for guess, p in zip(drafts, probs, strict=True)
        ]

    def _first_logits(self, items) -> tuple[torch.Tensor, list[int]]:
        """Logits for each item's first guess (the tokens the draft has not seen, up to
        the last), and which items they are (here: all)."""
        chunks = []
        for item in items:
            request = item.request
            start = self._first_unseen(request)
            chunks.append(SequenceChunk(request.all_token_ids[start:], start, item.block_table))
        return self._forward(chunks), list(range(len(items)))

    def _next_logits(self, items, active: list[int], drafts: list[list[int]]) -> torch.Tensor:
        """Logits for the next guess of each active item, from its last guess."""
        return self._forward(
            [
                SequenceChunk(
                    [drafts[i][-1]],
                    items[i].request.num_tokens + len(drafts[i]) - 1,
                    items[i].block_table,
                )
                for i in active
            ]
        )

    def _fed(self, items, drafts: list[list[int]]) -> None:
        """Fed: every token up to the last, then all guesses but the last."""
        for item, guess in zip(items, drafts, strict=True):
            self.num_valid[item.request.request_id] = item.request.num_tokens + len(guess) - 1

    def _first_unseen(self, request) -> int:
        """The first of the request's tokens the draft has no K/V for."""
        return min(self.num_valid.get(request.request_id, 0), request.num_tokens - 1)

    def _forward(self, chunks: list[SequenceChunk]) -> torch.Tensor:
        return self.runner.forward(chunks)

    def rollback(self, request_id: str, num_valid_tokens: int) -> None:
        """The target kept ``num_valid_tokens`` tokens of K/V: draft K/V past them is stale."""
        if request_id in self.num_valid:
            self.num_valid[request_id] = min(self.num_valid[request_id], num_valid_tokens)

    def forget(self, request_id: str) -> None:
        self.num_valid.pop(request_id, None)
