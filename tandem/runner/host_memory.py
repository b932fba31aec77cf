"""Keep the CPU forward's large temporaries in the heap instead of fresh mappings
(and give memory back after one-off large requests: ``give_back``).

glibc serves allocations above its mmap threshold (128 KiB at start, raised as such
blocks are freed, to at most 32 MiB) with a new mapping each time, and returns heap
memory above the trim threshold to the system at every free. A decode step allocates
and frees the same multi-MB tensors every time (activations, [batch, vocab] logits),
so each step then pays a minor page fault per 4 KiB page touched: 2,500-6,000 faults
a step at batch 64 on a 135M model, 13% of the step (``python -m
benchmarks.step_overhead``, its ``faults`` column; 240-330 with this). Raising both
thresholds once lets
those buffers be reused from the heap; the price is that up to the peak of such
temporaries stays resident between steps, which an inference process wants anyway.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging

logger = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_MAX = 32 << 20  # glibc's ceiling on 64-bit systems
TRIM_THRESHOLD = 1 << 30


@functools.cache
def _libc():
    try:
        return ctypes.CDLL(ctypes.util.find_library("c"))
    except (OSError, TypeError):
        return None


@functools.cache
def keep_large_temporaries() -> bool:
    """Raise glibc's mmap and trim thresholds (once per process). False where the C
    library is not glibc, which leaves everything as it was."""
    mallopt = getattr(_libc(), "mallopt", None)
    if mallopt is None:
        return False
    ok = mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX) == 1
    ok = mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1 and ok
    if not ok:
        logger.debug("mallopt refused the thresholds; large temporaries stay mmapped")
    return ok


def give_back() -> None:
    """Return the heap's free memory to the system (glibc's malloc_trim): after a
    one-off large allocation, such as tokenizing a multi-megabyte request, which the
    raised trim threshold would otherwise keep resident for good."""
    trim = getattr(_libc(), "malloc_trim", None)
    if trim is not None:
        trim(0)
