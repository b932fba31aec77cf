"""Keep the CPU forward's large temporaries in the heap instead of fresh mappings
(and give memory back after one-off large requests: ``give_back``).

glibc serves allocations above its mmap threshold (128 KiB at start, raised as such
blocks are freed, to at most 32 MiB) with a new mapping each time, and returns heap
memory above the trim threshold to the system at every free. A decode step allocates
and frees the same multi-MB tensors every time (activations, [batch, vocab] logits),
so each step then pays a minor page fault per 4 KiB page touched, thousands a step at
large batches (``python -m benchmarks.step_overhead``, its ``faults`` column). Raising
both thresholds once lets those buffers be reused from the heap; the price is that up
to the peak of such temporaries stays resident between steps, which an inference
process wants anyway.

Prompt chunks over a long context are another matter: a 2,048-token chunk's
temporaries are 8-32 MB each with interleaved lifetimes (the residual stream, q/k/v,
attention's outputs), and the ones attention takes for a long prefix (its spans of
cached rows, its query slices' partial outputs) change size as the context grows; in
the heap they fragment it (the process grows by the free holes left between them). So a
forward of many tokens over a context longer than LONG_CONTEXT_TOKENS
(``for_forward``) lowers the mmap threshold to 4 MiB for its duration: its
temporaries of a few MB and more (attention's query slices of 4 MB included) are
fresh mappings, given back when freed, and the heap keeps the decode steps' sizes
(the heap's free blocks are given back first, so that a shorter forward's do not
stay resident beside them). The price is a page fault per 4 KiB they touch. A prompt
that fits in one chunk keeps its temporaries in the heap: its shapes are the same in
every layer, so they are faulted in once per prompt (or once for prompts back to
back), not once per layer, for a little more memory at its peak. The first decode
step after it gives those blocks back. The measurements behind both choices:
docs/lab-notes/real-size-files.md.
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
# Forwards of more tokens than PROMPT_TOKENS over a context of more than
# LONG_CONTEXT_TOKENS (one default chunk: a long prompt's later chunks) map their
# temporaries of PROMPT_MMAP_THRESHOLD bytes and more afresh.
PROMPT_TOKENS = 256
LONG_CONTEXT_TOKENS = 2048
PROMPT_MMAP_THRESHOLD = 4 << 20  # 16 MiB kept attention's 4 MB slices in the heap

_threshold: int | None = None  # the mmap threshold set last (None: glibc's own)
_prompt_in_heap = False  # the last forward was a prompt's, its temporaries in the heap


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
    ok = _set_mmap_threshold(MMAP_THRESHOLD_MAX)
    ok = mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1 and ok
    if not ok:
        logger.debug("mallopt refused the thresholds; large temporaries stay mmapped")
    return ok


def _set_mmap_threshold(size: int) -> bool:
    global _threshold
    if _threshold == size:
        return True
    mallopt = getattr(_libc(), "mallopt", None)
    if mallopt is None or mallopt(M_MMAP_THRESHOLD, size) != 1:
        return False
    _threshold = size
    return True


def for_forward(num_tokens: int, context_tokens: int) -> None:
    """Before a CPU forward of ``num_tokens`` whose longest sequence attends to
    ``context_tokens`` (its cached prefix and its own tokens): a prompt chunk over a
    long context maps its large temporaries afresh, other forwards reuse the heap (the
    module's docstring). The heap's free blocks go back to the system when a long
    chunk follows shorter forwards and when a decode-sized forward follows a prompt's
    (back-to-back prompts keep reusing them). Nothing where
    ``keep_large_temporaries`` has not raised the thresholds."""
    global _prompt_in_heap
    if _threshold is None:
        return
    prompt = num_tokens > PROMPT_TOKENS
    long_context = prompt and context_tokens > LONG_CONTEXT_TOKENS
    if long_context:
        if _threshold != PROMPT_MMAP_THRESHOLD:
            give_back()  # shorter forwards' free blocks, not kept beside the mappings
        _set_mmap_threshold(PROMPT_MMAP_THRESHOLD)
    else:
        if _prompt_in_heap and not prompt:
            give_back()  # a prompt's temporaries, more than decode steps need
        _set_mmap_threshold(MMAP_THRESHOLD_MAX)
    _prompt_in_heap = prompt and not long_context


def give_back() -> None:
    """Return the heap's free memory to the system (glibc's malloc_trim): after a
    one-off large allocation, such as tokenizing a multi-megabyte request, which the
    raised trim threshold would otherwise keep resident for good."""
    trim = getattr(_libc(), "malloc_trim", None)
    if trim is not None:
        trim(0)
