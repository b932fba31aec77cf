"""The one contract for watching an engine: request and step events, and a snapshot of
the engine's counters after every step. The step tracer and the server's Prometheus
metrics both implement it; anything else that wants to watch (a logger, a dashboard)
does too, with ``Engine.add_observer``.

Events arrive on the engine's thread, in this order within a step: ``request_finished``
for requests that finished in it (while the step's tokens are appended), then
``step_done``. ``request_added`` and aborts' ``request_finished`` come between steps.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from tandem.step import SpecDecodeStats

if TYPE_CHECKING:
    from tandem.engine.request import Request
    from tandem.step import SchedulerOutput


@dataclass(frozen=True)
class StepStats:
    """The engine after a step (or between steps): gauges and cumulative counters."""

    num_running: int
    num_waiting: int
    kv_blocks_in_use: int
    kv_usage: float  # fraction of blocks in use (cached free blocks count as free)
    # This step only (0 between steps).
    num_batched_tokens: int = 0
    num_generated_tokens: int = 0
    num_preempted: int = 0
    # Cumulative since the engine started.
    prefix_cache_queries: int = 0  # prompt tokens looked up at admission
    prefix_cache_hits: int = 0  # ... and found
    num_kv_leases: int = 0  # finished prefills holding blocks for a decode instance
    num_lease_expiries: int = 0
    spec: SpecDecodeStats | None = None  # speculative decoding, when configured
    num_speculating: int = 0  # this step: requests given draft slots
    spec_switches: int = 0  # times measured speculation flipped on or off (spec_control.py)
    # A mixture of experts, this step: tokens per expert of each sparse layer (the
    # step's last forward through it; models/moe.py), empty otherwise.
    expert_load: tuple[tuple[int, ...], ...] = ()


def load_summary(load: tuple[tuple[int, ...], ...]) -> dict[str, float]:
    """One step's expert load (tokens per expert, per sparse layer) in three numbers:
    the distinct experts a layer read (the mean over layers: what the step's weight
    reads grow with), the most tokens any expert took, and the imbalance (that maximum
    over the mean of the experts that were picked: 1 when the load is even)."""
    picked = [n for layer in load for n in layer if n]
    if not picked:
        return {"experts_read": 0.0, "expert_max_tokens": 0, "expert_imbalance": 0.0}
    read = sum(sum(1 for n in layer if n) for layer in load) / len(load)
    top = max(picked)
    return {
        "experts_read": round(read, 2),
        "expert_max_tokens": top,
        "expert_imbalance": round(top * len(picked) / sum(picked), 3),
    }


class EngineObserver:
    """Override what you need; every hook defaults to nothing."""

    def request_added(self, request: Request) -> None:
        """A (child) request was queued."""

    def request_finished(self, request: Request) -> None:
        """A (child) request ended; ``request.status`` says how (stop, length, abort)."""

    def step_done(self, out: SchedulerOutput | None, stats: StepStats) -> None:
        """A step ran (``out`` is what it scheduled), or state changed between steps
        (``out`` None: a lease released or expired, an abort)."""
