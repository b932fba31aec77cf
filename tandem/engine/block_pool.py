"""BlockPool: the KV cache's blocks, their reference counts, and which full blocks hold
a known prefix (the prefix cache index).

A block is in exactly one of three states::

    in use      ref_count > 0; in one or more block tables; may be cached (shared)
    free        ref_count == 0; in the free queue; may still be cached (reusable)
    (a free block is reused for new tokens only when it leaves the queue's head)

The free queue is least-recently-used first: a request that finishes appends its blocks
tail first, so its last blocks are evicted before its first ones (a later request is
likelier to share a prompt's start than its end). Taking a block from the head evicts
its cache entry; a cache hit on a free block takes it out of the queue wherever it is.

Cache entries are keyed by a digest chained over the parent block's digest, the
block's token ids and (for the first block) the request's cache salt, so equal
digests mean equal prefixes; every hit is also confirmed against the stored parent
digest and token ids.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass


def block_digest(parent: bytes | None, token_ids: Sequence[int], salt: str | None) -> bytes:
    """The prefix-cache key of a full block (sha256, so collisions are not a concern)."""
    digest = hashlib.sha256(parent or b"root")
    if parent is None and salt is not None:
        digest.update(b"salt:" + salt.encode())
    digest.update(array("q", token_ids).tobytes())
    return digest.digest()


@dataclass(frozen=True)
class CachedBlock:
    digest: bytes
    parent: bytes | None
    token_ids: tuple[int, ...]


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self.free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.cached: dict[int, CachedBlock] = {}  # block -> what it holds
        self.by_digest: dict[bytes, int] = {}
        self.num_evictions = 0

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    def allocate(self, count: int) -> list[int]:
        """``count`` blocks for new tokens, from the head of the free queue (evicting
        whatever those held)."""
        if count > len(self.free_queue):
            raise RuntimeError(f"asked for {count} blocks, {len(self.free_queue)} free")
        blocks = []
        for _ in range(count):
            block, _ = self.free_queue.popitem(last=False)
            self._evict(block)
            self.ref_counts[block] = 1
            blocks.append(block)
        return blocks

    def touch(self, blocks: Iterable[int]) -> None:
        """Take a reference on cached blocks (a prefix-cache hit)."""
        for block in blocks:
            if self.ref_counts[block] == 0:
                del self.free_queue[block]
            self.ref_counts[block] += 1

    def release(self, blocks: Iterable[int]) -> None:
        """Drop a reference on each block, in the given order (the eviction order)."""
        for block in blocks:
            self.ref_counts[block] -= 1
            assert self.ref_counts[block] >= 0, f"block {block} released twice"
            if self.ref_counts[block] == 0:
                self.free_queue[block] = None

    def lookup(self, digest: bytes, parent: bytes | None, token_ids: Sequence[int]) -> int | None:
        block = self.by_digest.get(digest)
        if block is None:
            return None
        entry = self.cached[block]
        if entry.parent != parent or entry.token_ids != tuple(token_ids):
            return None
        return block

    def cache(self, block: int, digest: bytes, parent: bytes | None, token_ids: Sequence[int]):
        """Record that ``block`` holds the K/V of this full block of tokens. A prefix
        already cached in another block keeps that block (this one stays private)."""
        if digest in self.by_digest or block in self.cached:
            return
        self.cached[block] = CachedBlock(digest, parent, tuple(token_ids))
        self.by_digest[digest] = block

    def _evict(self, block: int) -> None:
        entry = self.cached.pop(block, None)
        if entry is not None:
            del self.by_digest[entry.digest]
            self.num_evictions += 1

    def check_consistency(self) -> None:
        """Every block is in use xor free; the cache index points both ways."""
        for block, count in enumerate(self.ref_counts):
            if (count == 0) != (block in self.free_queue):
                raise AssertionError(f"block {block}: ref count {count}, free queue mismatch")
        for digest, block in self.by_digest.items():
            if self.cached[block].digest != digest:
                raise AssertionError(f"block {block}: cache index out of sync")
        if len(self.by_digest) != len(self.cached):
            raise AssertionError("cache index out of sync")
