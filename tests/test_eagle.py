"""The EAGLE proposer's bookkeeping of the target's features: what the runner hands it
each step, what a rejected guess takes back, and what the head reads next."""

from __future__ import annotations

import torch

from tandem.runner.model_runner import SequenceChunk
from tandem.spec_decode.eagle import MAX_PENDING, EagleProposer, PendingFeatures


def rows(first: int, count: int) -> torch.Tensor:
    """Features whose value is their position."""
    return torch.arange(first, first + count, dtype=torch.float32)[:, None].repeat(1, 2)


def bookkeeper() -> EagleProposer:
    proposer = EagleProposer.__new__(EagleProposer)  # no head: observe/rollback only
    proposer.pending, proposer.num_valid = {}, {}
    return proposer


def observe(proposer, request_id, first, count):
    chunk = SequenceChunk(list(range(count)), first, [])
    proposer.observe([(request_id, chunk)], rows(first, count))


def test_pieces_join_and_cut_inside_a_piece():
    pending = PendingFeatures(5, [rows(5, 3), rows(8, 4)])
    assert pending.end == 12
    assert pending.rows(6, 10)[:, 0].tolist() == [6, 7, 8, 9]
    pending.cut(10)
    assert pending.end == 10 and len(pending.pieces) == 2
    pending.cut(7)
    assert pending.end == 7 and pending.rows(5, 7)[:, 0].tolist() == [5, 6]
    pending.cut(3)  # before its start: nothing left
    assert pending.pieces == []


def test_observe_appends_steps_and_rollback_drops_rejected_guesses():
    proposer = bookkeeper()
    observe(proposer, "r", 0, 6)  # a prompt chunk
    observe(proposer, "r", 6, 4)  # the last token and three guesses at 6..9
    proposer.rollback("r", 8)  # the target kept 8 tokens: 8 and 9 were rejected
    pending = proposer.pending["r"]
    assert (pending.start, pending.end) == (0, 8)
    observe(proposer, "r", 8, 2)  # the next verification starts where the kept ones end
    assert pending.rows(0, 10)[:, 0].tolist() == list(range(10))


def test_a_gap_restarts_and_long_idle_requests_keep_the_latest():
    proposer = bookkeeper()
    observe(proposer, "r", 0, 4)
    observe(proposer, "r", 9, 2)  # positions 4..8 never computed here (a prefix-cache hit)
    assert (proposer.pending["r"].start, proposer.pending["r"].end) == (9, 11)
    for step in range(2 * MAX_PENDING + 5):  # decoding without speculating
        observe(proposer, "r", 11 + step, 1)
    pending = proposer.pending["r"]
    assert pending.end == 11 + 2 * MAX_PENDING + 5
    assert pending.end - pending.start <= 2 * MAX_PENDING
    assert pending.rows(pending.end - 1, pending.end)[0, 0] == pending.end - 1
    proposer.forget("r")
    assert "r" not in proposer.pending
