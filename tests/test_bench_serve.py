"""`tandem bench serve` against a real `tandem serve`: a short run whose figures agree
with each other and with what the server counted; the metric math against direct
computation."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from tandem.bench.client import RequestResult
from tandem.bench.summary import parse_goodput, percentile, summarize
from tandem.errors import TandemError
from tests.servers import metric


def bench(base_url: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tandem", "bench", "serve", "--base-url", base_url,
         "--no-progress", *args],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_a_short_run_is_consistent_with_the_server(tiny_server, tmp_path, endpoint):
    before = metric(tiny_server, "generation_tokens_total")
    result_file = tmp_path / "result.json"
    run = bench(
        tiny_server, "--endpoint", endpoint, "--num-prompts", "12", "--random-input-len", "40",
        "--random-output-len", "10", "--request-rate", "40", "--ignore-eos", "--seed", "3",
        "--goodput", "ttft:60000", "e2el:60000", "--save-result", str(result_file),
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert "Serving Benchmark Result" in run.stdout and "Mean TTFT (ms)" in run.stdout
    record = json.loads(result_file.read_text())
    assert record["completed"] == 12 and record["failed"] == 0
    assert all(record["success"])
    assert record["output_lens"] == [10] * 12  # ignore_eos: exactly the asked length
    if endpoint == "completions":
        assert record["input_lens"] == [40] * 12  # token-exact prompts
    for ttft, e2el, itls, tpot in zip(
        record["ttfts"], record["e2els"], record["itls"], record["tpots"], strict=True
    ):
        assert 0 < ttft <= e2el
        assert sum(itls) <= e2el - ttft + 1e-6
        assert tpot == pytest.approx((e2el - ttft) / 9)
    # Every generated token was counted by the server too (plus the probe request's 10).
    assert (
        metric(tiny_server, "generation_tokens_total") - before == sum(record["output_lens"]) + 10
    )
    assert record["total_output_tokens"] == 120
    assert record["request_goodput"] == pytest.approx(record["request_throughput"])
    assert record["mean_ttft_ms"] == pytest.approx(np.mean(record["ttfts"]) * 1e3)


def test_failed_requests_are_counted_not_dropped(tiny_server, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    lines = [{"prompt": "def f(x):", "output_len": 4}, {"prompt": "word " * 600}]
    prompts.write_text("\n".join(json.dumps(line) for line in lines))
    result_file = tmp_path / "result.json"
    run = bench(
        tiny_server, "--dataset", "jsonl", "--dataset-path", str(prompts), "--num-prompts", "4",
        "--random-output-len", "4", "--save-result", str(result_file),
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    record = json.loads(result_file.read_text())
    assert record["completed"] == 2 and record["failed"] == 2
    assert record["success"] == [True, False, True, False]
    assert "HTTP 400" in record["errors"][1] and "max_model_len" in record["errors"][1]
    assert "2 requests failed" in run.stdout


def test_an_unreachable_server_is_one_line(tmp_path):
    run = bench("http://127.0.0.1:9", "--num-prompts", "1")
    assert run.returncode == 2
    assert run.stderr.strip().startswith("tandem: error: cannot reach")


def test_percentiles_match_numpy():
    values = list(np.random.default_rng(0).exponential(size=101))
    for p in (0, 50, 90, 99, 100):
        assert percentile(values, p) == pytest.approx(np.percentile(values, p))


def test_summary_math_and_goodput():
    fast = RequestResult(True, ttft=0.1, itl=[0.02, 0.02], e2el=0.14, prompt_len=5, output_len=3)
    slow = RequestResult(True, ttft=0.9, itl=[0.05], e2el=0.95, prompt_len=7, output_len=2)
    failed = RequestResult(False, error="HTTP 500")
    slos = parse_goodput(["ttft:500", "tpot:30"])
    summary = summarize([fast, slow, failed], duration=2.0, slos=slos)
    assert summary["completed"] == 2 and summary["failed"] == 1
    assert summary["mean_tpot_ms"] == pytest.approx((20 + 50) / 2)
    assert summary["median_itl_ms"] == pytest.approx(20)
    assert summary["request_goodput"] == pytest.approx(0.5)  # only the fast one meets both
    assert summary["output_throughput"] == pytest.approx(2.5)
    with pytest.raises(TandemError):
        parse_goodput(["latency:5"])
