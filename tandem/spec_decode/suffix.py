"""Suffix decoding (method "suffix"; SuffixDecoding, Oliaro et al., 2024): draft tokens
from suffix tries over the request's own prompt and output and over recent requests'
outputs, with a length that follows how sure the tries are.

A ``SuffixTrie`` holds every substring of up to ``depth`` tokens of what was added,
each node counting how often its path occurs. To draft, the proposer looks up the
context's last m tokens (every m from ``MAX_MATCH`` down to 1) and walks on from the
matched node, each time to the most frequent child; the chance that the walk is still
right is the product of the children's shares (count / parent count), and the walk
stops when it falls below ``MIN_PROBABILITY``, at the trie's depth, at ``2 m`` tokens
or at the step's k. Of all those candidates, from the request's trie and from the
global one, the draft is the one with the most expected accepted tokens (the sum of
those chances). So a request repeating itself (code edits, agent loops) drafts long,
and free text drafts little or nothing.

The request's trie grows with its tokens (every new token extends the paths ending
at the previous one: O(depth) per token). A request's output joins the global trie of
its tenant (its ``cache_salt``: tenants never see each other's outputs) when it ends;
the global tries hold the most recent ``GLOBAL_TOKENS`` output tokens in all, the
oldest request's dropped first. Drafts are guesses with no distribution (as n-gram's):
the verifier keeps the output exactly the target's.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

REQUEST_DEPTH = 24  # the longest path in a request's trie: match + continuation
GLOBAL_DEPTH = 16  # ... in the global tries (they hold many requests)
MAX_MATCH = 12  # the longest context suffix looked up
MIN_PROBABILITY = 0.1  # stop drafting when the walk is this unlikely to be right
GLOBAL_TOKENS = 200_000  # output tokens kept in the global tries, all tenants together
REQUEST_WINDOW = 8192  # a request's trie covers its last tokens up to this many


class _Node:
    __slots__ = ("children", "count")

    def __init__(self) -> None:
        self.children: dict[int, _Node] = {}
        self.count = 0


class SuffixTrie:
    """Counts of every substring (up to ``depth`` tokens) of the sequences added."""

    def __init__(self, depth: int) -> None:
        self.depth = depth
        self.root = _Node()

    def add(self, tokens: Sequence[int], sign: int = 1) -> None:
        """Count (``sign`` -1: uncount) every substring of ``tokens``."""
        for start in range(len(tokens)):
            node = self.root
            for token in tokens[start : start + self.depth]:
                child = node.children.get(token)
                if child is None:
                    child = node.children[token] = _Node()
                child.count += sign
                if child.count <= 0:  # no sequence left holds it (nor anything deeper)
                    del node.children[token]
                    break
                node = child

    def find(self, tokens: Sequence[int]) -> _Node | None:
        node = self.root
        for token in tokens:
            node = node.children.get(token)
            if node is None:
                return None
        return node


class _GrowingTrie:
    """A request's trie over its tokens from ``start`` on, extended token by token:
    ``ends`` holds the nodes of the paths ending at the last token seen (with their
    depths); each new token extends them and starts one."""

    def __init__(self, start: int) -> None:
        self.trie = SuffixTrie(REQUEST_DEPTH)
        self.ends: list[tuple[_Node, int]] = []
        self.start = self.num_seen = start

    def extend(self, tokens: Sequence[int]) -> None:
        for token in tokens:
            ends = []
            for node, depth in [*self.ends, (self.trie.root, 0)]:
                child = node.children.get(token)
                if child is None:
                    child = node.children[token] = _Node()
                child.count += 1
                if depth + 1 < self.trie.depth:
                    ends.append((child, depth + 1))
            self.ends = ends
        self.num_seen += len(tokens)


def best_continuation(
    trie: SuffixTrie, context: Sequence[int], limit: int, own: bool = False
) -> tuple[list[int], float]:
    """The draft with the most expected accepted tokens that ``trie`` offers after
    ``context``, at most ``limit`` tokens, and that expectation. ``own``: the trie
    holds ``context`` itself, whose last occurrence has no continuation (it is not
    counted as a miss)."""
    best: tuple[list[int], float] = ([], 0.0)
    for match in range(min(MAX_MATCH, len(context), trie.depth - 1), 0, -1):
        node = trie.find(context[-match:])
        if node is None:
            continue
        seen = node.count - (1 if own else 0)
        if seen <= 0:
            continue
        draft, expected, chance = [], 0.0, 1.0
        room = min(limit, trie.depth - match, 2 * match)
        while len(draft) < room and node.children:
            token, child = max(node.children.items(), key=lambda item: item[1].count)
            chance *= child.count / seen
            if chance < MIN_PROBABILITY:
                break
            draft.append(token)
            expected += chance
            node, seen = child, child.count
        if expected > best[1]:
            best = (draft, expected)
    return best


class SuffixProposer:
    def __init__(self) -> None:
        # request id -> (its trie, its output list (the runner's, growing), its tenant)
        self.requests: dict[str, tuple[_GrowingTrie, list[int], str | None]] = {}
        self.tenants: dict[str | None, SuffixTrie] = {}
        # (tenant, request id) -> the output it added to its tenant's trie, oldest first
        self.outputs: OrderedDict[tuple[str | None, str], list[int]] = OrderedDict()
        self.num_global_tokens = 0

    def propose(self, items, make_row, shared_generator):
        proposals = []
        for item in items:
            state = item.request
            tokens = state.all_token_ids
            entry = self.requests.get(state.request_id)
            if entry is None or entry[0].num_seen - entry[0].start > 2 * REQUEST_WINDOW:
                grown = _GrowingTrie(max(0, len(tokens) - REQUEST_WINDOW))
                entry = (grown, state.output_token_ids, state.cache_salt)
                self.requests[state.request_id] = entry
            grown = entry[0]
            grown.extend(tokens[grown.num_seen :])
            limit = item.num_spec_tokens
            draft, expected = best_continuation(grown.trie, tokens, limit, own=True)
            tenant = self.tenants.get(state.cache_salt)
            if tenant is not None:
                other, other_expected = best_continuation(tenant, tokens, limit)
                if other_expected > expected:
                    draft = other
            proposals.append((draft, None))
        return proposals

    def rollback(self, request_id: str, num_valid_tokens: int) -> None:
        """Nothing to roll back: the tries only ever hold verified tokens."""

    def forget(self, request_id: str) -> None:
        """The request ended, or was preempted (it will be seen again, and its output
        then replaces what it added to its tenant's trie)."""
        entry = self.requests.pop(request_id, None)
        if entry is None:
            return
        _, output, salt = entry
        key = (salt, request_id)
        self._drop(key)
        if not output:
            return
        output = list(output)
        self.tenants.setdefault(salt, SuffixTrie(GLOBAL_DEPTH)).add(output)
        self.outputs[key] = output
        self.num_global_tokens += len(output)
        while self.num_global_tokens > GLOBAL_TOKENS:
            self._drop(next(iter(self.outputs)))

    def _drop(self, key: tuple[str | None, str]) -> None:
        output = self.outputs.pop(key, None)
        if output is None:
            return
        trie = self.tenants[key[0]]
        trie.add(output, sign=-1)
        self.num_global_tokens -= len(output)
        if not trie.root.children:
            del self.tenants[key[0]]
