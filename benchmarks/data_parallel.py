"""Data parallelism at saturation: `tandem serve` with N engine cores of T threads
each against one core with all the threads, under `tandem bench serve` sending every
request at once (request rate inf), on the same requests.

A small model's step does not use many threads well (a 135M model's matrices are too
small to split over cores without the threads waiting on each other), so two cores,
each pinned to its own CPUs and running its own batch, can do more than one core
with both CPUs. The cores are pinned to CPUs of their own where one is left for the
API server (not on 2 CPUs: serving/data_parallel.py). The load generator runs in this
process, on the same CPUs: it costs every layout the same.

Then the engines alone, without HTTP: the same requests split between N processes of
the offline engine (each on its own CPUs, T threads), started together, against one
process with all the threads: the most data parallelism can give here, before the API
server and the clients take their share of the CPUs. Medians of interleaved
repetitions::

    python -m benchmarks.data_parallel [--model FOLDER_OR_GGUF] [--num-prompts 64]
    python -m benchmarks.data_parallel --routing   # least-busy against prefix routing

The model defaults to the bundled SmolLM2-135M-Instruct (float32).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import statistics
import subprocess
import sys
import time

from benchmarks.common import machine
from benchmarks.serving import median_run, served
from tandem.executor.cpus import cpu_share, pin_threads
from tandem.models.catalog import DEFAULT_MODEL
from tandem.server.launch import tandem_process


def layouts(cpus: int) -> dict[str, list[str]]:
    """Each layout's flags: every one uses all ``cpus`` CPUs."""
    half = max(1, cpus // 2)
    return {
        f"1 core x {cpus} threads": ["--threads", str(cpus)],
        f"2 cores x {half} threads": ["--data-parallel-size", "2"],
    }


def engine_point(model: str, threads: int, prompts: int, options) -> None:
    """(``--point``) Load, say ready, wait for "go" on stdin, generate, print the
    wall-clock start and end of the generation and its tokens."""
    import torch

    from tandem import LLM, SamplingParams
    from tandem.bench.datasets import LocalTokenizer, random_requests

    pin_threads([int(cpu) for cpu in options.cpus.split(",")])
    torch.set_num_threads(threads)
    requests = random_requests(
        LocalTokenizer(str(DEFAULT_MODEL)), prompts, options.input_len, options.output_len,
        0.0, options.seed,
    )  # fmt: skip
    llm = LLM(model)
    params = SamplingParams(temperature=0, max_tokens=options.output_len, ignore_eos=True)
    batch = [{"prompt_token_ids": r.prompt_token_ids} for r in requests]
    llm.generate(batch[:2], params, use_tqdm=False)  # the first steps allocate
    print("ready", flush=True)
    sys.stdin.readline()
    start = time.time()
    outputs = llm.generate(batch, params, use_tqdm=False)
    end = time.time()
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    print(json.dumps({"start": start, "end": end, "tokens": tokens}), flush=True)


def engines_alone(options, processes: int, cpus: list[int]) -> float:
    """Output tokens/s of ``processes`` offline engines splitting the requests, each
    pinned to its share of ``cpus``, released together."""
    shares = [cpu_share(cpus, processes, i) or cpus for i in range(processes)]
    children = []
    for index, share in enumerate(shares):
        prompts = len(range(index, options.num_prompts, processes))
        command = [
            sys.executable, "-m", "benchmarks.data_parallel", "--point", str(len(share)),
            str(prompts), "--model", options.model, "--input-len", str(options.input_len),
            "--output-len", str(options.output_len), "--seed", str(options.seed + index),
        ]  # fmt: skip
        command += ["--cpus", ",".join(map(str, share))]
        pipes = {"stdin": subprocess.PIPE, "stdout": subprocess.PIPE, "text": True}
        children.append(subprocess.Popen(command, **pipes))
    for child in children:
        assert child.stdout.readline().strip() == "ready"
    for child in children:
        child.stdin.write("go\n")
        child.stdin.flush()
    results = [json.loads(child.stdout.readline()) for child in children]
    for child in children:
        child.wait()
    wall = max(r["end"] for r in results) - min(r["start"] for r in results)
    return sum(r["tokens"] for r in results) / wall


def prefix_hit_rate(url: str) -> tuple[float, float]:
    """(hits, queries) of every core's prefix cache so far, in tokens."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    totals = {"tandem:prefix_cache_hits_total": 0.0, "tandem:prefix_cache_queries_total": 0.0}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics").text):
        for sample in family.samples:
            if sample.name in totals:
                totals[sample.name] += sample.value
    return totals["tandem:prefix_cache_hits_total"], totals["tandem:prefix_cache_queries_total"]


def routing(options) -> None:
    """Two cores, least-busy against prefix routing, on prompts that share their starts
    (vLLM's prefix-repetition workload) with more distinct starts than one core's
    cache holds and fewer than two caches hold."""
    from tandem.bench.serve import add_arguments as bench_arguments
    from tandem.bench.serve import run as bench_run

    print(
        f"\nrouting: {options.num_prompts} requests at once, {options.prefixes} prompt starts "
        f"of {options.prefix_len} tokens (+64 of their own, 32 out), each core's cache "
        f"{options.cache_blocks} blocks of 16 tokens"
    )
    results: dict[str, list[tuple[float, float, float]]] = {"least-busy": [], "prefix": []}
    for _ in range(options.repeats):
        for policy in results:
            flags = ("--data-parallel-size", "2", "--data-parallel-routing", policy,
                     "--num-blocks", str(options.cache_blocks),
                     "--log-level", "warning")  # fmt: skip
            with tandem_process("serve", "--model", options.model, *flags) as url:
                parser = argparse.ArgumentParser()
                bench_arguments(parser)
                args = parser.parse_args([
                    "--base-url", url, "--tokenizer", str(DEFAULT_MODEL), "--no-progress",
                    "--dataset", "prefix-repetition", "--num-prompts", str(options.num_prompts),
                    "--prefix-repetition-prefix-len", str(options.prefix_len),
                    "--prefix-repetition-suffix-len", "64",
                    "--prefix-repetition-num-prefixes", str(options.prefixes),
                    "--prefix-repetition-output-len", "32", "--ignore-eos",
                    "--seed", str(options.seed),
                ])  # fmt: skip
                with contextlib.redirect_stdout(io.StringIO()):
                    summary = bench_run(args)
                hits, queries = prefix_hit_rate(url)
                results[policy].append(
                    (summary["output_throughput"], summary["median_ttft_ms"], hits / queries)
                )
    print(f"{'routing':<12}{'out tok/s':>10}{'TTFT p50 ms':>13}{'prefix hits':>13}")
    for policy, runs in results.items():
        throughput, ttft, hit = (statistics.median(r[i] for r in runs) for i in range(3))
        print(f"{policy:<12}{throughput:>10.1f}{ttft:>13.0f}{hit:>12.0%}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(DEFAULT_MODEL))
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5, help="runs per layout (medians shown)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--point", nargs=2, type=int, metavar=("THREADS", "PROMPTS"),
                        help=argparse.SUPPRESS)  # fmt: skip
    parser.add_argument("--cpus", help=argparse.SUPPRESS)
    parser.add_argument(
        "--routing", action="store_true",
        help="only the routing comparison: least-busy against prefix on shared prompt starts",
    )  # fmt: skip
    parser.add_argument("--prefixes", type=int, default=12)
    parser.add_argument("--prefix-len", type=int, default=512)
    parser.add_argument("--cache-blocks", type=int, default=320)
    options = parser.parse_args()
    if options.point:
        engine_point(options.model, *options.point, options)
        return
    if options.routing:
        print(f"machine: {machine()}")
        routing(options)
        return
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
    allowed = sorted(os.sched_getaffinity(0))
    alone: dict[int, list[float]] = {1: [], 2: []}
    for _ in range(options.repeats):
        for processes in alone:
            alone[processes].append(engines_alone(options, processes, allowed))
    one = statistics.median(alone[1])
    print("\nthe engines alone (offline, no HTTP), output tok/s:")
    for processes, figures in alone.items():
        threads = max(1, len(allowed) // processes)
        print(
            f"{processes} process(es) x {threads} threads{'':<6}"
            f"{statistics.median(figures):>10.1f}{statistics.median(figures) / one:>9.2f}x"
        )


if __name__ == "__main__":
    main()
