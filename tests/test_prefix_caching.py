"""Automatic prefix caching: the block pool's bookkeeping with fake tokens, then the
engine's outputs with the cache on against transformers (greedy), scenario by scenario,
with the pool checked for leaks and consistency after each."""

from __future__ import annotations

import random

import pytest

from tandem import LLM, SamplingParams
from tandem.config import SchedulerConfig
from tandem.engine.block_pool import BlockPool, block_digest
from tandem.engine.kv_manager import KVCacheManager
from tandem.engine.request import Request
from tandem.engine.scheduler import Scheduler
from tests.fake_scheduling import Token, make_scheduler, run_to_completion
from tests.hf_models import VOCAB_SIZE, reference_greedy

# -- the pool and the manager, no model ------------------------------------------------


def test_digests_chain_over_parent_tokens_and_salt():
    first = block_digest(None, [1, 2, 3, 4], None)
    assert first == block_digest(None, [1, 2, 3, 4], None)
    assert first != block_digest(None, [1, 2, 3, 5], None)
    assert first != block_digest(None, [1, 2, 3, 4], "tenant-a")
    assert block_digest(first, [5, 6], None) != block_digest(None, [5, 6], None)


def test_a_hit_is_confirmed_against_the_stored_tokens_and_parent():
    pool = BlockPool(4)
    digest = block_digest(None, [1, 2], None)
    pool.cache(0, digest, None, [1, 2])
    assert pool.lookup(digest, None, [1, 2]) == 0
    # The same digest with other tokens or another parent (a forged collision) misses.
    assert pool.lookup(digest, None, [1, 3]) is None
    assert pool.lookup(digest, b"other parent", [1, 2]) is None


def request(request_id, tokens, salt=None, max_tokens=2):
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return Request(request_id, tokens, params, cache_salt=salt)


def test_a_later_request_starts_after_the_shared_full_blocks():
    scheduler, kv = make_scheduler(num_blocks=16)
    run_to_completion(scheduler, request("a", list(range(10))))
    b = request("b", [*range(8), 99, 98, 97])
    scheduler.add_request(b)
    out = scheduler.schedule()
    assert out.scheduled[0].num_computed_tokens == 8  # two full blocks of 4 reused
    assert out.scheduled[0].num_new_tokens == 3  # [99, 98, 97]
    assert out.new_requests[0].prompt_token_ids[8:] == [99, 98, 97]
    assert b.num_cached_tokens == 8
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (10 + 11, 8)
    scheduler.update(out, {"b": [Token(7)]})
    run_to_completion(scheduler)
    kv.check_no_leaks()


@pytest.mark.parametrize("length, cached", [(8, 4), (9, 8), (12, 8), (13, 12)])
def test_a_full_prompt_hit_still_computes_its_last_token(length, cached):
    scheduler, kv = make_scheduler(num_blocks=16)
    run_to_completion(scheduler, request("a", list(range(length))))
    again = request("b", list(range(length)))
    run_to_completion(scheduler, again)
    assert again.num_cached_tokens == cached
    kv.check_no_leaks()


def test_running_requests_share_blocks_by_reference():
    scheduler, kv = make_scheduler(num_blocks=16)
    a = request("a", list(range(9)), max_tokens=4)
    scheduler.add_request(a)
    scheduler.update(scheduler.schedule(), {"a": [Token(7)]})
    b = request("b", list(range(9)))
    scheduler.add_request(b)
    scheduler.update(scheduler.schedule(), {"a": [Token(7)], "b": [Token(7)]})
    table_a, table_b = kv.block_table("a"), kv.block_table("b")
    assert table_a[:2] == table_b[:2] and table_a[2] != table_b[2]
    assert [kv.pool.ref_counts[block] for block in table_a[:2]] == [2, 2]
    run_to_completion(scheduler)
    kv.check_no_leaks()


def test_eviction_is_lru_and_takes_a_sequence_tail_first():
    scheduler, kv = make_scheduler(num_blocks=6)
    run_to_completion(scheduler, request("old", list(range(100, 112))))  # 3 blocks cached
    run_to_completion(scheduler, request("new", list(range(200, 212))))  # 3 more
    # 4 fresh blocks needed: old's three go first (tail, middle, head), then new's tail.
    run_to_completion(scheduler, request("x", list(range(300, 314))))
    assert kv.find_cached_prefix(request("p", list(range(100, 113)))) == []
    assert len(kv.find_cached_prefix(request("q", list(range(200, 213))))) == 2
    assert kv.pool.num_evictions >= 4
    kv.check_no_leaks()


def test_different_salts_never_share():
    scheduler, kv = make_scheduler(num_blocks=16)
    run_to_completion(scheduler, request("a", list(range(12)), salt="tenant-a"))
    b = request("b", list(range(12)), salt="tenant-b")
    c = request("c", list(range(12)), salt="tenant-a")
    run_to_completion(scheduler, b, c)
    assert (b.num_cached_tokens, c.num_cached_tokens) == (0, 8)
    kv.check_no_leaks()


