"""The state cache: a hybrid model's recurrent states, a fixed-size slot per sequence.

A recurrent layer (Qwen3.5's Gated DeltaNet) carries, per sequence, states whose size
does not grow with the context: its convolution's last inputs and the delta rule's
matrix per head. The cache holds them for ``num_slots`` sequences at once, one float32
tensor per layer and state, ``[num_slots, *shape]`` (ModelConfig.recurrent_state). The
engine decides which request holds which slot (engine/state_slots.py); the runner only
reads and writes them:

    a step's sequences      slots [3, 0, 5]      fresh: [False, True, False]
    layer 0: conv [slots, C, width - 1]    delta [slots, H, Dk, Dv]
    layer 1: ...

A sequence whose tokens start at position 0 (a new prompt, or a preempted request
recomputing) starts from zero states: its slot is cleared before the forward, so a slot
freed by one request never leaks into the next. A prompt cut into chunks carries its
state from chunk to chunk in its slot.

Speculative decoding: a sequence verifying k drafts runs its k + 1 tokens one step at a
time, and each layer leaves a way back (``rollbacks``: a copy of its state before the
tokens, and their inputs); once the drafts are judged, the slot is set to the states
after the last accepted token (``keep``: the copy, with the accepted tokens run again),
as the KV cache's rejected rows are simply never read again.

The budget: slots and KV blocks share one memory budget (``split_budget``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from tandem.models.config import ModelConfig
from tandem.runner.kv_cache import zeroed_on_first_touch

# The share of the cache budget a hybrid's state slots may take, at most (the rest is
# KV blocks for its attention layers); within it, one slot per ``max_num_seqs``.
STATE_SHARE = 0.5


def split_budget(config: ModelConfig, budget: int, max_num_seqs: int) -> tuple[int, int]:
    """(state slots, bytes left for KV blocks) from a cache budget of ``budget`` bytes:
    a slot for each of ``max_num_seqs`` sequences, or as many as ``STATE_SHARE`` of the
    budget holds (at least one)."""
    per_slot = config.state_bytes_per_sequence()
    if not per_slot:
        return 0, budget
    slots = max(1, min(max_num_seqs, int(budget * STATE_SHARE // per_slot)))
    return slots, max(0, budget - slots * per_slot)


class StateCache:
    """Every recurrent layer's states for ``num_slots`` sequences (zeros to start)."""

    def __init__(self, config: ModelConfig, num_slots: int, device: torch.device) -> None:
        self.num_slots = num_slots

        def zeros(shape: tuple[int, ...]) -> torch.Tensor:
            if device.type == "cpu":  # (resident as slots are first used, as the KV cache)
                return zeroed_on_first_touch((num_slots, *shape), torch.float32)
            return torch.zeros((num_slots, *shape), dtype=torch.float32, device=device)

        self.layers = {
            layer: tuple(zeros(shape) for shape in config.recurrent_state)
            for layer in config.recurrent_layers
        }

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for states in self.layers.values() for t in states)

    def clear(self, slots: torch.Tensor) -> None:
        for states in self.layers.values():
            for tensor in states:
                tensor[slots] = 0


