"""tandem/host_memory.py against glibc itself, in a fresh process: decode-sized
forwards and prompts of one chunk keep their large temporaries in the heap (reused: no
page faults next time), prompt chunks over a long context map them afresh (given back
when freed: no holes in the heap) after giving the heap's free blocks back, and the
first decode after a prompt gives the prompt's blocks back."""

from __future__ import annotations

import ctypes.util
import json
import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
    reason="glibc's malloc thresholds",
)

PROBE = """
import json, torch
from tandem import host_memory

def heap_kb():
    lines = open("/proc/self/smaps").read().splitlines()
    start = next(i for i, line in enumerate(lines) if line.endswith("[heap]"))
    return next(int(line.split()[1]) for line in lines[start:] if line.startswith("Rss:"))

assert host_memory.keep_large_temporaries()
grown, given_back = {}, {}
for mode, tokens, context in (
    ("first long prompt", 2048, 8192), ("short prompt", 512, 512),
    ("next short prompt", 512, 512), ("decode", 16, 8192), ("next decode", 16, 8192),
    ("long prompt", 2048, 8192),
):
    before = heap_kb()
    host_memory.for_forward(tokens, context)
    given_back[mode] = (before - heap_kb()) / 1024
    before = heap_kb()
    for _ in range(3):  # 4 MB temporaries with interleaved lifetimes, as a layer's
        a = torch.ones(1 << 20)  # (attention's query slices are 4 MB on a 1B model)
        b = torch.ones(1 << 20)
        del a
        c = torch.ones(1 << 20)
        del b, c
    grown[mode] = (heap_kb() - before) / 1024
print(json.dumps({"grown": grown, "given_back": given_back}))
"""


def test_long_prompts_map_their_temporaries_and_short_forwards_reuse_the_heap():
    assert ctypes.util.find_library("c")
    out = subprocess.run(
        [sys.executable, "-c", PROBE], check=True, capture_output=True, text=True
    ).stdout
    measured = json.loads(out.strip().splitlines()[-1])
    grown, given_back = measured["grown"], measured["given_back"]  # MB each
    assert grown["first long prompt"] < 1  # MB: nothing of the 4 MB tensors stayed
    assert grown["short prompt"] >= 4  # kept in the heap for the next forward
    assert grown["next short prompt"] < 1  # the same blocks, reused
    assert given_back["next short prompt"] < 1
    assert given_back["decode"] >= 4  # a prompt's blocks, given back after it
    assert grown["next decode"] < 1  # a decode's, kept for the next step
    assert given_back["next decode"] < 1
    # The heap's free blocks given back before the mappings; glibc still serves some of
    # the long prompt's tensors from those blocks (faulting them in again), but the
    # heap ends smaller than the shorter forwards left it.
    assert given_back["long prompt"] >= 4
    assert grown["long prompt"] < given_back["long prompt"]
