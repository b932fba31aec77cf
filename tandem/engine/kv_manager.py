"""KV block manager: which cache blocks each request holds, and the prefix cache.

Each request owns a block table (block ids) covering its computed tokens plus the ones
scheduled this step; it only grows while the request runs, and every block is released
when the request finishes, is aborted or is preempted::

    request A  table [4, 9, 2]      token t of A lives in slot table[t // bs] * bs + t % bs
    request B  table [4, 9, 7]      (A's first two blocks, shared: ref count 2)
    free       [0, 3, 5, ...]       least recently used first (see block_pool.py)

Prefix caching: once a block is full and its K/V computed, it is registered under a
digest chained over everything before it. A request being admitted takes the longest
run of registered blocks that matches its tokens (by reference, nothing is copied)
and starts with ``num_computed_tokens`` there. The hit stops one token short of the
whole sequence, so there are logits to sample from, and covers whole blocks only, so
a shared block is never written again.

No tensors here: the runner owns the memory, this class only does the accounting.
"""

from __future__ import annotations

from tandem.engine.block_pool import BlockPool, block_digest
from tandem.engine.request import Request


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks)
        self.block_tables: dict[str, list[int]] = {}
        self._num_registered: dict[str, int] = {}  # leading blocks already in the cache
        # Prompt tokens looked up at admission, and how many of them were found.
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        # Blocks handed to someone else with ``detach`` (a KV connector keeping a
        # finished request's K/V for another instance), not yet released.
        self.num_detached_blocks = 0

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_blocks_in_use(self) -> int:
        return self.pool.num_blocks - self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks in use (cached free blocks count as free)."""
        return self.num_blocks_in_use / self.pool.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def block_table(self, request_id: str) -> list[int]:
        return self.block_tables.get(request_id, [])

    # -- prefix cache ------------------------------------------------------------------

    def _digests(self, request: Request, num_blocks: int) -> list[bytes]:
        """Digests of the request's first ``num_blocks`` full blocks (kept on the request:
        its tokens only ever grow, so they stay valid)."""
        digests, size = request.block_digests, self.block_size
        while len(digests) < num_blocks:
            index = len(digests)
            tokens = request.all_token_ids[index * size : (index + 1) * size]
            parent = digests[-1] if digests else None
            digests.append(block_digest(parent, tokens, request.cache_salt))
        return digests[:num_blocks]

    def find_cached_prefix(self, request: Request) -> list[int]:
        """The cached blocks that hold the longest run of ``request``'s leading full
        blocks, leaving at least one token to compute. Takes no reference."""
        if not self.enable_prefix_caching:
            return []
        size = self.block_size
        hits: list[int] = []
        parent = None
        for index, digest in enumerate(self._digests(request, (request.num_tokens - 1) // size)):
            tokens = request.all_token_ids[index * size : (index + 1) * size]
            block = self.pool.lookup(digest, parent, tokens)
            if block is None:
                break
            hits.append(block)
            parent = digest
        return hits

    def cache_computed_blocks(self, request: Request) -> None:
        """Register the request's newly full, computed blocks for reuse."""
        if not self.enable_prefix_caching:
            return
        table = self.block_tables.get(request.request_id)
        if table is None:
            return
        full = request.num_computed_tokens // self.block_size
        start = self._num_registered.get(request.request_id, 0)
        if full <= start:
            return
        digests = self._digests(request, full)
        size = self.block_size
        for index in range(start, full):
            tokens = request.all_token_ids[index * size : (index + 1) * size]
            parent = digests[index - 1] if index else None
            self.pool.cache(table[index], digests[index], parent, tokens)
        self._num_registered[request.request_id] = full

    # -- allocation ----------------------------------------------------------------------

    def allocate_slots(
        self, request: Request, num_new_tokens: int, cached_blocks: list[int] | None = None
    ) -> bool:
        """Grow ``request``'s table to cover its computed tokens plus ``num_new_tokens``.
        On admission, ``cached_blocks`` (from find_cached_prefix, already counted in
        ``request.num_computed_tokens``) start the table. False, and nothing changes,
        when the pool is too short."""
        cached_blocks = cached_blocks or []
        table = self.block_tables.get(request.request_id, [])
        have = len(table) + len(cached_blocks)
        needed = self.blocks_needed(request.num_computed_tokens + num_new_tokens) - have
        # A hit on a free block takes it out of the free pool too.
        revived = sum(1 for block in cached_blocks if self.pool.ref_counts[block] == 0)
        if max(needed, 0) + revived > self.pool.num_free_blocks:
            return False
        if cached_blocks:
            self.pool.touch(cached_blocks)
            self._num_registered[request.request_id] = len(cached_blocks)
        new_blocks = self.pool.allocate(needed) if needed > 0 else []
        self.block_tables[request.request_id] = table + cached_blocks + new_blocks
        return True

    def trim(self, request: Request) -> None:
        """Release the tail blocks past ``request``'s computed tokens: after speculation,
        those held only rejected drafts. (The rest of the table is untouched.)"""
        table = self.block_tables.get(request.request_id)
        if table is None:
            return
        keep = self.blocks_needed(request.num_computed_tokens)
        if len(table) > keep:
            self.pool.release(reversed(table[keep:]))
            del table[keep:]

    def detach(self, request: Request) -> list[int]:
        """Hand a finished request's blocks, with their references, to the caller; it
        gives them back with ``release_detached``."""
        table = self.block_tables.pop(request.request_id, [])
        self._num_registered.pop(request.request_id, None)
        self.num_detached_blocks += len(table)
        return table

    def borrow(self, count: int) -> list[int]:
        """``count`` free blocks for a caller outside the scheduler (whatever prefix they
        cached is evicted first); given back with ``release_detached``."""
        blocks = self.pool.allocate(count)
        self.num_detached_blocks += count
        return blocks

    def release_detached(self, blocks: list[int]) -> None:
        self.num_detached_blocks -= len(blocks)
        self.pool.release(reversed(blocks))

    def record_admission(self, request: Request, num_cached_tokens: int) -> None:
        self.prefix_cache_queries += request.num_tokens
        self.prefix_cache_hits += num_cached_tokens

    def free(self, request: Request) -> None:
        """Release every block of ``request`` (finish, abort or preemption), tail first:
        its last blocks are the first to be evicted."""
        self.pool.release(reversed(self.block_tables.pop(request.request_id, [])))
        self._num_registered.pop(request.request_id, None)

    def check_no_leaks(self) -> None:
        """Raise if any block is held although no request holds a table, or if the
        pool's bookkeeping disagrees with itself."""
        self.pool.check_consistency()
        held = sum(len(t) for t in self.block_tables.values()) + self.num_detached_blocks
        in_use = self.pool.num_blocks - self.pool.num_free_blocks
        if held or in_use:
            raise AssertionError(f"{in_use} blocks in use, {held} in block tables")
