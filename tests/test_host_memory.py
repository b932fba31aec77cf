"""runner/host_memory.py against glibc itself, in a fresh process: decode-sized
forwards keep their large temporaries in the heap (reused: no page faults next step),
prompt-sized ones map them afresh (given back when freed: no holes in the heap)."""

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
from tandem.runner import host_memory

def heap_kb():
    lines = open("/proc/self/smaps").read().splitlines()
    start = next(i for i, line in enumerate(lines) if line.endswith("[heap]"))
    return next(int(line.split()[1]) for line in lines[start:] if line.startswith("Rss:"))

assert host_memory.keep_large_temporaries()
grown = {}
for mode, tokens in (("prompt", 2048), ("decode", 16)):
    host_memory.for_forward(tokens)
    before = heap_kb()
    for _ in range(3):  # 4 MB temporaries with interleaved lifetimes, as a layer's
        a = torch.ones(1 << 20)  # (attention's query slices are 4 MB on a 1B model)
        b = torch.ones(1 << 20)
        del a
        c = torch.ones(1 << 20)
        del b, c
    grown[mode] = (heap_kb() - before) / 1024
print(json.dumps(grown))
"""


def test_prompt_forwards_map_their_temporaries_and_decodes_reuse_the_heap():
    assert ctypes.util.find_library("c")
    out = subprocess.run(
        [sys.executable, "-c", PROBE], check=True, capture_output=True, text=True
    ).stdout
    grown = json.loads(out.strip().splitlines()[-1])
    assert grown["prompt"] < 1  # MB: nothing of the 4 MB tensors stayed in the heap
    assert grown["decode"] >= 4  # kept in the heap for the next step
