"""`tandem serve` as users reach it: a real server process on 127.0.0.1, the real
`openai` client, raw HTTP where the client would hide the wire format."""

from __future__ import annotations

import json
import re
from importlib.metadata import version
from typing import Annotated, Literal

import httpx
import jsonschema
import openai
import pydantic
import pytest

from tandem import LLM, SamplingParams
from tandem.config import EngineConfig
from tandem.engine.engine import Engine
from tandem.executor import make_executor
from tandem.models.tokenizer import Tokenizer
from tandem.server.api import build_app
from tandem.server.launch import tandem_process
from tandem.serving.async_engine import AsyncEngine
from tandem.serving.metrics import ServerMetrics
from tests.servers import metric, thread_server, wait_for
from tests.test_structured_outputs import COLORED  # the schema a random model can finish

PROMPT = "The quick brown fox"
MODEL = "tiny"  # the served name of the tiny_server fixture (conftest)


@pytest.fixture(scope="module")
def folder(model_dirs):
    return model_dirs("llama")[0]


@pytest.fixture(scope="module")
def server(tiny_server):
    return tiny_server


LONG = 16_000  # tokens: a request that keeps the one seat busy for seconds


@pytest.fixture(scope="module")
def one_seat_server(model_dirs):
    """One request runs at a time and one may wait: the third is refused."""
    folder, _ = model_dirs("llama", max_position_embeddings=LONG + 64)
    with tandem_process(
        "serve", "--model", str(folder), "--served-model-name", MODEL,
        "--max-num-seqs", "1", "--max-waiting-requests", "1",
    ) as url:  # fmt: skip
        yield url


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def reference(folder):
    llm = LLM(str(folder))

    def generate(prompt, **params):
        return llm.generate(prompt, SamplingParams(**params), use_tqdm=False)[0]

    return generate


# -- the happy paths --------------------------------------------------------------------


def test_models_lists_the_served_name(client, server):
    assert [m.id for m in client.models.list().data] == [MODEL]
    card = client.models.retrieve(MODEL)
    assert card.id == MODEL and card.max_model_len == 512
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("another-model")
    assert httpx.get(f"{server}/version").json()["version"] == version("tandem")


def test_completion_equals_the_offline_engine(client, reference):
    response = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0)
    expected = reference(PROMPT, temperature=0, max_tokens=12)
    choice = response.choices[0]
    assert response.object == "text_completion"
    assert choice.text == expected.outputs[0].text
    assert choice.finish_reason == "length"
    assert response.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert response.usage.completion_tokens == 12
    assert response.usage.total_tokens == len(expected.prompt_token_ids) + 12
    assert response.usage.prompt_tokens_details.cached_tokens == 0


def test_streamed_completion_is_the_same_text_with_usage_last(client):
    whole = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10, temperature=0)
    chunks = list(
        client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=10, temperature=0, stream=True,
            stream_options={"include_usage": True},
        )
    )  # fmt: skip
    usage_chunk, text_chunks = chunks[-1], chunks[:-1]
    assert usage_chunk.choices == [] and usage_chunk.usage.completion_tokens == 10
    assert "".join(c.choices[0].text for c in text_chunks) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in text_chunks[:-1]] == [None] * (len(text_chunks) - 1)
    assert text_chunks[-1].choices[0].finish_reason == "length"


def test_assistant_prefill_continues_the_final_message(client, server, reference, folder):
    """continue_final_message: the answer continues the last (assistant) message, as
    the offline engine continues the same prompt text; with add_generation_prompt
    left on it is a 400 naming the field."""
    messages = [{"role": "user", "content": "Say it"}, {"role": "assistant", "content": PROMPT}]
    response = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=6, temperature=0,
        extra_body={"continue_final_message": True, "add_generation_prompt": False},
    )  # fmt: skip
    prompt = Tokenizer(folder).apply_chat_template(
        messages, add_generation_prompt=False, continue_final_message=True
    )
    assert prompt.endswith(PROMPT)
    ids = Tokenizer(folder).encode(prompt, add_special_tokens=False)  # the template has BOS
    expected = reference({"prompt_token_ids": ids}, temperature=0, max_tokens=6)
    assert response.choices[0].message.content == expected.outputs[0].text
    tokens = httpx.post(
        f"{server}/tokenize",
        json={"messages": messages, "add_generation_prompt": False,
              "continue_final_message": True},
    ).json()["tokens"]  # fmt: skip
    assert tokens == ids
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=2,
            extra_body={"continue_final_message": True},
        )  # fmt: skip
    assert caught.value.body["param"] == "continue_final_message"


