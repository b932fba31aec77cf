"""Clients written by other people against a live `tandem serve` on loopback: litellm
(its ``hosted_vllm/`` and ``openai/`` providers), the guidellm load generator, given
the model's local folder as its tokenizer (never a hub id), whose request count must
equal what the server's /metrics counted, and LangChain's ChatOpenAI binding a tool
on each family's real chat template (tests/chat_templates/): the server reads the
calls in the family's own format and LangChain gets them as its tool calls, whole and
streamed.

They live in their own virtual environment (``.clients``, made by the README's test
command), because their pins (openai 2.x, huggingface_hub 1.x) differ from the
project's; each runs as a subprocess of that environment's Python.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
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


LANGCHAIN = """
    import json, sys
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def get_weather(city: str, days: int) -> str:
        \"\"\"The weather in a city for the next days.\"\"\"
        return "sunny"

    question = "What is the weather in Oslo for the next 3 days?"
    replies = {}
    for url in sys.argv[1:]:
        chat = ChatOpenAI(base_url=url + "/v1", api_key="unused", model="m",
                          max_tokens=256, temperature=1.0, seed=0, max_retries=0)
        named = chat.bind_tools([get_weather], tool_choice="get_weather")
        required = chat.bind_tools([get_weather], tool_choice="required",
                                   parallel_tool_calls=False)
        streamed = None
        for chunk in named.stream(question):
            streamed = chunk if streamed is None else streamed + chunk
        replies[url] = {"named": named.invoke(question).tool_calls,
                        "required": required.invoke(question).tool_calls,
                        "streamed": streamed.tool_calls}
    print(json.dumps(replies))
"""


@pytest.fixture(scope="module")
def family_servers(model_dirs, tmp_path_factory):
    """A server of the tiny model per family template (their tool formats found from
    the templates, as `tandem serve` does), on one thread each; their base URLs."""
    from tandem.config import EngineConfig
    from tandem.engine.engine import Engine
    from tandem.executor import make_executor
    from tandem.server.api import build_app
    from tandem.serving.async_engine import AsyncEngine
    from tests.servers import thread_server
    from tests.test_tool_formats import FAMILIES, TEMPLATES

    folder = model_dirs("llama", max_position_embeddings=4096)[0]  # (tool prompts are long)
    urls, engines = {}, []
    with contextlib.ExitStack() as stack:
        try:
            for name in FAMILIES:
                family = tmp_path_factory.mktemp(name.removesuffix(".jinja"))
                for path in Path(folder).iterdir():
                    if path.name != "chat_template.jinja":
                        shutil.copy(path, family / path.name)
                (family / "chat_template.jinja").write_text((TEMPLATES / name).read_text())
                config = EngineConfig.from_kwargs(str(family))
                engines.append(AsyncEngine(Engine(config, make_executor(config))))
                urls[name] = stack.enter_context(thread_server(build_app(engines[-1], "m")))
            yield urls
        finally:
            stack.close()
            for engine in engines:
                engine.shutdown()


def test_langchain_binds_a_tool_on_each_familys_template(family_servers):
    from tests.test_tool_formats import FAMILIES

    replies = json.loads(in_clients(LANGCHAIN, *family_servers.values()).strip().splitlines()[-1])
    for name, url in family_servers.items():
        reply = replies[url]
        for kind in ("named", "required", "streamed"):
            calls = reply[kind]
            assert len(calls) == 1 and calls[0]["name"] == "get_weather", (name, kind, reply)
            arguments = calls[0]["args"]  # held to the schema by the family's grammar
            assert isinstance(arguments["city"], str) and isinstance(arguments["days"], int), (
                name, FAMILIES[name], kind, arguments,
            )  # fmt: skip


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))
