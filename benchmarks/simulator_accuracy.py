"""How far to trust `tandem simulate`: the same workloads measured on a real
`tandem serve` (engine process, bundled model) with `tandem bench serve`, and
simulated with the step cost model calibrated on this machine beforehand
(`tandem plan --measure --calibrate`); predicted against measured, per metric.

The disaggregated cases run a prefill and a decode instance behind `tandem router`
(KV over loopback ZeroMQ); the link's rate given to the simulator is measured by a
warm-up of four requests before the run (the decode instance's transfer counters).

    python -m benchmarks.simulator_accuracy [--num-prompts 64]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import secrets

import httpx
from prometheus_client.parser import text_string_to_metric_families

from benchmarks.common import machine
from tandem.bench.datasets import LocalTokenizer
from tandem.bench.serve import add_arguments, arrival_gaps, run, workload_requests
from tandem.bench.summary import summarize
from tandem.config import EngineConfig
from tandem.models.bundled import DEFAULT_MODEL
from tandem.plan.calculator import read_model
from tandem.plan.calibrate import calibrate
from tandem.plan.cost import ModelShape
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-prompts", type=int, default=64)
    options = parser.parse_args()
    print(f"machine: {machine()}")
    config_model, params = read_model(DEFAULT_MODEL)
    shape = ModelShape.of(config_model, params, 4, 4)  # float32, as the CPU engine runs
    cost, samples = calibrate(DEFAULT_MODEL, shape, "float32", config_model.max_position_embeddings)
    print(
        f"cost model: {cost.step_overhead_s * 1e3:.2f} ms + {cost.request_overhead_s * 1e3:.3f} "
        f"ms per request + {cost.token_overhead_s * 1e3:.3f} ms per token + max(bytes / "
        f"{cost.bandwidth_gbs:.1f} GB/s, FLOPs / {cost.tflops * 1e3:.0f} GFLOP/s), fitted to "
        f"{len(samples)} steps\n"
    )
    print(f"{'case':<22}{'rate':>5}  " + "".join(f"{name:>24}" for name, _ in METRICS))
    print(f"{'':<29}" + "".join(f"{'sim / real (error)':>24}" for _ in METRICS))
    tokenizer = LocalTokenizer(str(DEFAULT_MODEL))
    for name, server_flags, workload, rate in CASES:
        with deployment(name, server_flags) as (url, topology):
            args = bench_args(url, workload, rate, options.num_prompts)
            with contextlib.redirect_stdout(io.StringIO()):
                real = run(args)
        requests = workload_requests(args, tokenizer)
        gaps = arrival_gaps(len(requests), args.request_rate, args.burstiness, args.seed)
        config = engine_config(server_flags)
        simulated = simulate(
            requests, gaps, shape, cost, config, 10**6 // config.cache.block_size,
            config_model.max_position_embeddings, config_model.vocab_size, None, topology,
        )  # fmt: skip
        predicted = summarize(simulated.results, simulated.duration, {})
        cells = []
        for _, key in METRICS:
            error = predicted[key] / real[key] - 1 if real[key] else float("nan")
            cells.append(f"{predicted[key]:>9.1f} / {real[key]:>6.1f} ({error:+.0%})")
        print(f"{name:<22}{rate:>5}  " + "".join(f"{c:>24}" for c in cells))


if __name__ == "__main__":
    main()