def test_continuous_usage_stats_count_every_chunk(client):
    """vLLM's stream_options.continuous_usage_stats: each chunk carries the usage so
    far (what load generators read TPOT from), the last chunk the total."""
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": PROMPT}], max_tokens=8,
            temperature=0, stream=True,
            stream_options={"include_usage": True, "continuous_usage_stats": True},
        )
    )  # fmt: skip
    counts = [c.usage.completion_tokens for c in chunks]
    assert counts == sorted(counts) and counts[0] == 0 and counts[-1] == 8
    assert all(c.usage.prompt_tokens == chunks[0].usage.prompt_tokens > 0 for c in chunks)
    assert chunks[-1].choices == []


def test_chat_streamed_and_not(client, reference, folder):
    messages = [{"role": "user", "content": "Hello there"}]
    response = client.chat.completions.create(
        model=MODEL, messages=messages, max_completion_tokens=8, temperature=0
    )
    expected = reference(
        {"prompt_token_ids": _chat_ids(folder, messages)}, temperature=0, max_tokens=8
    )
    assert response.object == "chat.completion"
    assert response.choices[0].message.role == "assistant"
    assert response.choices[0].message.content == expected.outputs[0].text
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=8, temperature=0, stream=True
        )
    )
    assert chunks[0].object == "chat.completion.chunk"
    assert chunks[0].choices[0].delta.role == "assistant"
    content = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert content == response.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "length"


def _chat_ids(folder, messages):
    from tandem.models.tokenizer import Tokenizer

    return Tokenizer(folder).encode_chat(messages, add_generation_prompt=True)


def test_n_and_seed_are_reproducible(client):
    def sample(seed):
        response = client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=8, n=2, seed=seed, temperature=1.0
        )
        assert [c.index for c in response.choices] == [0, 1]
        return [c.text for c in response.choices]

    first = sample(7)
    assert sample(7) == first
    assert first[0] != first[1]  # children get distinct seeds
    assert sample(8) != first
    streamed = ["", ""]  # n with streaming: chunks by choice index, the same samples
    for chunk in client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=8, n=2, seed=7, temperature=1.0, stream=True
    ):
        for choice in chunk.choices:
            streamed[choice.index] += choice.text
    assert streamed == first


def test_a_batch_of_prompts_and_token_ids(client, reference):
    ids = reference(PROMPT, max_tokens=1).prompt_token_ids
    response = client.completions.create(
        model=MODEL, prompt=[PROMPT, "Another"], max_tokens=4, temperature=0, n=2
    )
    assert [c.index for c in response.choices] == [0, 1, 2, 3]
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=4, temperature=0)
    assert by_ids.choices[0].text == response.choices[0].text == response.choices[1].text


def test_stop_string_ends_the_text_before_it(client):
    plain = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0)
    text = plain.choices[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    stopped = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0, stop=[stop]
    )
    assert stopped.choices[0].text == text[: text.index(stop)]
    assert stopped.choices[0].finish_reason == "stop"


def test_echo_scores_the_prompt_as_lm_eval_harness_asks(client, reference):
    """echo + logprobs 1 + max_tokens 0: the prompt alone, each token's logprob under
    the model (the first null), as the offline engine's prompt_logprobs; with tokens
    generated, they follow the prompt in text and logprobs; streamed, the same text."""
    scored = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=0, echo=True, logprobs=1, temperature=0
    )
    choice = scored.choices[0]
    offline = reference(PROMPT, max_tokens=1, prompt_logprobs=1)
    ids = offline.prompt_token_ids
    assert choice.text == PROMPT and scored.usage.completion_tokens == 0
    logprobs = choice.logprobs
    assert len(logprobs.tokens) == len(ids) and logprobs.token_logprobs[0] is None
    for position in range(1, len(ids)):
        expected = offline.prompt_logprobs[position][ids[position]].logprob
        assert logprobs.token_logprobs[position] == pytest.approx(expected, abs=1e-5)
    both = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=3, echo=True, logprobs=0, temperature=0
    ).choices[0]
    generated = reference(PROMPT, max_tokens=3, temperature=0).outputs[0].text
    assert both.text == PROMPT + generated
    assert len(both.logprobs.tokens) == len(ids) + 3
    assert both.logprobs.text_offset[len(ids)] == len(PROMPT)
    streamed = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=3, echo=True, temperature=0, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed if c.choices) == PROMPT + generated
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=0)
    assert caught.value.body["param"] == "max_tokens"


