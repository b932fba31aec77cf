"""How long a model named by its Hugging Face id takes to start, beside the same files
as a local folder: ``LLM(...)`` timed inside fresh processes (the interpreter and the
imports left out), alternating, medians. The hub is the tests' stand-in on 127.0.0.1
(tests/fake_hub.py: the routes huggingface_hub calls), so "online" is one repository
listing and one HEAD a file over loopback, and "offline" (HF_HUB_OFFLINE=1) reads the
cache alone.

    python -m benchmarks.hub_startup [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.common import machine, smollm2_shaped_with_tokenizer
from tests.fake_hub import FakeHub, serving

REPO = "bench/smollm2-shape"
CHILD = """
import json, sys, time
from tandem import LLM
start = time.perf_counter()
LLM(sys.argv[1])
print(json.dumps(time.perf_counter() - start))
"""


def _start(name: str, env: dict[str, str]) -> float:
    done = subprocess.run([sys.executable, "-c", CHILD, name], env=env, check=True,
                          capture_output=True, text=True)  # fmt: skip
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    print(machine())
    folder = smollm2_shaped_with_tokenizer()
    with tempfile.TemporaryDirectory() as home, serving(FakeHub({REPO: folder})) as url:
        env = {
            **os.environ,
            "HF_HOME": home,
            "HF_ENDPOINT": url,
            "HF_HUB_DISABLE_PROGRESS_BARS": "1",
        }
        subprocess.run([sys.executable, "-m", "tandem", "pull", REPO], env=env, check=True,
                       capture_output=True)  # fmt: skip
        offline = {**env, "HF_HUB_OFFLINE": "1"}
        cases = {"local folder": (str(folder), env), "hub id, online": (REPO, env),
                 "hub id, offline": (REPO, offline)}  # fmt: skip
        times: dict[str, list[float]] = {case: [] for case in cases}
        for _ in range(args.repeats):
            for case, (name, case_env) in cases.items():
                times[case].append(_start(name, case_env))
    size = sum(p.stat().st_size for p in Path(folder).iterdir() if p.is_file()) / 1e6
    print(f"SmolLM2-135M's shape, float32 safetensors, {size:.0f} MB; median of {args.repeats}:")
    base = statistics.median(times["local folder"])
    for case, values in times.items():
        median = statistics.median(values)
        print(f"  {case}: {median * 1e3:.0f} ms ({median / base:.2f}x; runs "
              f"{', '.join(f'{v * 1e3:.0f}' for v in values)})")  # fmt: skip


if __name__ == "__main__":
    main()
