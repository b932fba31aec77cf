"""`tandem simulate`: the real scheduler on simulated time. With a constant step cost
the timings are hand-countable; chunking follows the real token budget; a seed makes
a run repeat exactly; the CLI prints bench serve's table."""

from __future__ import annotations

import itertools
import subprocess
import sys

import pytest

from tandem.bench.datasets import BenchRequest
from tandem.bench.serve import arrival_gaps
from tandem.config import EngineConfig
from tandem.engine.clock import now as clock_now
from tandem.plan.cost import ModelShape, StepCostModel
from tandem.plan.simulate import simulate

SHAPE = ModelShape(params=10**6, weight_bytes=4e6, kv_bytes_per_token=1e3, num_layers=2,
                   attention_width=64)  # fmt: skip
TEN_MS = StepCostModel(bandwidth_gbs=float("inf"), tflops=float("inf"), step_overhead_s=0.01)


def run(requests, gaps, cost=TEN_MS, **engine):
    config = EngineConfig.from_kwargs("unused", **engine)
    return simulate(requests, gaps, SHAPE, cost, config, 1000, 4096, 1000)


def request(prompt_len: int, output_len: int, start: int = 5) -> BenchRequest:
    ids = [start + i % 50 for i in range(prompt_len)]
    return BenchRequest(ids, None, prompt_len, output_len)


def test_one_request_by_hand():
    (result,) = run([request(100, 5)], [0.0]).results
    assert result.ttft == pytest.approx(0.010)  # the prefill: one 10 ms step
    assert result.itl == pytest.approx([0.010] * 4)
    assert result.e2el == pytest.approx(0.050) and result.output_len == 5


def test_chunked_prefill_follows_the_token_budget():
    (alone,) = run([request(1000, 2)], [0.0], max_num_batched_tokens=256).results
    assert alone.ttft == pytest.approx(0.040)  # ceil(1000 / 256) = 4 steps of prefill


def test_a_late_arrival_waits_for_its_time_and_shares_steps():
    early, late = run([request(50, 10), request(50, 3, start=60)], [0.025, 0.0]).results
    assert late.start_time == pytest.approx(0.025)
    # It arrives mid-step (the third step ends at 30 ms), runs its prefill in the
    # fourth step beside the first request's decode, and takes 10 ms per token.
    assert late.ttft == pytest.approx(0.040 - 0.025)
    assert late.itl == pytest.approx([0.010, 0.010])
    assert early.e2el == pytest.approx(0.100)


def test_a_seed_repeats_a_run_exactly():
    requests = [request(64 + 13 * i, 8 + i % 5, start=i) for i in range(40)]
    gaps = arrival_gaps(len(requests), 20.0, 0.5, seed=3)
    cost = StepCostModel(bandwidth_gbs=1, tflops=0.01, step_overhead_s=1e-3,
                         request_overhead_s=1e-4)  # fmt: skip
    first, second = run(requests, gaps, cost), run(requests, gaps, cost)
    assert [r.ttft for r in first.results] == [r.ttft for r in second.results]
    assert first.duration == second.duration and first.num_steps == second.num_steps