def test_x_request_id_is_echoed(server):
    """On answers and on errors alike; an oversized id is not echoed."""
    body = {"prompt": PROMPT, "max_tokens": 2}
    ok = httpx.post(f"{server}/v1/completions", json=body, headers={"X-Request-Id": "abc-1"})
    assert ok.status_code == 200 and ok.headers["x-request-id"] == "abc-1"
    bad = httpx.post(
        f"{server}/v1/completions", json={**body, "n": 0}, headers={"X-Request-Id": "abc-2"}
    )
    assert bad.status_code == 400 and bad.headers["x-request-id"] == "abc-2"
    long = httpx.post(f"{server}/v1/completions", json=body, headers={"X-Request-Id": "x" * 300})
    assert "x-request-id" not in long.headers


def test_logit_bias_bans_and_forces_tokens_as_offline(client, reference):
    """Through the OpenAI SDK: a ban (-100) on the greedy first token changes it; +100
    on a token makes every token that one; each equals the offline engine's."""
    plain = reference(PROMPT, temperature=0, max_tokens=6).outputs[0]
    first = plain.token_ids[0]
    forced = (first + 7) % 300
    for bias in ({first: -100}, {forced: 100}):
        response = client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0,
            logit_bias={str(k): v for k, v in bias.items()},
        )  # fmt: skip
        expected = reference(PROMPT, temperature=0, max_tokens=6, logit_bias=bias).outputs[0]
        assert response.choices[0].text == expected.text
        if bias == {first: -100}:
            assert expected.token_ids[0] != first
        else:
            assert expected.token_ids == [forced] * 6


def test_logprobs_completions_and_chat(client):
    response = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0, logprobs=3
    )
    logprobs = response.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == 5
    # Each token decoded alone (a character split across tokens shows as U+FFFD).
    assert logprobs.text_offset == [sum(map(len, logprobs.tokens[:i])) for i in range(5)]
    for chosen, top in zip(logprobs.token_logprobs, logprobs.top_logprobs, strict=True):
        assert len(top) >= 3 and chosen <= 0
        assert chosen == pytest.approx(max(top.values()))  # greedy picks the most likely
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
        temperature=0, logprobs=True, top_logprobs=2,
    )  # fmt: skip
    content = chat.choices[0].logprobs.content
    assert len(content) == 4
    assert all(len(entry.top_logprobs) == 2 for entry in content)
    assert content[0].top_logprobs[0].logprob >= content[0].top_logprobs[1].logprob


class Colored(pydantic.BaseModel):
    """COLORED as the SDK's users write it."""

    ok: bool
    color: Literal["red", "green", "blue"]
    name: Annotated[str, pydantic.Field(max_length=6)]


@pytest.mark.parametrize("stream", [False, True])
def test_response_format_json_schema_holds(client, stream):
    response_format = {"type": "json_schema", "json_schema": {"name": "obj", "schema": COLORED}}
    for seed in range(3):  # a random-weight model: only the mask makes this valid JSON
        reply = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "An object:"}], max_tokens=60,
            temperature=1.0, seed=seed, response_format=response_format, stream=stream,
        )  # fmt: skip
        if stream:
            text = "".join(chunk.choices[0].delta.content or "" for chunk in reply if chunk.choices)
        else:
            text = reply.choices[0].message.content
        jsonschema.validate(json.loads(text), COLORED)


def test_the_sdk_parses_answers_into_its_model(client):
    reply = client.chat.completions.parse(
        model=MODEL, messages=[{"role": "user", "content": "An object:"}], max_tokens=60,
        temperature=1.0, seed=11, response_format=Colored,
    )  # fmt: skip
    assert isinstance(reply.choices[0].message.parsed, Colored)


