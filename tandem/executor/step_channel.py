"""Rank 0's per-step message to the other ranks, and the deadline on their waits.

On one host the message is pickled through the shared segment (runner/shm_group.py),
whose waits already tell a stopped rank from an idle one. Otherwise it is
``broadcast_object_list`` over the gloo group, and gloo's only guard against a rank
that is alive but never comes (stopped, deadlocked) is the group's timeout. A worker
waits for the next step in that broadcast for as long as the server is idle, so the
timeout cannot be short by itself. Once every rank has loaded (``arm``), the group's
timeout becomes the hang timeout, and rank 0 keeps idle workers' waits short: a
thread sends a BEAT whenever a quarter of the timeout passes without a step. Steps
and beats take turns under one lock (``turn``), so every rank sees the same order of
broadcasts and collectives. Then a hung rank makes the others' next wait raise within
the timeout (rank 0's step fails with EngineDeadError, a worker exits), and an idle
group never times out.
"""

from __future__ import annotations

import contextlib
import datetime
import pickle
import threading
import time

import torch.distributed as dist
from torch.distributed.distributed_c10d import _set_pg_timeout

from tandem.runner import shm_group
from tandem.runner.shm_group import ShmGroup

BEAT = "beat"  # rank 0 is idle, and alive
BEATS_PER_TIMEOUT = 4


def set_hang_timeout(comm=None) -> float:
    """The gloo groups' waits (the world's, and ``comm``'s where it has its own) end
    after the hang timeout from now on; returns it in seconds."""
    seconds = shm_group.HANG_TIMEOUT_S
    timeout = datetime.timedelta(seconds=seconds)
    _set_pg_timeout(timeout)
    if hasattr(comm, "set_timeout"):
        comm.set_timeout(timeout)
    return seconds


def hung_after(started: float, timeout_s: float | None) -> str | None:
    """What to say of a collective that failed ``started`` (monotonic) after it began:
    the group's hang timeout (None: none is set) ran out, or None."""
    if timeout_s is None or time.monotonic() - started < timeout_s:
        return None
    return (
        f"a tensor-parallel rank did not answer in {timeout_s:.0f} s "
        f"(hung? ${shm_group.HANG_ENV} sets the limit)"
    )


class StepChannel:
    def __init__(self, shm: ShmGroup | None, rank: int) -> None:
        self.shm, self.rank = shm, rank
        self.lock = threading.Lock()
        self.timeout_s: float | None = None  # the gloo group's, once armed
        self.failure: str | None = None  # why a beat failed (rank 0)
        self.last_sent = time.monotonic()
        self._stop = threading.Event()
        self._beats: threading.Thread | None = None

    def arm(self, comm=None) -> None:
        """Every rank, once loaded: meet (without a deadline: loads differ in length),
        then the gloo groups' waits (the world's, and ``comm``'s where it has its own)
        have the hang timeout and rank 0 beats."""
        if self.shm is not None:
            return
        dist.barrier()
        self.timeout_s = set_hang_timeout(comm)
        if self.rank == 0:
            self._beats = threading.Thread(target=self._beat, name="tandem-tp-beat", daemon=True)
            self._beats.start()

    @contextlib.contextmanager
    def turn(self):
        """Held by rank 0 for a whole step: its message and the model's collectives."""
        with self.lock:
            yield

    def send(self, message: object) -> None:
        """Rank 0, inside ``turn``."""
        if self.shm is not None:
            self.shm.send(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))
            return
        self.last_sent = time.monotonic()
        dist.broadcast_object_list([message], src=0)

    def receive(self) -> object:
        """The other ranks: the next step (beats are skipped)."""
        while True:
            if self.shm is not None:
                message = pickle.loads(self.shm.receive())
            else:
                box = [None]
                dist.broadcast_object_list(box, src=0)
                message = box[0]
            if message != BEAT:
                return message

    def _beat(self) -> None:
        period = self.timeout_s / BEATS_PER_TIMEOUT
        while not self._stop.wait(period / 4):
            if time.monotonic() - self.last_sent < period:
                continue
            with self.lock:
                if self._stop.is_set():
                    return
                started = time.monotonic()
                try:
                    self.send(BEAT)
                except RuntimeError as exc:  # a rank went away or hung while idle
                    gone = f"a tensor-parallel rank is gone: {exc}"
                    self.failure = hung_after(started, self.timeout_s) or gone
                    return

    def stop_beats(self) -> None:
        """Rank 0: no more beats (callable inside ``turn``: it does not wait)."""
        self._stop.set()

    def close(self) -> None:
        """Rank 0: stop beating and wait for the last beat (before the last message,
        STOP; not inside ``turn``)."""
        self._stop.set()
        if self._beats is not None and self._beats is not threading.current_thread():
            self._beats.join()
            self._beats = None
