"""Data parallelism (``tandem serve --data-parallel-size N``): N engine cores behind one
API server answer as one engine does, take requests side by side, report their
metrics by core, and a core that dies fails only its own streams."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tandem import LLM, SamplingParams
from tandem.config import EngineConfig
from tandem.errors import InvalidParameterError
from tandem.executor.cpus import cpu_share
from tandem.server.launch import tandem_server
from tandem.serving.data_parallel import (
    check_data_parallel,
    core_config,
    core_cpus,
    core_options,
    merge_metrics,
    merge_traces,
)
from tandem.serving.placement import Instance, prefix_affinity
from tandem.serving.served_engine import CoreOptions
from tests.servers import MODEL, core_pids, metric, serve, wait_for

PROMPTS = ["The quick brown fox", "Once upon a time", "def fibonacci(n):", "In 1969, the"]
LONG = 4000  # tokens: streams that run until the test ends them


@pytest.fixture(scope="module")
def folder(model_dirs):
    return str(model_dirs("llama", max_position_embeddings=LONG + 64)[0])


def open_stream(http: httpx.Client, prompt: str):
    """A long streaming completion that has produced its first token."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": LONG, "ignore_eos": True}
    stream = http.stream("POST", "/v1/completions", json={**body, "stream": True})
    response = stream.__enter__()
    assert response.status_code == 200
    lines = response.iter_lines()
    assert next(lines).startswith("data: {")
    return stream, lines


def read_until_error(lines, ends: dict[int, dict], index: int) -> None:
    """Read a stream until its error frame (recorded in ``ends``) or until it closes."""
    with contextlib.suppress(httpx.HTTPError):
        for line in lines:
            if line.startswith('data: {"error"'):
                ends[index] = json.loads(line.removeprefix("data: "))["error"]
                return


def running(url: str, engine: str) -> float:
    return metric(url, "num_requests_running", engine=engine)


@pytest.mark.parametrize("tensor_parallel", [1, 2])
def test_two_cores_answer_as_one_engine_and_take_requests_side_by_side(folder, tensor_parallel):
    """Each core a whole engine: with --tensor-parallel-size 2, each its own group of
    two ranks (its own rendezvous and shared segment)."""
    llm = LLM(folder)
    params = SamplingParams(max_tokens=16, temperature=0)
    offline = [o.outputs[0].text for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    flags = ("--data-parallel-size", "2", "--tensor-parallel-size", str(tensor_parallel))
    with serve(folder, *flags) as url:
        assert httpx.get(f"{url}/health").json() == {"status": "ok", "engine_cores": 2}
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused")
        answers: dict[int, str] = {}

        def ask(index: int) -> None:  # the real SDK, streaming, four clients at once
            chunks = client.completions.create(
                model=MODEL, prompt=PROMPTS[index], max_tokens=16, temperature=0, stream=True
            )
            answers[index] = "".join(chunk.choices[0].text for chunk in chunks)

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(PROMPTS))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=120)
        assert [answers[i] for i in range(len(PROMPTS))] == offline
        # Both cores served: /metrics labels every sample with its core.
        for engine in ("0", "1"):
            assert metric(url, "request_success_total", engine=engine) >= 1
        assert metric(url, "request_success_total") == len(PROMPTS)
        assert metric(url, "engine_cores", state="alive") == 2
        # Two streams in flight run on two cores at once.
        with httpx.Client(base_url=url, timeout=60) as http:
            streams = [open_stream(http, prompt) for prompt in PROMPTS[:2]]
            assert running(url, "0") == running(url, "1") == 1
            for stream, _ in streams:
                stream.__exit__(None, None, None)
        wait_for(lambda: metric(url, "num_requests_running") == 0)


def test_a_dead_core_fails_only_its_streams_and_the_last_one_takes_the_server(folder):
    flags = ("--data-parallel-size", "2", "--served-model-name", MODEL)
    with tandem_server("serve", "--model", folder, *flags) as server:
        url = server.url
        pids = core_pids(server.process.pid)
        assert len(pids) == 2
        with httpx.Client(base_url=url, timeout=60) as http:
            streams = [open_stream(http, prompt) for prompt in PROMPTS[:2]]
            os.kill(pids[0], signal.SIGKILL)
            # Each stream read on its own thread for a few seconds: the dead core's ends
            # with an error (after what was already on its way), the other streams on.
            ends: dict[int, dict] = {}
            readers = [
                threading.Thread(target=read_until_error, args=(lines, ends, i), daemon=True)
                for i, (_, lines) in enumerate(streams)
            ]
            for reader in readers:
                reader.start()
            wait_for(lambda: len(ends) >= 1)
            time.sleep(2.0)  # (time for a wrong second ending to show)
            assert len(ends) == 1 and readers[1 - next(iter(ends))].is_alive()
            (error,) = ends.values()
            assert error["code"] == "engine_dead" and "exited with code -9" in error["message"]
            for stream, _ in streams:
                stream.__exit__(None, None, None)
        health = httpx.get(f"{url}/health")
        assert health.status_code == 200
        body = health.json()
        assert body["status"] == "degraded" and len(body["dead_engine_cores"]) == 1
        assert metric(url, "engine_cores", state="dead") == 1
        # New requests go to the survivor, every time.
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused")
        for prompt in PROMPTS:
            reply = client.completions.create(
                model=MODEL, prompt=prompt, max_tokens=4, extra_body={"ignore_eos": True}
            )
            assert reply.choices[0].finish_reason == "length"
        os.kill(pids[1], signal.SIGKILL)
        assert server.process.wait(timeout=30) == 1


