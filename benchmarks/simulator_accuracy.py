"""How far to trust `tandem simulate`: the same workloads measured on a real
`tandem serve` (engine process, bundled model) with `tandem bench serve`, and
simulated with the step cost model calibrated on this machine beforehand
two ways: the engine alone (`tandem plan --measure --calibrate`: a sweep of timed
steps) and through the server (`tandem plan --calibrate --from-trace`: the steps of a
served calibration load of its own, contention included, and the time a request spends
outside the engine); predicted against measured, per metric, for each.

The disaggregated cases run a prefill and a decode instance behind `tandem router`
(KV over loopback ZeroMQ); the link's rate given to the simulator is measured by a
warm-up of four requests before the run (the decode instance's transfer counters).

    python -m benchmarks.simulator_accuracy [--num-prompts 64]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import secrets

import httpx
from prometheus_client.parser import text_string_to_metric_families

from benchmarks.common import machine
from tandem.bench.datasets import LocalTokenizer
from tandem.bench.serve import add_arguments, arrival_gaps, run, workload_requests
from tandem.bench.summary import summarize
from tandem.config import EngineConfig
from tandem.models.catalog import DEFAULT_MODEL
from tandem.plan.calculator import read_model
from tandem.plan.calibrate import calibrate, frontend_seconds, trace_samples
from tandem.plan.cost import ModelShape, StepCostModel
from tandem.plan.simulate import Topology, simulate
from tandem.server.launch import tandem_process

RANDOM = ["--dataset", "random", "--random-input-len", "256", "--random-output-len", "64"]
PREFIX = [
    "--dataset", "prefix-repetition", "--prefix-repetition-prefix-len", "512",
    "--prefix-repetition-suffix-len", "64", "--prefix-repetition-num-prefixes", "4",
    "--prefix-repetition-output-len", "64",
]  # fmt: skip
# (name, server flags, workload flags, rate); "1P:1D" in a name: disaggregated
CASES = [
    ("chunked", [], RANDOM, "2"),
    ("chunked", [], RANDOM, "8"),
    ("chunked", [], RANDOM, "inf"),
    ("prefill-first", ["--scheduling-policy", "prefill-first"], RANDOM, "8"),
    ("chunked, budget 256", ["--max-num-batched-tokens", "256"], RANDOM, "4"),
    ("prefix caching", [], PREFIX, "4"),
    ("1P:1D", [], RANDOM, "2"),
    ("1P:1D", [], RANDOM, "4"),
]
METRICS = [
    ("mean TTFT", "mean_ttft_ms"), ("mean TPOT", "mean_tpot_ms"),
    ("out tok/s", "output_throughput"), ("p99 TTFT", "p99_ttft_ms"),
    ("p99 TPOT", "p99_tpot_ms"),
]  # fmt: skip
SERVER_TO_ENGINE = {"--scheduling-policy": "scheduling_policy",
                    "--max-num-batched-tokens": "max_num_batched_tokens"}  # fmt: skip


def bench_args(url: str, workload: list[str], rate: str, num_prompts: int) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args([
        "--base-url", url, "--tokenizer", str(DEFAULT_MODEL), *workload,
        "--num-prompts", str(num_prompts), "--request-rate", rate, "--ignore-eos",
        "--no-progress",
    ])  # fmt: skip


def engine_config(server_flags: list[str]) -> EngineConfig:
    options = {
        SERVER_TO_ENGINE[flag]: (int(value) if value.isdigit() else value)
        for flag, value in zip(server_flags[::2], server_flags[1::2], strict=True)
    }
    return EngineConfig.from_kwargs(str(DEFAULT_MODEL), **options)


@contextlib.contextmanager
def deployment(name: str, server_flags: list[str]):
    """The server(s) of a case; yields (URL to benchmark, topology for the simulator)."""
    serve = ["serve", "--model", str(DEFAULT_MODEL), *server_flags, "--log-level", "warning"]
    if "1P:1D" not in name:
        with tandem_process(*serve) as url:
            yield url, Topology()
        return
    secret = ["--kv-secret", secrets.token_hex(16)]
    with contextlib.ExitStack() as stack:
        prefill = stack.enter_context(tandem_process(*serve, "--role", "prefill", *secret))
        decode = stack.enter_context(tandem_process(*serve, "--role", "decode", *secret))
        router = stack.enter_context(
            tandem_process("router", "--prefill", prefill, "--decode", decode)
        )
        model = httpx.get(f"{router}/v1/models", timeout=30).json()["data"][0]["id"]
        for _ in range(4):  # warm-up: the link's rate at this prompt size
            body = {"model": model, "prompt": list(range(100, 356)), "max_tokens": 2}
            httpx.post(f"{router}/v1/completions", json=body, timeout=120).raise_for_status()
        moved = _metric(decode, "kv_transfer_bytes_total")
        seconds = _metric(decode, "kv_transfer_seconds_sum")
        print(f"  ({name}: link measured at {moved / seconds / 1e6:.0f} MB/s by a warm-up)")
        yield router, Topology(prefill=1, decode=1, link_gbs=moved / seconds / 1e9,
                               link_latency_s=0.0)  # fmt: skip


def _metric(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == f"tandem:{name}"
    )


def served_calibration(shape: ModelShape, num_prompts: int) -> StepCostModel:
    """Fit the cost model to a real server's steps under a calibration load of its own
    (another seed than the cases', one paced and one saturating run), and the time a
    request spends outside the engine from the paced run (the clients' mean TTFT
    against the engine's)."""
    serve = ["serve", "--model", str(DEFAULT_MODEL), "--log-level", "warning",
             "--enable-trace-endpoints"]  # fmt: skip
    samples, frontend = [], 0.0
    with tandem_process(*serve) as url:
        for rate in ("4", "inf"):
            httpx.post(f"{url}/trace/start", timeout=30).raise_for_status()
            args = bench_args(url, [*RANDOM, "--seed", "1234"], rate, num_prompts)
            with contextlib.redirect_stdout(io.StringIO()):
                summary = run(args)
            trace = httpx.post(f"{url}/trace/stop", timeout=120).json()
            samples += trace_samples(trace)
            if rate != "inf":
                frontend = frontend_seconds(trace, summary["mean_ttft_ms"] / 1e3)
    cost = StepCostModel.fit(shape, samples, f"fitted to {len(samples)} served steps")
    return dataclasses.replace(cost, frontend_s=frontend)


def describe(cost: StepCostModel) -> str:
    return (
        f"{cost.step_overhead_s * 1e3:.2f} ms + {cost.request_overhead_s * 1e3:.3f} ms per "
        f"request + {cost.token_overhead_s * 1e3:.3f} ms per token + max(bytes / "
        f"{cost.bandwidth_gbs:.1f} GB/s, FLOPs / {cost.tflops * 1e3:.0f} GFLOP/s), "
        f"{cost.frontend_s * 1e3:.1f} ms outside the engine; {cost.source}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-prompts", type=int, default=64)
    options = parser.parse_args()
    print(f"machine: {machine()}")
    config_model, params = read_model(DEFAULT_MODEL)
    shape = ModelShape.of(config_model, params, 4, 4)  # float32, as the CPU engine runs
    costs = {
        "engine sweep": calibrate(
            DEFAULT_MODEL, shape, "float32", config_model.max_position_embeddings
        )[0],
        "served": served_calibration(shape, options.num_prompts),
    }
    for name, cost in costs.items():
        print(f"cost model ({name}): {describe(cost)}")
    tokenizer = LocalTokenizer(str(DEFAULT_MODEL))
    rows: dict[str, list[str]] = {name: [] for name in costs}
    for name, server_flags, workload, rate in CASES:
        with deployment(name, server_flags) as (url, topology):
            args = bench_args(url, workload, rate, options.num_prompts)
            with contextlib.redirect_stdout(io.StringIO()):
                real = run(args)
        requests = workload_requests(args, tokenizer)
        gaps = arrival_gaps(len(requests), args.request_rate, args.burstiness, args.seed)
        config = engine_config(server_flags)
        for cost_name, cost in costs.items():
            simulated = simulate(
                requests, gaps, shape, cost, config, 10**6 // config.cache.block_size,
                config_model.max_position_embeddings, config_model.vocab_size, None, topology,
            )  # fmt: skip
            predicted = summarize(simulated.results, simulated.duration, {})
            cells = []
            for _, key in METRICS:
                error = predicted[key] / real[key] - 1 if real[key] else float("nan")
                cells.append(f"{predicted[key]:.1f} / {real[key]:.1f} ({error:+.0%})")
            rows[cost_name].append(" | ".join([name, rate, *cells]))
    for cost_name, lines in rows.items():
        print(f"\nsimulated ({cost_name} calibration) / measured (error):\n")
        print("| case | rate | " + " | ".join(f"{label}" for label, _ in METRICS) + " |")
        print("|---" * (2 + len(METRICS)) + "|")
        for line in lines:
            print(f"| {line} |")


if __name__ == "__main__":
    main()
