"""State slots: which slot of the state cache each running request holds.

A hybrid model's recurrent layers (Qwen3.5's Gated DeltaNet) keep, per sequence, a
fixed-size state instead of K/V that grow with the context: the runner holds them in
``num_slots`` slots (runner/state_cache.py), sized from the same memory budget as the
KV blocks. A request takes a slot when it is admitted and gives it back when it
finishes, is aborted or is preempted; a preempted request recomputes its state from its
tokens when it resumes (in whatever slot is free then), as it recomputes its K/V.

A state summarises every token before it and cannot be shared, so a hybrid runs
without the prefix cache (a cache hit would start a request past tokens whose state no
slot holds): the engine turns it off. Speculative decoding works: once the drafts are
judged, the runner sets the slot to the last accepted token's states
(runner/state_cache.py).

No tensors here: the runner owns the memory, this class only does the accounting.
"""

from __future__ import annotations


class StateSlots:
    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))  # popped from the end: 0 first
        self._held: dict[str, int] = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

    def slot_of(self, request_id: str) -> int:
        return self._held[request_id]

    def take(self, request_id: str) -> int:
        """A free slot for ``request_id`` (the caller checked ``num_free``)."""
        slot = self._free.pop()
        self._held[request_id] = slot
        return slot

    def give_back(self, request_id: str) -> None:
        """Free ``request_id``'s slot, if it holds one."""
        slot = self._held.pop(request_id, None)
        if slot is not None:
            self._free.append(slot)

    def check_no_leaks(self) -> None:
        if self._held or len(self._free) != self.num_slots:
            raise AssertionError(f"{len(self._held)} state slots still held: {self._held}")
