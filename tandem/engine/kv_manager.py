"""KV block manager: which cache blocks each request holds.

The pool is ``num_blocks`` fixed-size blocks. Each request owns a block table (a
list of block ids) that covers its computed tokens plus the ones scheduled this step;
it only grows while the request runs, and every block goes back to the pool when the
request finishes, is aborted or is preempted. Blocks carry a reference count so that
a block can later be shared (prefix caching) and is free only at zero::

    request A  table [4, 9, 2]      token t of A lives in slot table[t // bs] * bs + t % bs
    request B  table [7, 1]
    free       [0, 3, 5, 6, 8, ...]  (FIFO: the longest-free block is reused first)

No tensors here: the runner owns the memory, this class only does the accounting.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

from tandem.engine.request import Request


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self.free_blocks: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    def allocate(self, count: int) -> list[int]:
        if count > len(self.free_blocks):
            raise RuntimeError(f"asked for {count} blocks, {len(self.free_blocks)} free")
        blocks = [self.free_blocks.popleft() for _ in range(count)]
        for block in blocks:
            self.ref_counts[block] = 1
        return blocks

    def release(self, blocks: Iterable[int]) -> None:
        for block in blocks:
            self.ref_counts[block] -= 1
            assert self.ref_counts[block] >= 0, f"block {block} released twice"
            if self.ref_counts[block] == 0:
                self.free_blocks.append(block)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.block_tables: dict[str, list[int]] = {}

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks in use (for metrics)."""
        return 1.0 - self.pool.num_free_blocks / self.pool.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def block_table(self, request_id: str) -> list[int]:
        return self.block_tables.get(request_id, [])

    def allocate_slots(self, request: Request, num_new_tokens: int) -> bool:
        """Grow ``request``'s table to cover its computed tokens plus ``num_new_tokens``.
        False (and nothing changes) when the pool is too short."""
        table = self.block_tables.setdefault(request.request_id, [])
        needed = self.blocks_needed(request.num_computed_tokens + num_new_tokens) - len(table)
        if needed <= 0:
            return True
        if needed > self.pool.num_free_blocks:
            if not table:
                del self.block_tables[request.request_id]
            return False
        table.extend(self.pool.allocate(needed))
        return True

    def free(self, request: Request) -> None:
        """Return every block of ``request`` to the pool (finish, abort or preemption)."""
        self.pool.release(self.block_tables.pop(request.request_id, []))

    def check_no_leaks(self) -> None:
        """Raise if any block is held although no request holds a table."""
        held = sum(len(t) for t in self.block_tables.values())
        in_use = self.pool.num_blocks - self.pool.num_free_blocks
        if held or in_use:
            raise AssertionError(f"{in_use} blocks in use, {held} in block tables")
