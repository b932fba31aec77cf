"""`tandem bench serve` against `tandem serve` on the bundled model: request rates up
to saturation, with the engine core in its own process (the default) and on a thread
of the server's process (``--no-engine-process``), and, with ``--policies``, under
each scheduling policy. Yardsticks from the offline engine on the same requests:
throughput with everything queued at once (no HTTP, no arrivals), and the TPOT of
one request alone (what a lightly loaded server should give).

    python -m benchmarks.serving [--num-prompts 32] [--rates 2,4,8,16,inf] [--policies]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import itertools
import math
import statistics
import time

from benchmarks.common import machine
from tandem import LLM
from tandem.bench.datasets import LocalTokenizer, random_requests
from tandem.bench.serve import add_arguments, arrival_gaps, run
from tandem.bench.summary import percentile
from tandem.models.catalog import DEFAULT_MODEL
from tandem.sampling import RequestOutputKind
from tandem.server.launch import tandem_process

SETTINGS = {
    "engine process": [],
    "in-process": ["--no-engine-process"],
}
POLICIES = {
    "chunked, budget 2048": ["--scheduling-policy", "chunked"],
    "chunked, budget 256": ["--scheduling-policy", "chunked", "--max-num-batched-tokens", "256"],
    "prefill-first": ["--scheduling-policy", "prefill-first"],
}


def offline_replay(llm: LLM, prompts: list[dict], output_len: int, gaps: list[float]) -> dict:
    """The offline engine on the same requests arriving on the same schedule, with the
    server's sampling (the model's generation_config, greedy): each is added when its
    time comes and the engine steps while it has work (no HTTP, no processes).
    Returns what a bench summary has, for the columns printed."""
    engine = llm.engine
    params = dataclasses.replace(
        llm.get_default_sampling_params(), temperature=0, max_tokens=output_len,
        ignore_eos=True, output_kind=RequestOutputKind.FINAL_ONLY,
    )  # fmt: skip
    arrivals = list(itertools.accumulate([0.0, *gaps[:-1]]))
    finished = []
    start = time.perf_counter()
    added = 0
    while added < len(prompts) or engine.has_unfinished_requests():
        now = time.perf_counter() - start
        while added < len(prompts) and arrivals[added] <= now:
            engine.add_request(f"r{added}", prompts[added], params, start + arrivals[added])
            added += 1
        if engine.has_unfinished_requests():
            finished += [o for o in engine.step() if o.finished]
        else:
            time.sleep(max(0.0, arrivals[added] - (time.perf_counter() - start)))
    elapsed = time.perf_counter() - start
    metrics = [o.metrics for o in finished]
    ttfts = sorted(m.ttft * 1e3 for m in metrics)
    tpots = sorted(m.tpot * 1e3 for m in metrics)
    itls = sorted(gap * 1e3 for m in metrics for gap in m.inter_token_latencies)
    return {
        "request_throughput": len(finished) / elapsed,
        "output_throughput": sum(len(o.outputs[0].token_ids) for o in finished) / elapsed,
        "median_ttft_ms": percentile(ttfts, 50), "p99_ttft_ms": percentile(ttfts, 99),
        "median_tpot_ms": percentile(tpots, 50), "p99_tpot_ms": percentile(tpots, 99),
        "median_itl_ms": percentile(itls, 50), "p99_itl_ms": percentile(itls, 99),
        "failed": 0,
    }  # fmt: skip


def served(base_url: str, options: argparse.Namespace, rate: float) -> dict:
    """`tandem bench serve` against a running server (this process is the client)."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(
        [
            "--base-url", base_url, "--tokenizer", str(DEFAULT_MODEL),
            "--num-prompts", str(options.num_prompts),
            "--random-input-len", str(options.input_len),
            "--random-output-len", str(options.output_len),
            "--ignore-eos", "--request-rate", str(rate),
            "--seed", str(options.seed), "--no-progress",
        ]
    )  # fmt: skip
    with contextlib.redirect_stdout(io.StringIO()):
        return run(args)


