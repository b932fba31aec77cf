"""Tensor-parallel ranks on one host, meeting in shared memory instead of over TCP.

gloo over loopback costs about a millisecond for one all-reduce of a token's hidden
state (benchmarks/tensor_parallel.py), and a decode step of a 30-layer model makes 61
collectives: two ranks decoded many times slower than one process. Here every rank maps
one segment (a file in /dev/shm, unlinked once all have mapped it) and collectives are
memory copies and counters (kernels/shm_ops.cpp: fences and acquire/release, spinning):

    header   per rank: its collective counter, its acknowledgement of rank 0's last
             message (a cache line each); rank 0's message counter, length, parts left
    data     two buffers (collectives alternate, so a rank may write the next one's
             data while a slow rank still reads this one's), a slot per rank
    message  rank 0's step, pickled (larger ones in parts)

all_reduce: each rank copies its tensor into its slot, posts, waits for every rank,
then sums the slots in rank order (every rank the same sum, bit for bit); for float32,
all in one compiled call (faster than through torch and Python). all_gather: the same,
each rank reading every slot. Tensors larger than a slot go in pieces.

A wait checks between spins that the ranks it waits for are alive (``alive``: rank 0
polls its worker processes, a worker checks that rank 0, its parent, is): a dead rank
raises RuntimeError at once, never a hang; a live rank that does not come to a
collective within HANG_TIMEOUT_S (stopped, deadlocked) raises too. An idle worker
waiting for the next step backs off to sleeping after a while, so an idle server
burns no CPU.
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Callable

import numpy as np
import torch

from tandem.kernels import cpu as cpu_kernels

LINE = 8  # int64s per cache line: each rank's counters on lines of their own
HEADER_BYTES = 64 * 1024
SLOT_BYTES = 4 << 20
MESSAGE_BYTES = 4 << 20
SPIN_US = 2000  # between liveness checks
IDLE_BACKOFF_S = 0.05  # an idle wait spins this long, then sleeps between checks
# A collective inside a step waits for the other ranks to finish the same layer: far
# less than this unless one is stopped or stuck.
HANG_ENV = "TANDEM_TP_HANG_TIMEOUT_S"


def hang_timeout_s() -> float:
    text = os.environ.get(HANG_ENV, "300")
    try:
        seconds = float(text)
    except ValueError:
        seconds = float("nan")
    if not 0 < seconds < 1e6:
        raise ValueError(f"${HANG_ENV} must be a number of seconds above 0, not {text!r}")
    return seconds


HANG_TIMEOUT_S = hang_timeout_s()


def segment_bytes(size: int) -> int:
    return HEADER_BYTES + 2 * size * SLOT_BYTES + MESSAGE_BYTES


def create_segment(size: int, tag: str) -> str:
    """Rank 0: a zeroed file for ``size`` ranks' segment; returns its path."""
    folder = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    path = os.path.join(folder, f"tandem-tp-{tag}")
    with open(path, "wb") as f:
        f.truncate(segment_bytes(size))
    return path


