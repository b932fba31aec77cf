"""Clients written by other people against a live `tandem serve` on loopback: litellm
(its ``hosted_vllm/`` and ``openai/`` providers) and the guidellm load generator,
given the model's local folder as its tokenizer (never a hub id), whose request count
must equal what the server's /metrics counted.

They live in their own virtual environment (``.clients``, made by the README's test
command), because their pins (openai 2.x, huggingface_hub 1.x) differ from the
project's; each runs as a subprocess of that environment's Python.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import httpx
import pytest

from tests.servers import MODEL, metric, serve

CLIENTS = Path(os.environ.get("TANDEM_CLIENTS_VENV", Path(__file__).parents[1] / ".clients"))
PYTHON = CLIENTS / "bin" / "python"

pytestmark = pytest.mark.skipif(
    not PYTHON.exists(),
    reason=f"the third-party clients are not installed in {CLIENTS} (see README: tests)",
)


@pytest.fixture(scope="module")
def folder(model_dirs):
    return str(model_dirs("llama")[0])


@pytest.fixture(scope="module")
def url(folder):
    with serve(folder) as base_url:
        yield base_url


# No network: litellm's bundled cost map, Hugging Face offline (local folders only).
OFFLINE = {"LITELLM_LOCAL_MODEL_COST_MAP": "True", "HF_HUB_OFFLINE": "1"}


def in_clients(code: str, *args: str, timeout: float = 300) -> str:
    result = subprocess.run(
        [str(PYTHON), "-c", textwrap.dedent(code), *args],
        capture_output=True, text=True, timeout=timeout, env={**os.environ, **OFFLINE},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


LITELLM = """
    import json, sys
    import litellm
    provider, base = sys.argv[1], sys.argv[2]
    messages = [{"role": "user", "content": "Say something."}]
    common = dict(model=f"{provider}/tiny", api_base=f"{base}/v1", api_key="unused",
                  messages=messages, max_tokens=12, temperature=0)
    plain = litellm.completion(**common)
    streamed = "".join(chunk.choices[0].delta.content or ""
                       for chunk in litellm.completion(**common, stream=True))
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}},
              "required": ["ok"], "additionalProperties": False}
    structured = litellm.completion(**{**common, "max_tokens": 40, "response_format": {
        "type": "json_schema", "json_schema": {"name": "r", "schema": schema}}})
    tool = {"type": "function", "function": {"name": "ping", "parameters": {
        "type": "object", "properties": {"n": {"enum": [1, 2]}}, "required": ["n"],
        "additionalProperties": False}}}
    called = litellm.completion(**{**common, "max_tokens": 80, "tools": [tool],
                                   "tool_choice": "required", "parallel_tool_calls": False})
    print(json.dumps({
        "text": plain.choices[0].message.content,
        "completion_tokens": plain.usage.completion_tokens,
        "streamed": streamed,
        "structured": structured.choices[0].message.content,
        "call": called.choices[0].message.tool_calls[0].function.model_dump(),
    }))
"""


@pytest.mark.parametrize("provider", ["hosted_vllm", "openai"])
def test_litellm_as_a_client(url, provider):
    reply = json.loads(in_clients(LITELLM, provider, url).strip().splitlines()[-1])
    direct = httpx.post(
        f"{url}/v1/chat/completions",
        json={"model": MODEL, "messages": [{"role": "user", "content": "Say something."}],
              "max_tokens": 12, "temperature": 0},
    ).json()  # fmt: skip
    assert reply["text"] == reply["streamed"] == direct["choices"][0]["message"]["content"]
    assert reply["completion_tokens"] == direct["usage"]["completion_tokens"]
    assert isinstance(json.loads(reply["structured"])["ok"], bool)
    assert reply["call"]["name"] == "ping"
    assert json.loads(reply["call"]["arguments"])["n"] in (1, 2)


def test_guidellm_runs_a_bounded_benchmark_the_server_counts(url, folder, tmp_path):
    before = metric(url, "request_success_total")
    report = tmp_path / "guidellm.json"
    guidellm = CLIENTS / "bin" / "guidellm"
    result = subprocess.run(
        [
            str(guidellm), "run",
            "--backend", f"kind=openai_http,target={url},model={MODEL}",
            "--profile", "kind=synchronous",
            "--constraint", "kind=max_requests,count=6",
            "--data", "kind=synthetic_text,prompt_tokens=24,output_tokens=8",
            "--tokenizer", f"kind=huggingface_auto,model={folder}",
            "--output", f"kind=json,path={report}",
            "--disable-console-interactive",
        ],
        capture_output=True, text=True, timeout=600,
        env={**os.environ, **OFFLINE, "PATH": f"{CLIENTS / 'bin'}:{os.environ['PATH']}"},
    )  # fmt: skip
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    completed = guidellm_completed(json.loads(report.read_text()))
    assert completed >= 6
    assert metric(url, "request_success_total") - before == completed


def guidellm_completed(report: dict) -> int:
    """Requests guidellm's report says succeeded (its benchmarks' totals)."""
    total = 0
    for benchmark in report["benchmarks"]:
        totals = benchmark["metrics"]["request_totals"]
        total += totals["successful"]
    return total


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))
