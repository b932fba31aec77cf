"""Data parallelism at saturation: `tandem serve` with N engine cores of T threads
each against one core with all the threads, under `tandem bench serve` sending every
request at once (request rate inf), on the same requests.

A small model's step does not use many threads well (a 135M model's matrices are too
small to split over cores without the threads waiting on each other), so two cores,
each pinned to its own CPUs and running its own batch, can do more than one core
with both CPUs. The cores are pinned to CPUs of their own where one is left for the
API server (not on 2 CPUs: server/data_parallel.py). The load generator runs in this
process, on the same CPUs: it costs every layout the same. Medians of interleaved
repetitions::

    python -m benchmarks.data_parallel [--model FOLDER_OR_GGUF] [--num-prompts 64]

The model defaults to the bundled SmolLM2-135M-Instruct (float32).
"""

from __future__ import annotations

import argparse
import os

from benchmarks.common import machine
from benchmarks.serving import median_run, served
from tandem.models.bundled import DEFAULT_MODEL
from tandem.server.launch import tandem_process


def layouts(cpus: int) -> dict[str, list[str]]:
    """Each layout's flags: every one uses all ``cpus`` CPUs."""
    half = max(1, cpus // 2)
    return {
        f"1 core x {cpus} threads": ["--threads", str(cpus)],
        f"2 cores x {half} threads": ["--data-parallel-size", "2"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(DEFAULT_MODEL))
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5, help="runs per layout (medians shown)")
    parser.add_argument("--seed", type=int, default=0)
    options = parser.parse_args()
    cpus = len(os.sched_getaffinity(0))
    print(f"machine: {machine()}; {cpus} CPUs for the server")
    print(
        f"workload: {options.num_prompts} requests sent at once, {options.input_len} prompt "
        f"tokens, {options.output_len} output tokens (ignore_eos), {options.model}; "
        f"medians of {options.repeats} interleaved runs"
    )
    runs: dict[str, list[dict]] = {name: [] for name in layouts(cpus)}
    warm_up = argparse.Namespace(**{**vars(options), "num_prompts": 4})
    for _ in range(options.repeats):
        for name, flags in layouts(cpus).items():
            args = ("serve", "--model", options.model, *flags, "--log-level", "warning")
            with tandem_process(*args) as url:
                served(url, warm_up, float("inf"))  # the first steps allocate and compile
                runs[name].append(served(url, options, float("inf")))
    base = None
    print(f"{'layout':<26}{'req/s':>7}{'out tok/s':>10}{'vs 1 core':>10}"
          f"{'TTFT p50':>9}{'TPOT p50':>9}   (latencies in ms)")  # fmt: skip
    for name, results in runs.items():
        row = median_run(results)
        base = base or row["output_throughput"]
        print(
            f"{name:<26}{row['request_throughput']:>7.2f}{row['output_throughput']:>10.1f}"
            f"{row['output_throughput'] / base:>9.2f}x{row['median_ttft_ms']:>9.0f}"
            f"{row['median_tpot_ms']:>9.1f}"
        )
        if row["failed"]:
            print(f"  ({row['failed']} requests failed)")


if __name__ == "__main__":
    main()
