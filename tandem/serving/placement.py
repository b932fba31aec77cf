"""Which instance of a role takes the next request: the router's policy, shared with
the simulator (tandem/plan/simulate.py) so that a simulated cluster routes as the
real one does."""

from __future__ import annotations

import hashlib
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


def prefix_affinity(
    instances: list[Instance], key: bytes | None, slack: int, skip: set[str] = frozenset()
) -> Instance | None:
    """The instance ``key`` (a digest of the prompt's first KV block) maps to, where its
    cache likely holds the prompt's start, unless it has more than ``slack`` requests in
    flight beyond the least busy one: then the least busy (no key: the least busy).
    The map is rendezvous hashing over the instances not skipped, so an instance going
    away moves only its own keys."""
    candidates = [i for i in instances if i.url not in skip]
    if key is None or not candidates:
        return least_busy(instances, skip)
    home = max(candidates, key=lambda i: hashlib.sha256(key + i.url.encode()).digest())
    if home.in_flight > min(i.in_flight for i in candidates) + slack:
        return least_busy(instances, skip)
    home.picked += 1
    return home
