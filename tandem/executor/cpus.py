"""A process's CPUs: which it may run on, a disjoint share of them, and pinning every
thread of the process to a set (torch-free: the API server uses it to give each
data-parallel engine core its own CPUs, the ranks to split a core's between them)."""

from __future__ import annotations

import contextlib
import os


def allowed_cpus() -> list[int]:
    """The CPUs this process may run on, in order ([] where the OS cannot say)."""
    if not hasattr(os, "sched_getaffinity"):
        return []
    return sorted(os.sched_getaffinity(0))


def cpu_share(cpus: list[int], parts: int, index: int) -> list[int]:
    """Part ``index`` of ``cpus`` cut into ``parts`` contiguous runs (neighbours share
    caches; the first runs are one longer where they do not divide). Empty when there
    are fewer CPUs than parts: then nobody is pinned."""
    if len(cpus) < parts:
        return []
    size, extra = divmod(len(cpus), parts)
    start = index * size + min(index, extra)
    return cpus[start : start + size + (index < extra)]


def pin_threads(cpus) -> None:
    """Every thread of this process on ``cpus`` (threads started later inherit it)."""
    for thread in os.listdir("/proc/self/task"):
        with contextlib.suppress(OSError):  # a thread that just ended
            os.sched_setaffinity(int(thread), cpus)
