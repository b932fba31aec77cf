"""Colocated against disaggregated serving on the same two cores, bundled model.

- colocated: one `tandem serve` with both cores (2 threads);
- disaggregated: a prefill instance pinned to core 0 and a decode instance pinned to
  core 1 (1 thread each), `tandem router` in front (router and load generator float).

Workload: a mix of long prompts (900 tokens, a quarter of the requests) and short ones
(64 tokens), 64 output tokens each, Poisson arrivals at each rate, sent by
`tandem bench serve` (token-exact prompts from stdlib text). Reported: TTFT and ITL
p50/p99, goodput under the stated SLO, and from the decode instance's /metrics the
KV transfer bandwidth and its share of the mean TTFT. One traced run per setup is drawn
into docs/ (timeline-colocated.png, timeline-disagg-prefill.png,
timeline-disagg-decode.png).

    python -m benchmarks.disaggregation [--rates 1 2 4] [--num-prompts 40]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import random
import secrets
import tempfile
from pathlib import Path

import httpx

from benchmarks.common import machine
from tandem.bench.datasets import LocalTokenizer, token_pool
from tandem.bench.serve import add_arguments, run
from tandem.models.catalog import DEFAULT_MODEL
from tandem.server.launch import tandem_process
from tandem.trace.plot import plot_trace

SLO = ["ttft:1000", "tpot:60"]
LONG, SHORT, OUTPUT = 900, 64, 64


def workload_file(path: Path, num_prompts: int, seed: int) -> None:
    rng = random.Random(seed)
    pool = token_pool(LocalTokenizer(str(DEFAULT_MODEL)), 60_000, seed)
    lines = []
    for _ in range(num_prompts):
        length = LONG if rng.random() < 0.25 else SHORT
        start = rng.randrange(0, len(pool) - length)
        lines.append({"prompt": pool[start : start + length], "output_len": OUTPUT})
    path.write_text("\n".join(json.dumps(line) for line in lines))


def bench(base_url: str, dataset: Path, num_prompts: int, rate: float) -> dict:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(
        ["--base-url", base_url, "--dataset", "jsonl", "--dataset-path", str(dataset),
         "--num-prompts", str(num_prompts), "--request-rate", str(rate), "--ignore-eos",
         "--goodput", *SLO, "--no-progress", "--tokenizer", str(DEFAULT_MODEL)]
    )  # fmt: skip
    with contextlib.redirect_stdout(io.StringIO()):
        return run(args)


def transfer_totals(decode_url: str) -> tuple[float, float, float]:
    """(bytes, seconds, transfers) pulled so far by the decode instance."""
    values = {}
    for line in httpx.get(f"{decode_url}/metrics").text.splitlines():
        for name in ("kv_transfer_bytes_total", "kv_transfer_seconds_sum",
                     "kv_transfer_seconds_count"):  # fmt: skip
            if line.startswith(f"tandem:{name}"):
                values[name] = float(line.split()[-1])
    return (values.get("kv_transfer_bytes_total", 0.0), values.get("kv_transfer_seconds_sum", 0.0),
            values.get("kv_transfer_seconds_count", 0.0))  # fmt: skip


@contextlib.contextmanager
def colocated(trace: Path | None):
    flags = ["--model", "stdlib-lm", "--threads", "2", "--log-level", "warning"]
    with tandem_process("serve", *flags, *(["--trace", str(trace)] if trace else [])) as url:
        yield url, None


@contextlib.contextmanager
def disaggregated(trace: Path | None):
    secret = secrets.token_hex(16)  # the deployment's shared secret (docs/SECURITY.md)

    def role(name: str, core: int):
        flags = ["--model", "stdlib-lm", "--role", name, "--kv-secret", secret, "--threads", "1",
                 "--log-level", "warning"]  # fmt: skip
        if trace:
            flags += ["--trace", str(trace.with_name(f"{trace.stem}-{name}.json"))]
        # taskset pins the whole server process (engine and HTTP) to one core.
        return tandem_process("serve", *flags, launcher=("taskset", "-c", str(core)))

    with role("prefill", 0) as prefill, role("decode", 1) as decode, tandem_process(
        "router", "--prefill", prefill, "--decode", decode
    ) as router:  # fmt: skip
        yield router, decode


def row(name: str, rate: float, s: dict, transfer: str) -> str:
    return (
        f"{name:<15}{rate:>5g}{s['median_ttft_ms']:>9.0f}{s['p99_ttft_ms']:>8.0f}"
        f"{s['median_itl_ms']:>8.1f}{s['p99_itl_ms']:>8.1f}{s['output_throughput']:>8.0f}"
        f"{s['request_goodput']:>9.2f}  {transfer}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rates", type=float, nargs="+", default=[1, 2, 4])
    parser.add_argument("--num-prompts", type=int, default=40)
    parser.add_argument("--out", default="docs")
    options = parser.parse_args()
    print(f"machine: {machine()}; SLO {' '.join(SLO)} (ms); long {LONG} / short {SHORT} "
          f"prompt tokens (1 in 4 long), {OUTPUT} output tokens")  # fmt: skip
    print(f"{'setup':<15}{'rate':>5}{'TTFT p50':>9}{'p99':>8}{'ITL p50':>8}{'p99':>8}"
          f"{'tok/s':>8}{'goodput':>9}  KV transfer")  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        # A fresh set of prompts for every run: repeating one would hit the prefix cache.
        datasets = []
        for seed in range(len(options.rates) + 1):
            datasets.append(Path(tmp) / f"mixed-{seed}.jsonl")
            workload_file(datasets[-1], options.num_prompts, seed=seed + 10)
        for name, setup in (("colocated", colocated), ("disaggregated", disaggregated)):
            with setup(None) as (url, decode):
                bench(url, datasets[-1], 8, float("inf"))  # warm-up: first long prefills
                for rate, dataset in zip(options.rates, datasets, strict=False):
                    before = transfer_totals(decode) if decode else None
                    s = bench(url, dataset, options.num_prompts, rate)
                    transfer = ""
                    if decode:
                        after = transfer_totals(decode)
                        moved, seconds, count = (a - b for a, b in zip(after, before, strict=True))
                        mean_ms = seconds / count * 1e3 if count else 0.0
                        transfer = (
                            f"{moved / seconds / 1e9:.2f} GB/s, mean {mean_ms:.1f} ms = "
                            f"{mean_ms / s['mean_ttft_ms']:.0%} of mean TTFT"
                        )
                    print(row(name, rate, s, transfer))
            # A short traced run for the pictures.
            trace = Path(tmp) / f"{name}.json"
            small = Path(tmp) / "small.jsonl"
            workload_file(small, 12, seed=1)
            with setup(trace) as (url, _):
                bench(url, small, 12, 2.0)
            roles = ("prefill", "decode") if name == "disaggregated" else ()
            traces = [trace.with_name(f"{trace.stem}-{r}.json") for r in roles] or [trace]
            for path in traces:
                label = path.stem.replace("disaggregated", "disagg")
                picture = plot_trace(path, Path(options.out) / f"timeline-{label}.png",
                                     title=f"{label}: 12 mixed requests at 2 req/s")  # fmt: skip
                print(f"picture: {picture}")


if __name__ == "__main__":
    main()
