"""The GPU path's Triton kernels, without a GPU: tests/test_cuda.py's kernel checks
(the block matmuls of every GGUF format, a layer of block parts, the norms, rotary and
gates) and tests/test_attention.py's Triton attention checks, run in Triton's
interpreter (TRITON_INTERPRET=1) against the same references as on a GPU.

They run in a pytest process of their own: Triton reads TRITON_INTERPRET when its
kernels are defined, and tandem imports Triton only where it can run
(kernels/triton_support.py), so a process that runs them keeps Triton loaded (73 MB
resident), which this process's memory tests would count. On a GPU machine the two
files run there directly (README: "On an NVIDIA GPU")."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

CHECKOUT = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="pip install triton")
@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU runs the kernel tests themselves")
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="this run interprets them")
def test_the_gpu_kernels_pass_their_checks_in_tritons_interpreter():
    command = [
        sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
        "tests/test_cuda.py", "tests/test_attention.py", "-k", "not attention or triton",
    ]  # fmt: skip
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run(command, cwd=CHECKOUT, env=env, capture_output=True, text=True,
                          timeout=600)  # fmt: skip
    report = done.stdout[-6000:] + done.stderr[-2000:]
    assert done.returncode == 0, report
    passed = re.search(r"(\d+) passed", done.stdout)
    # 57 block-matmul and layer checks, the norm/rotary/gate check, and the Triton
    # attention checks: a count far below means they were skipped, not run
    assert passed is not None and int(passed.group(1)) >= 70, report