ROW_KEYS = (
    "request_throughput", "output_throughput", "median_ttft_ms", "p99_ttft_ms",
    "median_tpot_ms", "p99_tpot_ms", "median_itl_ms", "p99_itl_ms", "failed",
)  # fmt: skip


def median_run(runs: list[dict]) -> dict:
    """Each figure of the table, its median over repeated runs."""
    return {key: statistics.median(r[key] for r in runs) for key in ROW_KEYS}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--rates", default="2,4,8,16,inf")
    parser.add_argument("--repeats", type=int, default=3, help="runs per cell (medians shown)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--policies", action="store_true", help="also each scheduling policy (engine process)"
    )
    options = parser.parse_args()
    rates = [float(r) for r in options.rates.split(",")]
    print(f"machine: {machine()}")
    print(
        f"workload: {options.num_prompts} requests, {options.input_len} prompt tokens, "
        f"{options.output_len} output tokens (ignore_eos), bundled model, float32; medians "
        f"of {options.repeats} interleaved runs; 'vs offline': the offline engine on the "
        "same requests, arrival times and sampling"
    )
    header = (
        f"{'setting':<22}{'rate':>6}{'req/s':>7}{'out tok/s':>10}{'vs offline':>11}"
        f"{'TTFT p50':>9}{'p99':>7}{'TPOT p50':>9}{'p99':>7}{'vs offline':>11}"
        f"{'ITL p50':>8}{'p99':>7}"
    )
    print(header + "   (latencies in ms)")
    requests = random_requests(
        LocalTokenizer(str(DEFAULT_MODEL)), options.num_prompts, options.input_len,
        options.output_len, 0.0, options.seed,
    )  # fmt: skip
    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in requests]
    llm = LLM(str(DEFAULT_MODEL))
    offline_replay(llm, prompts[:2], options.output_len, [0.0, 0.0])  # warm up
    settings = {**SETTINGS, **(POLICIES if options.policies else {})}
    with contextlib.ExitStack() as servers:
        urls = {
            name: servers.enter_context(
                tandem_process("serve", "--model", "stdlib-lm", *flags, "--log-level", "warning")
            )
            for name, flags in settings.items()
        }  # every server idle but the one measured
        for rate in rates:
            runs: dict[str, list[dict]] = {"offline engine": [], **{name: [] for name in urls}}
            gaps = arrival_gaps(len(prompts), rate, 1.0, options.seed)
            for _ in range(options.repeats):  # interleaved: a slow minute hits all alike
                runs["offline engine"].append(
                    offline_replay(llm, prompts, options.output_len, gaps)
                )
                for name, url in urls.items():
                    runs[name].append(served(url, options, rate))
            offline = median_run(runs["offline engine"])
            for name, results in runs.items():
                print(row(name, rate, median_run(results), offline))


def row(name: str, rate: float, s: dict, offline: dict) -> str:
    rate_text = "inf" if math.isinf(rate) else f"{rate:g}"
    return (
        f"{name:<22}{rate_text:>6}{s['request_throughput']:>7.2f}"
        f"{s['output_throughput']:>10.0f}"
        f"{s['output_throughput'] / offline['output_throughput']:>10.2f}x"
        f"{s['median_ttft_ms']:>9.0f}{s['p99_ttft_ms']:>7.0f}"
        f"{s['median_tpot_ms']:>9.1f}{s['p99_tpot_ms']:>7.1f}"
        f"{s['median_tpot_ms'] / offline['median_tpot_ms']:>10.2f}x"
        f"{s['median_itl_ms']:>8.1f}{s['p99_itl_ms']:>7.1f}"
        + (f"  ({s['failed']} failed)" if s["failed"] else "")
    )


if __name__ == "__main__":
    main()
