"""Every Triton kernel of the GPU path compiles for an H100 (sm_90) on this machine:
tests/gpu_kernel_builds.py, with the NVIDIA backend and ptxas Triton's wheel carries.
The interpreter's checks (test_gpu_kernels_interpreted.py) run the kernels' math; this
catches what only the compiler refuses (it found a kernel helper whose two returns had
different types, which the interpreter ran). A process of its own: the script says it
has a CUDA device before tandem defines its kernels."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

CHECKOUT = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="pip install triton")
def test_every_gpu_kernel_compiles_for_an_h100(tmp_path):
    env = {**os.environ, "TRITON_DEFAULT_FP_FUSION": "1", "PYTHONPATH": str(CHECKOUT),
           "TRITON_CACHE_DIR": str(tmp_path)}  # fmt: skip
    env.pop("TRITON_INTERPRET", None)
    done = subprocess.run(
        [sys.executable, "tests/gpu_kernel_builds.py"], cwd=CHECKOUT, env=env,
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    report = done.stdout[-6000:] + done.stderr[-4000:]
    assert done.returncode == 0, report
    # 6 Q4_0/Q8_0 block kernels, 27 for the other formats (3 each of 9 formulas and d
    # types), 18 attention and K/V-write variants (3 cache types: 5 attention tiles, 2
    # of them with sinks, and a write) and 3 of the split merge (1 with sinks), 3
    # per-token kernels
    assert done.stdout.count(" bytes, ") == 63, report
