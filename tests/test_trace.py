"""Step traces: valid Chrome trace-event JSON whose per-request tracks agree with the
request metrics (same clock readings), from LLM, the CLI and the server; and the plot."""

from __future__ import annotations

import itertools
import json
import random
import subprocess
import sys
from collections import defaultdict

import httpx
import pytest

from tandem import LLM, SamplingParams
from tests.hf_models import VOCAB_SIZE


def lanes_of(trace: dict) -> tuple[dict[str, list[dict]], list[dict]]:
    events = trace["traceEvents"]
    for event in events:
        assert {"name", "ph", "pid"} <= event.keys()
        if event["ph"] != "M":
            assert isinstance(event["ts"], float | int) and event["ts"] >= 0
        if event["ph"] == "X":
            assert event["dur"] >= 0
    names = {e["tid"]: e["args"]["name"] for e in events
             if e["ph"] == "M" and e["name"] == "thread_name" and e["pid"] == 1}  # fmt: skip
    lanes = defaultdict(list)
    for event in events:
        if event["pid"] == 1 and event["ph"] in ("X", "i"):
            lanes[names[event["tid"]]].append(event)
    steps = [e for e in events if e["pid"] == 0 and e["ph"] == "X"]
    return lanes, steps


@pytest.fixture(scope="module")
def folder(model_dirs):
    return model_dirs("llama")[0]


def test_tracks_agree_with_the_request_metrics(folder, tmp_path):
    rng = random.Random(0)
    prompts = [[rng.randrange(2, VOCAB_SIZE) for _ in range(n)] for n in (40, 7, 23, 31, 12)]
    # A small budget chunks the prompts; few blocks force preemptions.
    llm = LLM(str(folder), trace=str(tmp_path / "t.json"), max_num_batched_tokens=16,
              block_size=4, num_blocks=24)  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    trace = json.loads((tmp_path / "t.json").read_text())
    lanes, steps = lanes_of(trace)
    assert len(steps) == len(llm.tracing.tracer.steps)
    assert all(a["ts"] + a["dur"] <= b["ts"] + 1 for a, b in itertools.pairwise(steps))
    assert sum(o.metrics.num_preemptions for o in outputs) > 0
    for output in outputs:
        events = lanes[output.request_id]
        metrics = output.metrics
        by_name = {e["name"]: e for e in events if e["ph"] == "i"}
        assert by_name["first token"]["args"]["ttft_ms"] == pytest.approx(
            metrics.ttft * 1e3, abs=1e-3
        )
        finished_us = (metrics.finished_time - metrics.arrival_time) * 1e6
        assert by_name["finished"]["ts"] - by_name["arrival"]["ts"] == pytest.approx(
            finished_us, abs=2
        )
        assert by_name["finished"]["args"]["reason"] == "length"
        decodes = [e for e in events if e["cat"] == "decode"]
        prefills = [e for e in events if e["cat"] == "prefill"]
        preempted = [e for e in events if e["cat"] == "preempted"]
        assert len(preempted) == metrics.num_preemptions
        recomputed = sum(e["args"]["tokens"] for e in prefills) - len(output.prompt_token_ids)
        # Every token whose K/V had to be rebuilt after a preemption is in a chunk too;
        # the first token comes from the last prompt chunk, every other from a step.
        if not preempted:
            assert recomputed == 0
            assert len(decodes) == len(output.outputs[0].token_ids) - 1
        assert events[0]["name"] == "arrival"


def test_an_aborted_request_ends_its_lane(folder):
    llm = LLM(str(folder), max_num_seqs=1)
    llm.start_trace()
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    engine.add_request("runs", [5, 6, 7], params)
    engine.add_request("waits", [8, 9], params)
    engine.step()
    engine.abort(["waits", "runs"])
    lanes, _ = lanes_of(llm.tracing.stop().chrome_trace())
    waits = lanes["waits"]
    assert [e["name"] for e in waits] == ["arrival", "waiting", "finished"]
    assert waits[-1]["args"]["reason"] == "abort"
    assert lanes["runs"][-1]["args"]["reason"] == "abort"


def test_cli_trace_and_plot(folder, tmp_path):
    trace_file, picture = tmp_path / "cli.json", tmp_path / "timeline.png"
    run = subprocess.run(
        [sys.executable, "-m", "tandem", "generate", "--model", str(folder), "Hello",
         "--max-tokens", "5", "--trace", str(trace_file)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    lanes, steps = lanes_of(json.loads(trace_file.read_text()))
    assert list(lanes) == ["cli"] and len(steps) == 5
    plot = subprocess.run(
        [sys.executable, "-m", "tandem", "trace", "plot", str(trace_file), "-o", str(picture)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert plot.returncode == 0, plot.stderr
    assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    bad = subprocess.run(
        [sys.executable, "-m", "tandem", "trace", "plot", str(tmp_path / "none.json")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert bad.returncode == 2 and "cannot read the trace" in bad.stderr


def test_tracing_a_running_server(tiny_server):
    assert httpx.post(f"{tiny_server}/trace/stop").status_code == 400  # nothing recorded
    assert httpx.post(f"{tiny_server}/trace/start").json() == {"tracing": True}
    body = {"model": "tiny", "prompt": "Hello", "max_tokens": 3, "n": 2}
    assert httpx.post(f"{tiny_server}/v1/completions", json=body).status_code == 200
    lanes, steps = lanes_of(httpx.post(f"{tiny_server}/trace/stop").json())
    assert len(lanes) == 2 and steps  # one lane per sample of the n=2 request


def test_a_trace_left_running_stays_bounded(folder):
    """Past max_events the oldest finished lanes (then steps) go; the trace says how
    many, the newest requests stay whole, and finished lanes hold no request."""
    from tandem.trace.recorder import StepTracer

    llm = LLM(str(folder))
    tracer = StepTracer(max_events=400)
    llm.engine.add_observer(tracer)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    for round_ in range(12):
        llm.generate([[5, 6, 7 + round_]] * 4, params, use_tqdm=False)
        assert tracer.num_events <= 400
    trace = tracer.chrome_trace()
    dropped = trace["otherData"]["dropped"]
    assert dropped["requests"] > 0
    lanes, steps = lanes_of(trace)
    assert len(lanes) + dropped["requests"] == 48
    newest = max(lanes, key=lambda name: int(name.split("-")[-1]))
    assert [e["name"] for e in lanes[newest]][-1] == "finished"
    assert all(lane.request is None for lane in tracer.lanes.values())
    assert steps and len(steps) <= 400