@dataclass
class RecurrentBatch:
    """One forward's sequences as a recurrent layer reads them: sequence s's tokens are
    rows [starts[s], starts[s] + lens[s]) of the flat batch, its states at ``slots[s]``
    of ``cache``."""

    starts: tuple[int, ...]
    lens: tuple[int, ...]
    slots: torch.Tensor  # [S] int64, on the model's device
    host_slots: tuple[int, ...]  # the same, on the host
    cache: StateCache
    # Per sequence: whether it verifies drafts (a decode token and its drafts). Each of
    # its layers leaves a way back (``rollbacks``) until the runner knows how many were
    # accepted (``keep``).
    verifying: tuple[bool, ...] = ()
    # slot -> each recurrent layer's ``rollback(accepted)``: its states as after the
    # first ``accepted`` of the sequence's tokens in this forward
    rollbacks: dict[int, list[Callable[[int], None]]] = field(default_factory=dict)

    @property
    def decodes(self) -> bool:
        """Every sequence runs one token (the step's recurrences run batched)."""
        return all(n == 1 for n in self.lens)

    def states(self, layer: int) -> tuple[torch.Tensor, ...]:
        return self.cache.layers[layer]

    def verifies(self, sequence: int) -> bool:
        return bool(self.verifying) and self.verifying[sequence]

    def recur(self, inputs, out, chunked, step, states, conv_after, conv_states) -> torch.Tensor:
        """A recurrent layer's rule over the batch, its per-token ``inputs`` rows of the
        flat batch and ``states`` [slots, ...] in the cache: one batched ``step(*inputs,
        states, slots)`` when every sequence decodes; else each sequence from its slot,
        a prompt (chunk) by ``chunked(*its rows, state) -> (out, state)``, a verifying
        sequence ``step`` a token with its rollback kept (``verified_steps``;
        ``conv_after``: its conv windows after each token, by slot) -> ``out`` filled
        (or the step's output)."""
        if self.decodes:
            return step(*inputs, states, self.slots)
        for s, (start, n, slot) in enumerate(
            zip(self.starts, self.lens, self.host_slots, strict=True)
        ):
            rows = slice(start, start + n)
            if self.verifies(s):
                out[rows], rollback = verified_steps(
                    step, inputs, rows, conv_after[slot], conv_states, states, slot
                )
                self.rollbacks.setdefault(slot, []).append(rollback)
                continue
            out[rows], states[slot] = chunked(*(x[rows] for x in inputs), states[slot])
        return out

    def keep(self, slot: int, accepted: int) -> None:
        """Speculation's rollback: of a verifying sequence's tokens, the first
        ``accepted`` had their drafts accepted (the decode token counted): its slot
        takes the states after the last of them, in every layer."""
        for rollback in self.rollbacks.pop(slot, ()):
            rollback(accepted)

    @classmethod
    def build(
        cls,
        cache: StateCache,
        lens: Sequence[int],
        num_computed: Sequence[int],
        slots: Sequence[int],
        device: torch.device,
        verifying: Sequence[bool] | None = None,
    ) -> RecurrentBatch:
        """The batch of sequences running ``lens[s]`` tokens after ``num_computed[s]``,
        in ``slots[s]`` (``verifying[s]``: a decode token and its drafts); those
        starting at position 0 get cleared slots."""
        if min(slots, default=0) < 0:
            raise ValueError("a sequence of a hybrid model runs without a state slot")
        starts, total = [], 0
        for n in lens:
            starts.append(total)
            total += n
        slots = tuple(int(slot) for slot in slots)
        batch = cls(
            tuple(starts), tuple(lens), torch.tensor(slots, device=device), slots, cache,
            tuple(verifying or ()),
        )  # fmt: skip
        fresh = [slot for slot, done in zip(slots, num_computed, strict=True) if done == 0]
        if fresh:
            cache.clear(torch.tensor(fresh, device=device))
        return batch

    @classmethod
    def fresh(cls, config: ModelConfig, batch: int, length: int, device) -> RecurrentBatch:
        """``batch`` sequences of ``length`` tokens from position 0, in states of their
        own (the no-cache forward)."""
        cache = StateCache(config, batch, device)
        return cls.build(cache, [length] * batch, [0] * batch, list(range(batch)), device)


def verified_steps(step, inputs, rows: slice, windows, conv_states, states, slot: int):
    """A verifying sequence's tokens (``rows`` of ``inputs``: the per-token arguments
    ``step`` takes before the states and slots, Gated DeltaNet's q, k, v, g, beta,
    Mamba-2's x, dt, B, C) one decode step each, in its slot -> (outputs,
    ``rollback(accepted)``: the slot as after the first ``accepted`` tokens;
    ``windows``: its conv window after each token). The
    rollback holds one copy of the state (the one before), not one a token: it restores
    it and runs the accepted tokens again, the same steps on the same values, so the
    state is the one they left."""
    index = torch.tensor([slot], device=states.device)
    tokens = [tuple(x[t : t + 1] for x in inputs) for t in range(rows.start, rows.stop)]
    before = states[slot].clone()
    out = torch.cat([step(*one, states, index) for one in tokens])

    def rollback(accepted: int) -> None:
        conv_states[slot] = windows[accepted - 1]
        if accepted == len(tokens):
            return  # (every draft held: the slot is as they left it)
        states[slot] = before
        for one in tokens[:accepted]:
            step(*one, states, index)

    return out, rollback
