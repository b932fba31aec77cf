"""Suffix decoding's tries and drafts against brute force: substring counts, the
draft chosen by expected accepted tokens, tenants kept apart, and the global tries
bounded. (Losslessness under the engine: tests/test_spec_decode.py.)"""

from __future__ import annotations

import random

import pytest

from tandem.spec_decode import suffix
from tandem.spec_decode.suffix import SuffixProposer, SuffixTrie, best_continuation


def brute_count(sequences, path) -> int:
    n = len(path)
    return sum(seq[i : i + n] == path for seq in sequences for i in range(len(seq) - n + 1))


def test_the_trie_counts_every_substring_as_brute_force_does():
    rng = random.Random(0)
    sequences = [[rng.randrange(4) for _ in range(rng.randint(5, 40))] for _ in range(6)]
    trie = SuffixTrie(depth=5)
    for seq in sequences:
        trie.add(seq)
    for _ in range(300):
        path = [rng.randrange(4) for _ in range(rng.randint(1, 5))]
        node = trie.find(path)
        assert (node.count if node else 0) == brute_count(sequences, path)
    for seq in sequences[:3]:  # uncounting leaves the counts of the rest
        trie.add(seq, sign=-1)
    for _ in range(300):
        path = [rng.randrange(4) for _ in range(rng.randint(1, 5))]
        node = trie.find(path)
        assert (node.count if node else 0) == brute_count(sequences[3:], path)
    for seq in sequences[3:]:
        trie.add(seq, sign=-1)
    assert trie.root.children == {}


def test_a_growing_request_trie_equals_one_built_at_once():
    rng = random.Random(1)
    tokens = [rng.randrange(5) for _ in range(120)]
    grown = suffix._GrowingTrie(0)
    for start in range(0, len(tokens), 7):
        grown.extend(tokens[start : start + 7])
    whole = SuffixTrie(suffix.REQUEST_DEPTH)
    whole.add(tokens)
    for _ in range(300):
        path = [rng.randrange(5) for _ in range(rng.randint(1, 8))]
        a, b = grown.trie.find(path), whole.find(path)
        assert (a.count if a else 0) == (b.count if b else 0)


def test_the_draft_follows_the_most_frequent_continuation_while_it_is_likely():
    trie = SuffixTrie(depth=8)
    # After "1 2": "3 4 5" three times, "3 9" once.
    for tail in ([3, 4, 5], [3, 4, 5], [3, 4, 5], [3, 9]):
        trie.add([1, 2, *tail])
    draft, expected = best_continuation(trie, [7, 1, 2], limit=8)
    assert draft == [3, 4, 5]
    # chances: 4/4 for 3, then 3/4 for 4, then 3/3 for 5
    assert expected == pytest.approx(1 + 0.75 + 0.75)
    assert best_continuation(trie, [7, 1, 2], limit=2)[0] == [3, 4]
    assert best_continuation(trie, [6, 6], limit=4) == ([], 0.0)  # nothing matches


def test_a_request_drafts_from_its_own_repetition_and_free_text_drafts_nothing():
    class State:
        def __init__(self, request_id, tokens, salt=None):
            self.request_id, self.all_token_ids = request_id, tokens
            self.prompt_token_ids, self.output_token_ids = tokens, []
            self.cache_salt = salt

    class Item:
        def __init__(self, state, k):
            self.request, self.num_spec_tokens = state, k

    proposer = SuffixProposer()
    loop = [10, 11, 12, 13, 14, 15]
    repeating = State("a", [*loop, *loop, *loop, 10, 11])
    rng = random.Random(2)
    fresh = State("b", [rng.randrange(1000, 5000) for _ in range(50)])
    (draft, probs), (nothing, _) = proposer.propose(
        [Item(repeating, 6), Item(fresh, 6)], None, None
    )
    # The loop matched as far back as it repeats; drafted up to k, around the loop.
    assert draft == [12, 13, 14, 15, 10, 11] and probs is None
    assert nothing == []


def test_outputs_teach_their_tenant_only():
    class State:
        def __init__(self, request_id, prompt, output, salt):
            self.request_id, self.cache_salt = request_id, salt
            self.prompt_token_ids, self.output_token_ids = prompt, output
            self.all_token_ids = [*prompt, *output]

    class Item:
        def __init__(self, state):
            self.request, self.num_spec_tokens = state, 4

    proposer = SuffixProposer()
    answer = [50, 51, 52, 53, 54, 55, 56]
    first = State("r1", [1, 2, 3], list(answer), "alice")
    proposer.propose([Item(first)], None, None)
    proposer.forget("r1")  # alice's answer joins alice's trie
    again = [Item(State("r2", [9, 9, 50, 51, 52], [], "alice"))]
    other = [Item(State("r3", [9, 9, 50, 51, 52], [], "bob"))]
    assert proposer.propose(again, None, None)[0][0] == [53, 54, 55, 56]
    assert proposer.propose(other, None, None)[0][0] == []


def test_the_global_tries_keep_only_the_most_recent_outputs(monkeypatch):
    monkeypatch.setattr(suffix, "GLOBAL_TOKENS", 25)
    proposer = SuffixProposer()

    class State:
        def __init__(self, request_id, output):
            self.request_id, self.cache_salt = request_id, None
            self.prompt_token_ids, self.output_token_ids = [1], output
            self.all_token_ids = [1, *output]

    class Item:
        def __init__(self, state):
            self.request, self.num_spec_tokens = state, 4

    for index in range(5):
        state = State(f"r{index}", [100 * index + i for i in range(10)])
        proposer.propose([Item(state)], None, None)
        proposer.forget(state.request_id)
    assert proposer.num_global_tokens <= 25
    assert [key[1] for key in proposer.outputs] == ["r3", "r4"]
    trie = proposer.tenants[None]
    assert trie.find([0, 1]) is None and trie.find([400, 401]).count == 1
