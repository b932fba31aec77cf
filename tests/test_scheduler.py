"""Scheduler and block manager with fake token ids and a fake runner (no model)."""

from __future__ import annotations

import zlib

import pytest

from tandem.engine.kv_manager import KVCacheManager
from tandem.engine.request import Request, RequestStatus
from tandem.sampling import SamplingParams
from tests.fake_scheduling import make_scheduler, run_step


def add(scheduler, request_id, prompt_len, max_tokens=5):
    # Distinct tokens per request, so that no prompt is a prefix-cache hit on another.
    start = zlib.crc32(request_id.encode()) * 10_000
    request = Request(
        request_id,
        list(range(start, start + prompt_len)),
        SamplingParams(temperature=0, max_tokens=max_tokens),
    )
    scheduler.add_request(request)
    return request


def shares(out):
    return {s.request_id: s.num_new_tokens for s in out.scheduled}


def test_admission_fills_the_budget_with_chunks():
    scheduler, _ = make_scheduler(max_num_batched_tokens=10)
    for name in "abc":
        add(scheduler, name, 4)
    out = run_step(scheduler)
    assert shares(out) == {"a": 4, "b": 4, "c": 2}  # c's prompt is chunked
    assert [s.samples for s in out.scheduled] == [True, True, False]
    out = run_step(scheduler)
    # Decodes first (a, b: one token each), then c's remaining prompt.
    assert list(shares(out).items()) == [("a", 1), ("b", 1), ("c", 2)]


def test_decodes_come_before_running_prompt_chunks():
    scheduler, _ = make_scheduler(max_num_batched_tokens=8)
    add(scheduler, "long", 20)
    run_step(scheduler)  # long: 8 of 20
    add(scheduler, "short", 2)
    out = run_step(scheduler)
    assert shares(out) == {"long": 8}  # short waits: no budget left
    run_step(scheduler)  # long: 4 more (done, samples), short admitted with 2 tokens
    out = run_step(scheduler)
    # Both decode now; short's decode is not starved by anything.
    assert shares(out) == {"long": 1, "short": 1}


def test_long_prefill_threshold_caps_each_chunk():
    scheduler, _ = make_scheduler(max_num_batched_tokens=100, long_prefill_token_threshold=6)
    add(scheduler, "a", 20)
    add(scheduler, "b", 3)
    assert shares(run_step(scheduler)) == {"a": 6, "b": 3}


def test_max_num_seqs_limits_running_requests():
    scheduler, _ = make_scheduler(max_num_seqs=2)
    for name in "abc":
        add(scheduler, name, 3)
    assert set(shares(run_step(scheduler))) == {"a", "b"}
    assert [r.request_id for r in scheduler.waiting] == ["c"]


def test_preemption_takes_the_newest_request_and_admits_nothing():
    # 6 blocks of 4 tokens. a and b: 8-token prompts (2 blocks), 23 tokens at most (6).
    scheduler, kv = make_scheduler(num_blocks=6, block_size=4)
    a = add(scheduler, "a", 8, max_tokens=15)
    b = add(scheduler, "b", 8, max_tokens=15)
    run_step(scheduler)  # both prompts run; 4 blocks used
    add(scheduler, "c", 4)
    out = run_step(scheduler)  # a and b decode token 8 into a 3rd block each: pool full
    assert shares(out) == {"a": 1, "b": 1}  # c cannot be admitted
    for _ in range(3):  # tokens 9, 10, 11 fill the 3rd blocks
        assert not run_step(scheduler).preempted_ids
    out = run_step(scheduler)  # token 12 needs a 4th block for a: b must give way
    assert out.preempted_ids == ["b"]  # the most recently admitted
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert [r.request_id for r in scheduler.waiting] == ["b", "c"]  # b first
    assert shares(out) == {"a": 1}  # nothing admitted in a step that preempted
    assert kv.block_table("b") == []
    # b keeps its output tokens and resumes by recomputing prompt + output.
    generated = list(b.output_token_ids)
    while scheduler.has_unfinished_requests():
        run_step(scheduler)
    assert b.output_token_ids[: len(generated)] == generated
    assert len(b.timeline.preemption_times) >= 1
    assert a.status == b.status == RequestStatus.FINISHED_LENGTH
    kv.check_no_leaks()


