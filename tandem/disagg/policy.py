"""Which instance of a role takes the next request: the router's policy, shared with
the simulator (tandem/plan/simulate.py) so that a simulated cluster routes as the
real one does."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Instance:
    url: str  # (the simulator: an instance's name)
    in_flight: int = 0  # requests sent to it and not yet answered
    picked: int = 0


def least_busy(instances: list[Instance], skip: set[str] = frozenset()) -> Instance | None:
    """Fewest requests in flight; among equals, the one picked least (round robin)."""
    candidates = [i for i in instances if i.url not in skip]
    if not candidates:
        return None
    choice = min(candidates, key=lambda i: (i.in_flight, i.picked))
    choice.picked += 1
    return choice