def test_settings_data_parallelism_does_not_serve_are_refused_by_name(tmp_path):
    config = EngineConfig.from_kwargs(str(tmp_path))
    check_data_parallel(config, 2, engine_process=True)
    two_hosts = EngineConfig.from_kwargs(
        str(tmp_path), nnodes=2, tensor_parallel_size=2, master_port=29500
    )
    decode_role = EngineConfig.from_kwargs(str(tmp_path), kv_transfer_config={"role": "decode"})
    refusals = [
        (config, 0, True),
        (config, 65, True),
        (config, 2, False),  # --no-engine-process
        (two_hosts, 2, True),
        (decode_role, 2, True),
    ]
    for refused, size, engine_process in refusals:
        with pytest.raises(InvalidParameterError, match="--data-parallel-size"):
            check_data_parallel(refused, size, engine_process)


def test_each_core_gets_its_own_cpus_kv_budget_and_trace_file(tmp_path):
    assert cpu_share([0, 1, 2, 3, 4], 2, 0) == [0, 1, 2]
    assert cpu_share([0, 1, 2, 3, 4], 2, 1) == [3, 4]
    assert cpu_share([0], 2, 1) == []  # fewer CPUs than cores: nobody is pinned
    options = CoreOptions("m", trace=str(tmp_path / "steps.json"))
    first, second = (core_options(options, 2, i, bind=True) for i in range(2))
    assert (first.index, second.index) == (0, 1)
    assert first.trace.endswith("steps.core0.json") and second.trace.endswith("steps.core1.json")
    # Each core a run of its own, the first CPU left to the API server; none spare: none.
    assert [core_cpus(list(range(9)), 2, i) for i in range(2)] == [[1, 2, 3, 4], [5, 6, 7, 8]]
    assert core_cpus([0, 1], 2, 0) == core_cpus([0, 1], 2, 1) == []
    if len(os.sched_getaffinity(0)) > 2:
        assert first.cpus and second.cpus and not set(first.cpus) & set(second.cpus)
    assert core_options(options, 2, 0, bind=False).cpus == ()
    config = EngineConfig.from_kwargs(str(tmp_path))
    halves = core_config(config, 2).cache.kv_cache_memory
    assert halves == (2 << 30) // 2
    given = EngineConfig.from_kwargs(str(tmp_path), num_blocks=64)
    assert core_config(given, 2) is given


def test_metrics_and_traces_of_the_cores_merge_labelled_by_core():
    text = (
        "# HELP tandem:generation_tokens_total Generated tokens.\n"
        "# TYPE tandem:generation_tokens_total counter\n"
        'tandem:generation_tokens_total{model_name="m"} 5.0\n'
    )
    merged = merge_metrics([(0, text.encode()), (1, text.replace("5.0", "7.0"))], 2, 2)
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(merged)
        for s in family.samples
    }
    assert samples[("tandem:generation_tokens_total", (("engine", "0"), ("model_name", "m")))] == 5
    assert samples[("tandem:generation_tokens_total", (("engine", "1"), ("model_name", "m")))] == 7
    assert samples[("tandem:engine_cores", (("state", "dead"),))] == 0
    trace = {
        "traceEvents": [
            {"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "engine"}},
            {"ph": "X", "name": "step 0", "pid": 1, "ts": 0, "dur": 1},
        ],
        "otherData": {"dropped": {"steps": 1}},
    }
    both = merge_traces([(0, trace), (1, trace)])
    names = [e["args"]["name"] for e in both["traceEvents"] if e["ph"] == "M"]
    assert names == ["core 0: engine", "core 1: engine"]
    assert len({e["pid"] for e in both["traceEvents"]}) == 2
    assert both["otherData"]["dropped"] == {"steps": 2}


def test_prefix_routing_keeps_a_prompt_start_on_one_core_within_the_slack(folder):
    instances = [Instance(str(i)) for i in range(3)]
    key = b"a block's digest"
    home = prefix_affinity(instances, key, slack=2)
    assert all(prefix_affinity(instances, key, slack=2) is home for _ in range(5))
    home.in_flight = 3  # busier than the others by more than the slack: the least busy
    assert prefix_affinity(instances, key, slack=2) is not home
    home.in_flight = 0
    # Another core going away moves only its own keys: this one stays home.
    other = next(i for i in instances if i is not home)
    assert prefix_affinity(instances, key, slack=2, skip={other.url}) is home
    # Served: prompts that share their first block go to one core, one after another.
    start = "The same system prompt opens every request. " * 4
    with serve(folder, "--data-parallel-size", "2", "--data-parallel-routing", "prefix") as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused")
        for tail in ("first", "second", "third", "fourth"):
            client.completions.create(model=MODEL, prompt=start + tail, max_tokens=2)
        served = [metric(url, "request_success_total", engine=e) for e in ("0", "1")]
        assert sorted(served) == [0, 4]
        assert metric(url, "prefix_cache_hits_total") > 0