def test_prefill_first_pauses_decodes():
    scheduler, _ = make_scheduler(max_num_batched_tokens=64, scheduling_policy="prefill-first")
    add(scheduler, "a", 4, max_tokens=10)
    run_step(scheduler)
    assert shares(run_step(scheduler)) == {"a": 1}  # decoding alone
    add(scheduler, "b", 30)
    assert shares(run_step(scheduler)) == {"b": 30}  # a's decode waits for b's prompt
    assert shares(run_step(scheduler)) == {"a": 1, "b": 1}


def test_prefill_first_runs_a_prompt_longer_than_the_budget_whole():
    scheduler, _ = make_scheduler(max_num_batched_tokens=8, scheduling_policy="prefill-first")
    add(scheduler, "a", 20)
    assert shares(run_step(scheduler)) == {"a": 20}


def test_prefill_first_decodes_when_no_prompt_can_start():
    """A waiting prompt short of blocks must not pause the decodes that would free them."""
    scheduler, kv = make_scheduler(
        num_blocks=4, block_size=4, max_num_batched_tokens=64, scheduling_policy="prefill-first"
    )
    a = add(scheduler, "a", 6, max_tokens=6)  # 2 blocks now, 3 at most
    b = add(scheduler, "b", 12, max_tokens=4)  # 3 blocks now: does not fit beside a
    assert shares(run_step(scheduler)) == {"a": 6}
    assert shares(run_step(scheduler)) == {"a": 1}  # b cannot start, so a decodes
    for _ in range(20):
        if not scheduler.has_unfinished_requests():
            break
        run_step(scheduler)
    assert a.status == b.status == RequestStatus.FINISHED_LENGTH
    kv.check_no_leaks()


def test_stop_conditions_free_blocks():
    scheduler, kv = make_scheduler()
    request = add(scheduler, "a", 5, max_tokens=3)
    while scheduler.has_unfinished_requests():
        run_step(scheduler)
    assert request.status == RequestStatus.FINISHED_LENGTH
    assert request.output_token_ids == [7, 7, 7]
    kv.check_no_leaks()


@pytest.mark.parametrize("status", [RequestStatus.WAITING, RequestStatus.RUNNING])
def test_abort_frees_blocks_in_any_state(status):
    scheduler, kv = make_scheduler(max_num_batched_tokens=4)
    request = add(scheduler, "a", 10)
    if status == RequestStatus.RUNNING:
        run_step(scheduler)
        assert kv.block_table("a")
    scheduler.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    assert request.status == RequestStatus.FINISHED_ABORTED
    assert not scheduler.has_unfinished_requests()
    assert scheduler.schedule().finished_ids == ["a"]
    kv.check_no_leaks()


def test_block_manager_tables_grow_and_release():
    kv = KVCacheManager(num_blocks=5, block_size=4)
    request = Request("a", list(range(6)), SamplingParams())
    assert kv.allocate_slots(request, 6)
    assert len(kv.block_table("a")) == 2
    request.num_computed_tokens = 6
    assert kv.allocate_slots(request, 2)  # fits in the second block
    assert len(kv.block_table("a")) == 2
    table = list(kv.block_table("a"))
    assert kv.allocate_slots(request, 7)
    assert kv.block_table("a")[:2] == table  # append-only
    assert not kv.allocate_slots(request, 100)  # too big: nothing changes
    assert len(kv.block_table("a")) == 4
    assert kv.usage == pytest.approx(0.8)
    kv.free(request)
    kv.check_no_leaks()


def test_scheduler_output_is_plain_data():
    """What the runner receives survives msgpack unchanged (the engine core can move to
    another process, a simulator can consume it): ids, counts, block diffs, params."""
    import msgspec

    from tandem.step import SchedulerOutput

    scheduler, _ = make_scheduler(num_blocks=6, block_size=4, max_num_batched_tokens=16)
    for name, length in (("a", 9), ("b", 7)):
        add(scheduler, name, length, max_tokens=8)
    seen_new = seen_preempted = 0
    while scheduler.has_unfinished_requests():
        out = run_step(scheduler)
        back = msgspec.msgpack.decode(msgspec.msgpack.encode(out), type=SchedulerOutput)
        assert back == out
        seen_new += len(out.new_requests)
        seen_preempted += len(out.preempted_ids)
    assert seen_preempted and seen_new == 2 + seen_preempted  # resumed requests come anew
