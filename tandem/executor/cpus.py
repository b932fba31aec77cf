"""A process's CPUs: which it may run on, a disjoint share of them, its ranks spread
over the host's NUMA nodes, and pinning every thread of the process to a set
(torch-free: the API server uses it to give each data-parallel engine core its own
CPUs, the ranks to split a core's between them)."""

from __future__ import annotations

import contextlib
import ctypes
import os
from pathlib import Path

NODES = Path("/sys/devices/system/node")
MPOL_DEFAULT, MPOL_BIND = 0, 2
SYS_SET_MEMPOLICY = {"x86_64": 238, "aarch64": 237}


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


def parse_cpulist(text: str) -> list[int]:
    """The kernel's CPU list format ("0-3,8,10-11") as CPU numbers."""
    cpus: list[int] = []
    for part in text.strip().split(","):
        if part:
            first, _, last = part.partition("-")
            cpus.extend(range(int(first), int(last or first) + 1))
    return cpus


def numa_nodes(cpus: list[int], root: Path = NODES) -> dict[int, list[int]]:
    """The host's NUMA nodes that hold some of ``cpus``: node -> its CPUs among them
    ({} where the OS does not say)."""
    nodes = {}
    for folder in sorted(root.glob("node[0-9]*")):
        with contextlib.suppress(OSError, ValueError):
            mine = sorted(set(parse_cpulist((folder / "cpulist").read_text())) & set(cpus))
            if mine:
                nodes[int(folder.name[4:])] = mine
    return nodes


def rank_cpus(
    cpus: list[int], ranks: int, rank: int, nodes: dict[int, list[int]]
) -> tuple[list[int], int | None]:
    """Rank ``rank`` of a host's ``ranks``: its CPUs, and its NUMA node where the ranks
    spread evenly over several (as many ranks per node: each rank's threads and memory
    on one socket, whose bandwidth it then has to itself), else None and a run of
    ``cpus``."""
    if len(nodes) > 1 and ranks % len(nodes) == 0:
        per_node = ranks // len(nodes)
        node = sorted(nodes)[rank // per_node]
        share = cpu_share(nodes[node], per_node, rank % per_node)
        if share:
            return share, node
    return cpu_share(cpus, ranks, rank), None


def bind_memory(node: int | None) -> bool:
    """This process's new allocations on NUMA node ``node`` (set_mempolicy MPOL_BIND,
    as vLLM's and SGLang's CPU backends bind theirs); None: the default policy again.
    False where the kernel refuses or the call is unknown here."""
    number = SYS_SET_MEMPOLICY.get(os.uname().machine)
    if number is None:
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    if node is None:
        return libc.syscall(number, MPOL_DEFAULT, None, 0) == 0
    words = node // 64 + 1
    mask = (ctypes.c_ulong * words)()
    mask[node // 64] = 1 << (node % 64)
    return libc.syscall(number, MPOL_BIND, mask, words * 64 + 1) == 0


def pin_threads(cpus) -> None:
    """Every thread of this process on ``cpus`` (threads started later inherit it)."""
    for thread in os.listdir("/proc/self/task"):
        with contextlib.suppress(OSError):  # a thread that just ended
            os.sched_setaffinity(int(thread), cpus)