def test_the_command_prints_the_bench_table(tmp_path):
    cost = tmp_path / "cost.json"
    StepCostModel(20, 0.1, step_overhead_s=1e-3, request_overhead_s=2e-4, source="test").save(cost)
    result = subprocess.run(
        [sys.executable, "-m", "tandem", "simulate", "--model", "models/stdlib-lm",
         "--cost", str(cost), "--num-prompts", "50", "--request-rate", "10",
         "--goodput", "ttft:200"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "Serving Benchmark Result" in result.stdout and "Request goodput" in result.stdout
    assert "simulated: 50 requests at 10 req/s" in result.stdout


class _Replay(StepCostModel):
    """A cost model that returns recorded step durations, in order."""

    def __init__(self, durations: list[float]) -> None:
        object.__setattr__(self, "durations", iter(durations))

    def step_seconds(self, shape, shares) -> float:
        return next(self.durations)


def test_the_simulation_decides_as_the_real_engine_did(model_dirs):
    """A real engine run (the tiny Llama, a small token budget, a small cache so that
    it preempts, prefix hits) records each step's composition and timing; the
    simulation, given the same arrivals and the recorded step times, schedules every
    step identically: it is the same scheduler code."""
    from tandem import LLM
    from tandem.engine.observer import EngineObserver
    from tandem.sampling import RequestOutputKind, SamplingParams

    folder = str(model_dirs("llama")[0])
    engine_options = dict(max_num_batched_tokens=48, num_blocks=40, block_size=4)
    llm = LLM(folder, **engine_options)
    engine = llm.engine

    class Record(EngineObserver):
        def __init__(self) -> None:
            self.steps: list = []

        def step_done(self, out, stats):
            if out is not None:
                self.steps.append(
                    ([(i.request_id, i.num_new_tokens, i.num_computed_tokens)
                      for i in out.scheduled], sorted(out.preempted_ids))
                )  # fmt: skip

    record = Record()
    engine.add_observer(record)
    shared = [7 + i % 40 for i in range(24)]
    requests = [request(30 + 7 * i, 6 + i % 4, start=i) for i in range(8)]
    requests += [
        BenchRequest([*shared, 3, 4], None, 26, 5),
        BenchRequest([*shared, 5], None, 25, 5),
    ]
    add_before_step = [0, 0, 0, 2, 3, 3, 6, 9, 10, 12]
    starts, index, step = [], 0, 0
    while index < len(requests) or engine.has_unfinished_requests():
        now = clock_now()
        while index < len(requests) and add_before_step[index] <= step:
            r = requests[index]
            params = SamplingParams(temperature=0, max_tokens=r.output_len, ignore_eos=True,
                                    output_kind=RequestOutputKind.FINAL_ONLY)  # fmt: skip
            engine.add_request(str(index), {"prompt_token_ids": r.prompt_token_ids}, params,
                               arrival_time=now)  # fmt: skip
            index += 1
        starts.append(now)
        engine.step()
        step += 1
    starts.append(clock_now())
    durations = [b - a for a, b in itertools.pairwise(starts)]
    arrivals = [starts[s] - starts[0] for s in add_before_step]
    # (each a nanosecond short: the simulated clock sums durations, with rounding)
    gaps = [max(b - a - 1e-9, 0.0) for a, b in itertools.pairwise(arrivals)] + [0.0]
    assert any(preempted for _, preempted in record.steps)  # the case is a hard one
    real_steps = list(record.steps)

    record.steps.clear()
    config = EngineConfig.from_kwargs(folder, **engine_options)
    from tandem.plan import simulate as simulation

    original = simulation.Engine

    def engine_with_record(*args, **kwargs):
        simulated_engine = original(*args, **kwargs)
        simulated_engine.add_observer(record)
        return simulated_engine

    simulation.Engine = engine_with_record
    try:
        simulate(requests, gaps, SHAPE, _Replay(durations), config, 40, 512, 1000)
    finally:
        simulation.Engine = original
    assert record.steps == real_steps


# -- clusters and the sizing search ----------------------------------------------------


def run_layout(requests, gaps, cost, layout):
    from tandem.bench.summary import summarize

    config = EngineConfig.from_kwargs("unused")
    result = simulate(requests, gaps, LIGHT_KV, cost, config, 4000, 4096, 1000, None, layout)
    return summarize(result.results, result.duration, {})


# Little KV (10 bytes per token): steps cost their weights and their FLOPs.
LIGHT_KV = ModelShape(params=10**6, weight_bytes=4e6, kv_bytes_per_token=10, num_layers=2,
                      attention_width=64)  # fmt: skip


def test_a_disaggregated_request_is_prefilled_moved_and_decoded():
    from tandem.plan.simulate import Topology

    # 1 ms per step, nothing else; a 1 MB/s link with 5 ms latency.
    layout = Topology(prefill=1, decode=1, link_gbs=1e-3, link_latency_s=0.005)
    config = EngineConfig.from_kwargs("unused")
    result = simulate([request(101, 4)], [0.0], LIGHT_KV, StepCostModel(
        float("inf"), float("inf"), step_overhead_s=0.001), config, 100, 4096, 1000, None,
        layout)  # fmt: skip
    (one,) = result.results
    # prefill step (1 ms), 100 tokens x 10 bytes over the link (1 ms + 5 ms latency),
    # then the decode side runs the last prompt token and samples the first (1 ms).
    assert one.ttft == pytest.approx(0.001 + 0.006 + 0.001)
    assert one.itl == pytest.approx([0.001] * 3) and result.num_transfers == 1
    assert result.num_instances == {"prefill": 1, "decode": 1}
    assert result.busy_s == pytest.approx({"prefill": 0.001, "decode": 0.004})


def test_colocated_instances_share_the_arrivals_as_the_router_does():
    from tandem.plan.simulate import Topology

    requests = [request(40, 3, start=i) for i in range(6)]
    config = EngineConfig.from_kwargs("unused")
    one = simulate(requests, [0.0] * 6, LIGHT_KV, TEN_MS, config, 1000, 4096, 1000)
    three = simulate(requests, [0.0] * 6, LIGHT_KV, TEN_MS, config, 1000, 4096, 1000, None,
                     Topology(instances=3))  # fmt: skip
    # A constant step cost: one instance runs all six together; three run two each, in
    # the same time, and their steps add up.
    assert [r.e2el for r in three.results] == pytest.approx([r.e2el for r in one.results])
    assert three.num_steps == 3 * one.num_steps
    assert three.utilization("colocated") == pytest.approx(1.0)


def test_the_search_finds_the_fewest_colocated_instances_for_the_prompt_load():
    """Steps cost 0.25 ms per token. A request every 10 ms brings 100 prompt tokens
    and one decode token (10.1 tokens/ms) against 4 tokens/ms per instance: two
    instances fall behind, three keep up. Split layouts need three prefill instances
    for the prompts alone (10 of 12 tokens/ms), so at three instances only the
    colocated layout keeps TTFT short."""
    from tandem.plan.sizing import search

    cost = StepCostModel(float("inf"), float("inf"), token_overhead_s=0.25e-3)
    requests = [request(100, 2, start=i) for i in range(200)]
    gaps = [0.010] * 200
    best, rows = search(lambda layout: run_layout(requests, gaps, cost, layout),
                        {"p90_ttft_ms": 60.0}, max_instances=5)  # fmt: skip
    assert best.topology.label == "3 colocated"
    labels = [row.topology.label for row in rows]
    assert labels == ["1 colocated", "2 colocated", "1P:1D", "3 colocated", "1P:2D", "2P:1D"]
    assert not any(row.meets({"p90_ttft_ms": 60.0}) for row in rows[:3] + rows[4:])


def test_the_search_splits_prefill_from_decode_when_prefills_stall_decodes():
    """Decode batches are memory-bound (1 ms a step, whatever their size up to ten
    requests), prompts compute-bound (120 tokens: 12 ms). A request every 10 ms
    decoding 50 tokens: a colocated instance stalls its decodes behind others'
    prefills (11 ms each), so p99 TPOT stays above 1.2 ms with three instances; two
    prefill instances (60% busy) and one decode instance (steps of 1 ms) meet it, and
    one prefill instance (120% busy) lets TTFT grow without bound."""
    from tandem.plan.simulate import Topology
    from tandem.plan.sizing import search

    # 4 MB of weights at 4 GB/s: 1 ms; 2 MFLOP per token at 20 GFLOP/s: 0.1 ms.
    cost = StepCostModel(bandwidth_gbs=4, tflops=0.02)
    requests = [request(120, 51, start=i) for i in range(200)]
    gaps = [0.010] * 200
    slos = {"p99_tpot_ms": 1.2, "p90_ttft_ms": 50.0}
    link = Topology(link_gbs=1e3, link_latency_s=0.0)
    best, rows = search(lambda layout: run_layout(requests, gaps, cost, layout), slos,
                        max_instances=6, link=link)  # fmt: skip
    assert best.topology.label == "2P:1D"
    by_label = {row.topology.label: row for row in rows}
    assert by_label["3 colocated"].summary["p99_tpot_ms"] > 1.2
    assert by_label["1P:2D"].summary["p90_ttft_ms"] > 50.0
    assert by_label["2P:1D"].summary["p99_tpot_ms"] == pytest.approx(1.0, rel=0.1)
    assert len(rows) == 6  # it stopped at three instances


def test_flags_that_would_be_ignored_are_refused(capsys):
    """A flag that does nothing in this invocation is an error naming it, not a no-op."""
    from tandem.cli import main

    base = ["simulate", "--model", "models/stdlib-lm", "--hardware", "h100-sxm"]
    for extra, flag in (
        (["--slo", "p90_ttft:5"], "--slo"),
        (["--search", "--slo", "p90_ttft:5", "--trace", "t.json"], "--trace"),
        (["--search", "--slo", "p90_ttft:5", "--max-instances", "0"], "--max-instances"),
        (["--prefill", "1"], "--prefill"),
    ):
        assert main([*base, *extra]) == 2
        assert f"error: {flag}" in capsys.readouterr().err
    assert main(["plan", "--model", "models/stdlib-lm", "--from-trace", "t.json"]) == 2
    assert "error: --from-trace" in capsys.readouterr().err