class ShmGroup:
    """``size`` ranks' collectives through one shared segment (the module docstring)."""

    def __init__(self, path: str, rank: int, size: int, alive: Callable[[], str | None]) -> None:
        self.rank, self.size, self.alive = rank, size, alive
        self.kernels = cpu_kernels.load()
        segment = torch.from_file(path, shared=True, size=segment_bytes(size), dtype=torch.uint8)
        header = segment[:HEADER_BYTES].view(torch.int64)
        self.counters = header[: size * LINE]  # [rank * LINE]: its collectives
        self.acks = header[size * LINE : 2 * size * LINE]  # [rank * LINE]: messages read
        self.message_header = header[2 * size * LINE : (2 * size + 1) * LINE]  # seq, len, more
        data_end = HEADER_BYTES + 2 * size * SLOT_BYTES
        self.data = segment[HEADER_BYTES:data_end].view(2, size, SLOT_BYTES)
        self.floats = self.data.view(torch.float32)  # [2, size, slot floats]
        self.message = segment[data_end:]
        self.sequence = 0  # collectives done (every rank runs the same ones in order)
        self.reduced_seconds = 0.0  # in all-reduces made by compiled calls (reduce_in)
        self.messages = 0  # message parts sent or received

    # -- waiting ---------------------------------------------------------------------

    def _wait(self, counters: torch.Tensor, count: int, value: int, idle: bool = False) -> None:
        """Until ``count`` counters reach ``value``; a dead rank raises at once, and
        outside ``idle`` waits (a worker waiting for the next step) a rank that has not
        come for HANG_TIMEOUT_S (stopped, deadlocked) raises too."""
        started = time.monotonic()
        while not self.kernels.shm_wait(counters, LINE, count, value, SPIN_US):
            problem = self.alive()
            if problem is not None:
                raise RuntimeError(problem)
            waited = time.monotonic() - started
            if idle and waited > IDLE_BACKOFF_S:
                time.sleep(0.001)
            elif not idle and waited > HANG_TIMEOUT_S:
                late = [r for r in range(count) if counters[r * LINE] < value]
                raise RuntimeError(
                    f"tensor-parallel rank(s) {', '.join(map(str, late))} did not reach a "
                    f"collective in {HANG_TIMEOUT_S:.0f} s (hung? ${HANG_ENV} sets the limit)"
                )

    def _meet(self) -> int:
        """Post this rank's next collective and wait for every rank's; returns which
        of the two buffers it uses."""
        self.sequence += 1
        self.kernels.shm_post(self.counters, self.rank * LINE, self.sequence)
        self._wait(self.counters, self.size, self.sequence)
        return self.sequence % 2

    # -- collectives -----------------------------------------------------------------

    def all_reduce(self, tensor: torch.Tensor) -> None:
        """``tensor`` <- the sum of every rank's ``tensor`` (in place)."""
        flat = tensor.view(-1) if tensor.is_contiguous() else tensor.contiguous().view(-1)
        step = SLOT_BYTES // flat.element_size()
        for start in range(0, flat.numel(), step):
            piece = flat[start : start + step]
            n = piece.numel()
            buffer = (self.sequence + 1) % 2
            slots = self.data[buffer].view(flat.dtype)[:, :n]
            if flat.dtype == torch.float32:  # copy, post, wait and sum in one call
                self.sequence += 1
                args = (piece, slots, self.counters, LINE, self.rank, self.sequence, SPIN_US)
                if not self.kernels.shm_all_reduce(*args, True):
                    self._wait(self.counters, self.size, self.sequence)
                    self.kernels.shm_all_reduce(*args, False)
            else:
                slots[self.rank].copy_(piece)
                self._meet()
                torch.sum(slots, dim=0, out=piece)
        if not tensor.is_contiguous():
            tensor.copy_(flat.view(tensor.shape))

    def reduce_in(self, call: Callable, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Runs a compiled call that makes float32 all-reduces of this group itself
        (kernels/decode_stack.cpp's llama_decode_stack_ranked: every layer of a decode
        step, ``call(h, residual, floats, counters, stride, rank, state, spin_us)``),
        from its first layer. Where a wait runs out the call returns with its state;
        the wait goes on here, where a dead or hung rank raises as in all_reduce, and
        the call resumes. Returns its (output, stream)."""
        residual, state = h.new_empty(0), [0, 0, self.sequence]
        while True:
            h, residual, status = call(
                h, residual, self.floats, self.counters, LINE, self.rank, state, SPIN_US
            )
            layer, phase, self.sequence, nanoseconds = status.tolist()
            self.reduced_seconds += nanoseconds / 1e9
            if phase == 0:
                return h, residual
            started = time.perf_counter()
            self._wait(self.counters, self.size, self.sequence)
            self.reduced_seconds += time.perf_counter() - started
            state = [layer, phase, self.sequence]

    def all_gather(self, local: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        """[rows, sizes[rank]] on each rank -> [rows, sum(sizes)], rank 0's columns
        first."""
        rows = local.shape[0]
        out = local.new_empty(rows, sum(sizes))
        per_piece = max(1, SLOT_BYTES // (max(sizes) * local.element_size()))
        offsets = [sum(sizes[:r]) for r in range(self.size)]
        for first in range(0, rows, per_piece):
            last = min(rows, first + per_piece)
            buffer = (self.sequence + 1) % 2
            slots = self.data[buffer].view(local.dtype)
            mine = slots[self.rank, : (last - first) * sizes[self.rank]]
            mine.view(last - first, sizes[self.rank]).copy_(local[first:last])
            self._meet()
            for r in range(self.size):
                piece = slots[r, : (last - first) * sizes[r]].view(last - first, sizes[r])
                out[first:last, offsets[r] : offsets[r] + sizes[r]] = piece
        return out

    # -- rank 0's messages -----------------------------------------------------------

    def send(self, payload: bytes) -> None:
        """Rank 0: ``payload`` to every other rank (in parts when large)."""
        view = memoryview(payload)
        parts = [view[i : i + MESSAGE_BYTES] for i in range(0, len(view), MESSAGE_BYTES)]
        for index, part in enumerate(parts or [view]):
            # every rank has copied the previous part out before it is overwritten
            self._wait(self.acks[LINE:], self.size - 1, self.messages)
            self.message[: len(part)].numpy()[:] = np.frombuffer(part, dtype=np.uint8)
            self.message_header[1] = len(part)
            self.message_header[2] = len(parts) - 1 - index
            self.messages += 1
            self.kernels.shm_post(self.message_header, 0, self.messages)

    def receive(self) -> bytes:
        """Ranks 1..N-1: rank 0's next payload (waiting for it as long as it takes)."""
        chunks = []
        while True:
            self.messages += 1
            self._wait(self.message_header, 1, self.messages, idle=True)
            length, more = int(self.message_header[1]), int(self.message_header[2])
            chunks.append(self.message[:length].numpy().tobytes())
            self.kernels.shm_post(self.acks, self.rank * LINE, self.messages)
            if more == 0:
                return b"".join(chunks)
