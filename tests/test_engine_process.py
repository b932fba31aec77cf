"""The engine core in its own process: the same answers as in-process and offline,
aborts that free the cache across the process boundary, a dead core detected and
reported, and a core that stops when its server is killed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest

from tandem import LLM, SamplingParams
from tandem.server.launch import free_port, tandem_server, wait_healthy
from tests.servers import MODEL, core_pids, metric, serve, wait_for

PROMPTS = ["The quick brown fox", "Once upon a time", "def fibonacci(n):"]


LONG = 8000  # tokens: requests that run until their client hangs up


@pytest.fixture(scope="module")
def folder(model_dirs):
    return str(model_dirs("llama", max_position_embeddings=LONG + 64)[0])


def core_pid(server_pid: int) -> int:
    (pid,) = core_pids(server_pid)
    return pid


def completion(url: str, prompt: str, stream: bool, **extra) -> tuple[str, list[int] | None]:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 12, "temperature": 0, **extra}
    if not stream:
        reply = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()
        return reply["choices"][0]["text"], None
    text = ""
    with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}) as reply:
        for line in reply.iter_lines():
            if line.startswith("data: {"):
                text += json.loads(line.removeprefix("data: "))["choices"][0]["text"]
    return text, None


def test_outputs_equal_the_in_process_server_and_the_offline_engine(folder):
    llm = LLM(folder)
    params = SamplingParams(max_tokens=12, temperature=0)
    offline = [o.outputs[0].text for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    answers = {}
    for flags in ((), ("--no-engine-process",)):
        with serve(folder, *flags) as url:
            answers[flags] = [
                [completion(url, prompt, stream)[0] for prompt in PROMPTS]
                for stream in (False, True)
            ]
    assert answers[()] == answers[("--no-engine-process",)] == [offline, offline]


def test_aborted_streams_free_every_block_in_the_core(folder):
    with serve(folder) as url:
        body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": LONG, "ignore_eos": True}
        with httpx.Client(base_url=url, timeout=30) as http:
            streams = [
                http.stream("POST", "/v1/completions", json={**body, "stream": True})
                for _ in range(6)
            ]
            readers = []  # (a dropped line iterator would close its stream)
            for stream in streams:
                response = stream.__enter__()
                assert response.status_code == 200
                readers.append(response.iter_lines())
                next(readers[-1])  # it has started
            wait_for(lambda: metric(url, "num_requests_running") == 6)
            assert metric(url, "kv_cache_usage_perc") > 0
            for stream in streams:  # every client hangs up mid-stream
                stream.__exit__(None, None, None)
        wait_for(
            lambda: (
                metric(url, "num_requests_running") == 0 and metric(url, "kv_cache_usage_perc") == 0
            )
        )
        assert metric(url, "request_success_total", finished_reason="abort") == 6
        # ...and the core goes on serving.
        assert completion(url, PROMPTS[1], stream=False)[0] != ""


def test_a_killed_core_fails_the_streams_in_flight_and_the_server_exits(folder):
    with tandem_server("serve", "--model", folder, "--served-model-name", MODEL) as server:
        body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": LONG, "ignore_eos": True}
        with httpx.stream(
            "POST", f"{server.url}/v1/completions", json={**body, "stream": True}, timeout=30
        ) as reply:
            lines = reply.iter_lines()
            assert next(lines).startswith("data: {")
            os.kill(core_pid(server.process.pid), signal.SIGKILL)
            rest = [line for line in lines if line]
        assert rest[-1] == "data: [DONE]"
        error = json.loads(rest[-2].removeprefix("data: "))["error"]
        assert error["code"] == "engine_dead" and "exited with code -9" in error["message"]
        health = httpx.get(f"{server.url}/health")  # within the exit grace
        assert health.status_code == 503 and health.json()["error"]["code"] == "engine_dead"
        assert server.process.wait(timeout=30) == 1


def test_the_core_stops_when_its_server_is_killed(folder):
    with tandem_server("serve", "--model", folder) as server:
        core = core_pid(server.process.pid)
        server.process.send_signal(signal.SIGKILL)
        server.process.wait(timeout=10)
        deadline = time.monotonic() + 20
        while Path(f"/proc/{core}").exists() and _state(core) != "Z":
            assert time.monotonic() < deadline, "the core outlived its server"
            time.sleep(0.1)


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return "gone"


def test_a_core_that_cannot_load_says_why(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "tandem", "serve", "--model", str(tmp_path), "--port", "0"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode != 0
    assert "config.json" in result.stderr and "Traceback" not in result.stderr


@pytest.mark.parametrize("group", [True, False], ids=["process group", "server alone"])
def test_ctrl_c_on_the_process_group_is_a_clean_shutdown(folder, group):
    """A terminal's Ctrl-C reaches the server and its core alike (or `kill -INT` the
    server alone): the server shuts the core down in order and exits as interrupted,
    with no crash reported and no core 'terminated' for not stopping."""
    port = free_port()
    with tempfile.TemporaryFile(mode="w+") as log:
        server = subprocess.Popen(
            [sys.executable, "-m", "tandem", "serve", "--model", folder, "--port", str(port)],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
        try:
            wait_healthy(f"http://127.0.0.1:{port}", server, log)
            (os.killpg if group else os.kill)(server.pid, signal.SIGINT)
            assert server.wait(timeout=60) in (0, 130, -signal.SIGINT)  # as interrupted
        finally:
            if server.poll() is None:
                os.killpg(server.pid, signal.SIGKILL)
        log.seek(0)
        said = log.read()
        assert "exited with code" not in said and "did not stop" not in said, said