def test_vllm_structured_outputs_on_completions(client):
    choices = ["alpha", "beta", "gamma"]
    for body, check in [
        ({"structured_outputs": {"choice": choices}}, lambda t: t in choices),
        ({"structured_outputs": {"regex": "[a-c]{2}[0-9]"}},
         lambda t: re.fullmatch("[a-c]{2}[0-9]", t)),
        ({"guided_json": COLORED}, lambda t: jsonschema.validate(json.loads(t), COLORED) is None),
        ({"response_format": {"type": "json_object"}, "max_tokens": 200},
         lambda t: t.startswith("{")),
    ]:  # fmt: skip
        reply = client.completions.create(
            model=MODEL, prompt=PROMPT, temperature=1.0, seed=5,
            extra_body={"max_tokens": 60, **body},
        )  # fmt: skip
        assert check(reply.choices[0].text), (body, reply.choices[0].text)


def test_tokenize_and_detokenize_round_trip(server, reference):
    tokens = httpx.post(f"{server}/tokenize", json={"prompt": PROMPT}).json()
    assert tokens["tokens"] == reference(PROMPT, max_tokens=1).prompt_token_ids
    assert tokens["count"] == len(tokens["tokens"]) and tokens["max_model_len"] == 512
    text = httpx.post(f"{server}/detokenize", json={"tokens": tokens["tokens"]}).json()
    assert text["prompt"] == PROMPT


def test_unknown_fields_are_ignored(server):
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 2, "no_such_field": {"x": 1}}
    assert httpx.post(f"{server}/v1/completions", json=body).status_code == 200


# -- errors -----------------------------------------------------------------------------


def post_json(url: str, body: dict) -> httpx.Response:
    """POST ``body`` as JSON text with ASCII escapes, as any client may send it: a lone
    surrogate travels as "\\ud800" (httpx's json= cannot encode one)."""
    return httpx.post(url, content=json.dumps(body), headers={"content-type": "application/json"})


@pytest.mark.parametrize(
    "body, param",
    [
        ({"temperature": -1}, "temperature"),
        ({"temperature": "hot"}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"n": 0}, "n"),
        ({"logprobs": 99}, "logprobs"),
        ({"max_tokens": 10_000}, "max_tokens"),  # prompt + max_tokens beyond the context
        ({"prompt": "word " * 600}, "prompt"),
        ({"prompt": [10**6]}, "prompt"),
        ({"prompt": None}, "prompt"),
        ({"prompt": "bad \ud800 text"}, "prompt"),  # a lone surrogate
        ({"temperature": "NaN"}, "temperature"),
        ({"top_p": "Infinity"}, "top_p"),
        ({"seed": 2**64}, "seed"),
        ({"stop_token_ids": [10**6], "min_tokens": 2}, "stop_token_ids"),
    ],
)
def test_invalid_fields_are_400_naming_the_field(server, body, param):
    response = post_json(f"{server}/v1/completions", {"model": MODEL, "prompt": PROMPT, **body})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert error["message"]


