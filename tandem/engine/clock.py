"""The engine's clock: ``now()`` is time.perf_counter, unless a simulation has set its
own. Every timestamp the engine records (arrivals, scheduling, tokens, preemptions,
finishes) and the step tracer reads comes from here, so that ``tandem simulate`` can
run the real scheduler on simulated time (tandem/plan/simulate.py)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator

_now: Callable[[], float] = time.perf_counter


def now() -> float:
    return _now()


@contextlib.contextmanager
def simulated(clock: Callable[[], float]) -> Iterator[None]:
    """Within the block, the engine reads ``clock`` instead of the wall clock (one
    simulation at a time: the clock is the process's)."""
    global _now
    previous, _now = _now, clock
    try:
        yield
    finally:
        _now = previous