def test_turned_off_nothing_is_reused():
    kv = KVCacheManager(16, 4, enable_prefix_caching=False)
    scheduler = Scheduler(SchedulerConfig(), kv, 1000)
    run_to_completion(scheduler, request("a", list(range(12))))
    again = request("b", list(range(12)))
    run_to_completion(scheduler, again)
    assert again.num_cached_tokens == 0 and not kv.pool.cached
    kv.check_no_leaks()


# -- the engine against transformers ------------------------------------------------------

MAX_NEW = 8


@pytest.fixture(scope="module")
def llama(model_dirs):
    return model_dirs("llama")


def tokens(rng, n):
    return [rng.randrange(2, VOCAB_SIZE) for _ in range(n)]


def generate(llm, prompts, salts=None):
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    salts = salts or [None] * len(prompts)
    inputs = [
        {"prompt_token_ids": p, **({"cache_salt": s} if s else {})}
        for p, s in zip(prompts, salts, strict=True)
    ]
    outputs = llm.generate(inputs, params, use_tqdm=False)
    llm.engine.kv_manager.check_no_leaks()
    return outputs


def check(llm, hf_model, prompts, salts=None):
    outputs = generate(llm, prompts, salts)
    assert [o.outputs[0].token_ids for o in outputs] == reference_greedy(hf_model, prompts, MAX_NEW)
    return [o.num_cached_tokens for o in outputs]


def test_shared_prefix_admitted_in_the_same_step(llama):
    folder, hf_model = llama
    rng = random.Random(1)
    system = tokens(rng, 37)
    prompts = [system + tokens(rng, n) for n in (5, 9, 16)]
    llm = LLM(str(folder), block_size=8)
    # All three start in one step: none of them is cached yet, all compute the prefix.
    assert check(llm, hf_model, prompts) == [0, 0, 0]
    # Later arrivals reuse it: 37 shared tokens = four full blocks of 8.
    later = [system + tokens(rng, 3), system[:20] + tokens(rng, 4)]
    assert check(llm, hf_model, later) == [32, 16]


@pytest.mark.parametrize("length", [32, 33])  # a multiple of the block size, and not
def test_an_exact_repeat(llama, length):
    folder, hf_model = llama
    prompt = tokens(random.Random(length), length)
    llm = LLM(str(folder), block_size=8)
    assert check(llm, hf_model, [prompt]) == [0]
    assert check(llm, hf_model, [prompt]) == [24 if length == 32 else 32]


def test_shared_prefix_under_preemption(llama):
    folder, hf_model = llama
    rng = random.Random(2)
    system = tokens(rng, 24)
    prompts = [system + tokens(rng, n) for n in (6, 14, 3, 11, 8, 2)]
    # 14 blocks of 4 cannot hold six sequences of ~40 tokens: preemption must happen.
    llm = LLM(str(folder), block_size=4, num_blocks=14, max_num_batched_tokens=32)
    check(llm, hf_model, [system + tokens(rng, 4)])  # the prefix is cached first
    outputs = generate(llm, prompts)
    assert [o.outputs[0].token_ids for o in outputs] == reference_greedy(hf_model, prompts, MAX_NEW)
    assert sum(o.metrics.num_preemptions for o in outputs) > 0
    assert outputs[0].num_cached_tokens == 24


def test_eviction_while_others_hold_shared_blocks(llama):
    folder, hf_model = llama
    rng = random.Random(3)
    shared = tokens(rng, 16)
    # Unrelated long prompts churn the pool (evicting free cached blocks) while the
    # requests on the shared prefix still run and hold its blocks.
    prompts = [shared + tokens(rng, 5), tokens(rng, 40), shared + tokens(rng, 7), tokens(rng, 38)]
    llm = LLM(str(folder), block_size=4, num_blocks=30, max_num_batched_tokens=24)
    check(llm, hf_model, [shared + tokens(rng, 2)])
    assert check(llm, hf_model, prompts)[0] == 16
    assert llm.engine.kv_manager.pool.num_evictions > 0
    assert check(llm, hf_model, [tokens(rng, 9)]) == [0]


def test_salted_requests_do_not_share(llama):
    folder, hf_model = llama
    prompt = tokens(random.Random(4), 30)
    llm = LLM(str(folder), block_size=8)
    assert check(llm, hf_model, [prompt], ["a"]) == [0]
    assert check(llm, hf_model, [prompt, prompt], ["b", None]) == [0, 0]
    assert check(llm, hf_model, [prompt], ["a"]) == [24]


def test_off_gives_the_same_outputs_and_no_hits(llama):
    folder, hf_model = llama
    rng = random.Random(5)
    system = tokens(rng, 20)
    llm = LLM(str(folder), block_size=8, enable_prefix_caching=False)
    check(llm, hf_model, [system + tokens(rng, 3)])
    assert check(llm, hf_model, [system + tokens(rng, 4)]) == [0]