def test_malformed_json_and_chat_errors_are_400(server):
    response = httpx.post(
        f"{server}/v1/completions",
        content=b"{not json",
        headers={"content-type": "application/json"},
    )
    assert response.status_code == 400 and "JSON" in response.json()["error"]["message"]
    no_logprobs = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "x"}],
        "top_logprobs": 2,
    }
    response = httpx.post(f"{server}/v1/chat/completions", json=no_logprobs)
    assert response.status_code == 400 and response.json()["error"]["param"] == "top_logprobs"


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"max_completion_tokens": 0}, "max_completion_tokens"),  # a value, not "unset"
        ({"chat_template_kwargs": {"add_generation_prompt": False}}, "chat_template_kwargs"),
        ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
        ({"chat_template_kwargs": {"eos_token": "x"}}, "chat_template_kwargs"),
        ({"messages": [{"role": "user", "content": None}]}, "messages[0].content"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
        ({"messages": [{"role": "user", "content": "a \ud800"}]}, "messages[0].content"),
    ],
)
def test_bad_chat_requests_are_400_naming_the_field(server, extra, param):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **extra}
    response = post_json(f"{server}/v1/chat/completions", body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_tokenize_refuses_a_lone_surrogate(server):
    for body, param in (
        ({"prompt": "a \ud800"}, "prompt"),
        ({"messages": [{"role": "user", "content": "a \ud800"}]}, "messages[0].content"),
    ):
        response = post_json(f"{server}/tokenize", {"model": MODEL, **body})
        assert response.status_code == 400 and response.json()["error"]["param"] == param


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as caught:
        client.completions.create(model="gpt-9", prompt=PROMPT, max_tokens=2)
    assert caught.value.body["code"] == "model_not_found"


def test_queue_limit_is_503_and_disconnects_free_the_cache(one_seat_server):
    server = one_seat_server
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": LONG, "ignore_eos": True}
    body["stream"] = True
    with httpx.Client(base_url=server, timeout=30) as http:
        with http.stream("POST", "/v1/completions", json=body) as running:
            assert running.status_code == 200
            running_lines = running.iter_lines()  # (a dropped iterator closes the stream)
            next(running_lines)  # it has started
            with http.stream("POST", "/v1/completions", json=body) as waiting:
                assert waiting.status_code == 200
                wait_for(lambda: metric(server, "num_requests_waiting") == 1)
                refused = http.post("/v1/completions", json={**body, "stream": False})
                assert refused.status_code == 503
                assert refused.json()["error"]["code"] == "queue_full"
                assert refused.headers["retry-after"] == "1"
                assert metric(server, "kv_cache_usage_perc") > 0
            # The waiting client hung up: its request leaves the queue.
            wait_for(lambda: metric(server, "num_requests_waiting") == 0)
            # A non-streaming client that hangs up while queued is aborted too.
            aborted = metric(server, "request_success_total", finished_reason="abort")
            with pytest.raises(httpx.TimeoutException):
                http.post("/v1/completions", json={**body, "stream": False}, timeout=0.5)
            wait_for(
                lambda: metric(server, "request_success_total", finished_reason="abort") > aborted
            )
            assert metric(server, "num_requests_running") == 1
        # The running client hung up mid-stream: nothing runs and every block is free.
        wait_for(
            lambda: (
                metric(server, "num_requests_running") == 0
                and metric(server, "num_requests_waiting") == 0
                and metric(server, "kv_cache_usage_perc") == 0
            )
        )
    assert metric(server, "request_success_total", finished_reason="abort") >= 3


def test_api_key_is_required_when_set(folder):
    with tandem_process(
        "serve", "--model", str(folder), "--served-model-name", MODEL, "--api-key", "s3cret"
    ) as base_url:
        for key in ("wrong", None):
            headers = {"Authorization": f"Bearer {key}"} if key else {}
            response = httpx.get(f"{base_url}/v1/models", headers=headers)
            assert response.status_code == 401
            assert response.json()["error"]["code"] == "invalid_api_key"
        for scheme in ("bearer", "BEARER"):  # the scheme is case-insensitive
            headers = {"Authorization": f"{scheme} s3cret"}
            assert httpx.get(f"{base_url}/v1/models", headers=headers).status_code == 200
        client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="s3cret", max_retries=0)
        assert client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2).choices
        assert httpx.get(f"{base_url}/health").status_code == 200  # probes need no key


# -- metrics ----------------------------------------------------------------------------


def test_metrics_count_what_was_served(server, client):
    before = {
        name: metric(server, name)
        for name in ("prompt_tokens_total", "generation_tokens_total",
                     "time_to_first_token_seconds_count", "e2e_request_latency_seconds_count")
    }  # fmt: skip
    response = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6)
    wait_for(lambda: metric(server, "e2e_request_latency_seconds_count") > before[
        "e2e_request_latency_seconds_count"])  # fmt: skip
    assert metric(server, "prompt_tokens_total") - before["prompt_tokens_total"] == (
        response.usage.prompt_tokens
    )
    assert metric(server, "generation_tokens_total") - before["generation_tokens_total"] == 6
    assert metric(server, "time_to_first_token_seconds_count") == (
        before["time_to_first_token_seconds_count"] + 1
    )
    text = httpx.get(f"{server}/metrics").text
    for name in (
        "inter_token_latency_seconds_bucket", "request_queue_time_seconds_bucket",
        "num_preemptions_total", "prefix_cache_queries_total", "prefix_cache_hits_total",
        'request_success_total{finished_reason="length"',
    ):  # fmt: skip
        assert f"tandem:{name}" in text


def test_n_samples_are_one_request_in_every_histogram(server, client):
    names = ("request_success_total", "time_to_first_token_seconds_count",
             "e2e_request_latency_seconds_count", "request_prompt_tokens_count",
             "request_generation_tokens_count", "request_generation_tokens_sum",
             "request_prefill_time_seconds_count", "request_decode_time_seconds_count",
             "request_inference_time_seconds_count", "prompt_tokens_total")  # fmt: skip
    before = {name: metric(server, name) for name in names}
    response = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=5, n=3, extra_body={"ignore_eos": True}
    )
    wait_for(lambda: metric(server, "request_success_total") > before["request_success_total"])
    after = {name: metric(server, name) for name in names}
    for name in names:
        if name.endswith("_count") or name == "request_success_total":
            assert after[name] - before[name] == 1, name
    assert after["request_generation_tokens_sum"] - before["request_generation_tokens_sum"] == 15
    assert after["prompt_tokens_total"] - before["prompt_tokens_total"] == (
        response.usage.prompt_tokens
    )
    assert metric(server, "iteration_tokens_total_count") > 0


def test_preemptions_are_counted_when_they_happen(model_dirs):
    """A cache too small for two growing requests: the counter moves while both still
    run (before, it only moved when a preempted request finished)."""
    folder, _ = model_dirs("llama")
    llm = LLM(str(folder), num_blocks=6, block_size=4, max_num_seqs=2)
    metrics = ServerMetrics(MODEL)
    llm.engine.add_observer(metrics)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    llm.engine.add_request("a", [5, 6, 7, 8], params)
    llm.engine.add_request("b", [9, 10, 11, 12], params)
    counted = 0.0
    while llm.engine.has_unfinished_requests() and not counted:
        llm.engine.step()
        counted = metrics.preemptions._value.get()
    assert counted >= 1 and llm.engine.has_unfinished_requests()
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
    llm.engine.kv_manager.check_no_leaks()


# -- a failing step -----------------------------------------------------------------------


def test_a_failing_step_is_an_error_frame_and_the_server_keeps_serving(folder):
    config = EngineConfig.from_kwargs(str(folder))
    engine = Engine(config, make_executor(config))
    metrics = ServerMetrics(MODEL)
    async_engine = AsyncEngine(engine, metrics=metrics)
    real_step = engine.step
    failures = iter([True])

    def flaky_step():
        if next(failures, False):
            raise RuntimeError("injected fault")
        return real_step()

    engine.step = flaky_step
    try:
        with thread_server(build_app(async_engine, MODEL)) as base_url:
            body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, "stream": True}
            lines = [
                line
                for line in httpx.post(f"{base_url}/v1/completions", json=body).text.splitlines()
                if line
            ]
            assert lines[-1] == "data: [DONE]"
            error = json.loads(lines[-2].removeprefix("data: "))["error"]
            assert "injected fault" in error["message"] and error["type"] == "server_error"
            again = httpx.post(f"{base_url}/v1/completions", json={**body, "stream": False})
            assert again.status_code == 200
            assert again.json()["usage"]["completion_tokens"] == 4
    finally:
        async_engine.shutdown()
    engine.kv_manager.check_no_leaks()


def test_prefix_cache_hits_show_in_usage_and_metrics(server, client, reference):
    ids = reference("x " * 40, max_tokens=1).prompt_token_ids  # a prompt of 40+ tokens
    hits_before = metric(server, "prefix_cache_hits_total")
    first = client.completions.create(model=MODEL, prompt=ids, max_tokens=2, temperature=0)
    again = client.completions.create(model=MODEL, prompt=ids, max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert cached == (len(ids) - 1) // 16 * 16 > 0  # whole blocks, one token short
    assert again.choices[0].text == first.choices[0].text
    salted = client.completions.create(
        model=MODEL, prompt=ids, max_tokens=2, temperature=0, extra_body={"cache_salt": "t1"}
    )
    assert salted.usage.prompt_tokens_details.cached_tokens == 0
    assert metric(server, "prefix_cache_hits_total") - hits_before == cached
