"""Anthropic's Messages API, checked with Anthropic's own SDK against a real server: a
message is what the chat path answers for the same conversation (text, usage, stop
reason), its stream holds Anthropic's event sequence and adds up to the same message,
tools give tool_use blocks held to their schemas (streamed as input_json_delta), and
errors come in Anthropic's shape with its status codes and error types."""

from __future__ import annotations

import anthropic
import httpx
import jsonschema
import openai
import pytest

from tests.servers import MODEL, serve
from tests.test_tool_calls import ADD, TOOLS, tool_model

KEY = "test-key"
QUESTION = [{"role": "user", "content": "What is 2 + 2?"}]
ANTHROPIC_TOOLS = [
    {"name": t["function"]["name"], "description": t["function"].get("description", ""),
     "input_schema": t["function"]["parameters"]}
    for t in TOOLS
]  # fmt: skip
SCHEMAS = {t["name"]: t["input_schema"] for t in ANTHROPIC_TOOLS}
# The SDK's create() no longer takes sampling settings; the API still does.
GREEDY, SAMPLED = {"temperature": 0}, {"temperature": 1.0, "top_k": 50}


@pytest.fixture(scope="module")
def server(model_dirs, tmp_path_factory):
    with serve(tool_model(model_dirs, tmp_path_factory), "--api-key", KEY) as url:
        yield url


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server, api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def chat(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key=KEY, max_retries=0)


def test_a_message_is_what_the_chat_path_answers(client, chat):
    system = "You are terse."
    message = client.messages.create(
        model=MODEL, max_tokens=12, system=system, messages=QUESTION, extra_body=GREEDY
    )
    reply = chat.chat.completions.create(
        model=MODEL, max_tokens=12, temperature=0,
        messages=[{"role": "system", "content": system}, *QUESTION],
    )  # fmt: skip
    assert message.type == "message" and message.role == "assistant" and message.model == MODEL
    assert message.id.startswith("msg_")
    [block] = message.content
    assert block.type == "text" and block.text == reply.choices[0].message.content
    assert message.usage.input_tokens == reply.usage.prompt_tokens
    assert message.usage.output_tokens == reply.usage.completion_tokens
    finish = reply.choices[0].finish_reason
    assert message.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[finish]
    assert message.stop_sequence is None
    # system as text blocks, and content as blocks: the same conversation
    blocks = client.messages.create(
        model=MODEL, max_tokens=12, extra_body=GREEDY, system=[{"type": "text", "text": system}],
        messages=[{"role": "user", "content": [{"type": "text", "text": "What is 2 + 2?"}]}],
    )  # fmt: skip
    assert blocks.content[0].text == block.text
    count = client.messages.count_tokens(model=MODEL, system=system, messages=QUESTION)
    assert count.input_tokens == message.usage.input_tokens


def test_a_stream_is_anthropics_event_sequence_and_adds_up_to_the_message(client):
    options = dict(model=MODEL, max_tokens=16, messages=QUESTION, extra_body=GREEDY)
    whole = client.messages.create(**options)
    with client.messages.stream(**options) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start"
    assert kinds[-2:] == ["message_delta", "message_stop"]
    assert kinds.count("content_block_start") == kinds.count("content_block_stop") == 1
    assert "content_block_delta" in kinds
    assert final.content[0].text == whole.content[0].text
    assert final.stop_reason == whole.stop_reason
    assert final.usage.output_tokens == whole.usage.output_tokens
    # the raw stream has the ping Anthropic's servers send after message_start
    raw = httpx.post(
        f"{str(client.base_url).rstrip('/')}/v1/messages",
        json={"model": MODEL, "max_tokens": 16, "messages": QUESTION, **GREEDY, "stream": True},
        headers={"x-api-key": KEY}, timeout=60,
    )  # fmt: skip
    names = [
        line.removeprefix("event: ") for line in raw.text.splitlines() if line.startswith("event: ")
    ]
    assert names[:2] == ["message_start", "ping"] and names[-1] == "message_stop"


def test_a_stop_sequence_is_named(client):
    free = client.messages.create(model=MODEL, max_tokens=16, messages=QUESTION, extra_body=GREEDY)
    text = free.content[0].text
    stop = text[len(text) // 2 :][:2]
    message = client.messages.create(
        model=MODEL, max_tokens=16, messages=QUESTION, stop_sequences=[stop], extra_body=GREEDY
    )
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == stop
    assert all(stop not in block.text for block in message.content)


@pytest.mark.parametrize("stream", [False, True])
def test_tool_choice_any_gives_tool_use_blocks(client, stream):
    options = dict(
        model=MODEL, max_tokens=120, extra_body=SAMPLED, messages=QUESTION, tools=ANTHROPIC_TOOLS,
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
    )  # fmt: skip
    if stream:
        with client.messages.stream(**options) as events:
            kinds = [(event.type, getattr(getattr(event, "delta", None), "type", None))
                     for event in events]  # fmt: skip
            message = events.get_final_message()
        assert ("content_block_delta", "input_json_delta") in kinds
    else:
        message = client.messages.create(**options)
    assert message.stop_reason == "tool_use"
    [call] = message.content
    assert call.type == "tool_use" and call.id.startswith("toolu_")
    jsonschema.validate(call.input, SCHEMAS[call.name])


def test_a_named_tool_and_a_tool_result_conversation(client):
    first = client.messages.create(
        model=MODEL, max_tokens=80, extra_body=SAMPLED, messages=QUESTION, tools=ANTHROPIC_TOOLS,
        tool_choice={"type": "tool", "name": "add"},
    )  # fmt: skip
    [call] = first.content
    assert call.name == "add" and first.stop_reason == "tool_use"
    jsonschema.validate(call.input, ADD["function"]["parameters"])
    history = [
        *QUESTION,
        {"role": "assistant", "content": [block.model_dump() for block in first.content]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": call.id, "content": "4"},
            {"type": "text", "text": "Thanks."},
        ]},
    ]  # fmt: skip
    reply = client.messages.create(
        model=MODEL, max_tokens=4, messages=history, tools=ANTHROPIC_TOOLS
    )
    assert reply.stop_reason in ("max_tokens", "end_turn", "tool_use")
    # the tool result and the call reached the template (they are counted)
    plain = client.messages.count_tokens(model=MODEL, messages=QUESTION, tools=ANTHROPIC_TOOLS)
    counted = client.messages.count_tokens(model=MODEL, messages=history, tools=ANTHROPIC_TOOLS)
    assert counted.input_tokens > plain.input_tokens + 10


def error_of(call) -> tuple[int, dict]:
    with pytest.raises(anthropic.APIStatusError) as raised:
        call()
    return raised.value.status_code, raised.value.body


@pytest.mark.parametrize(
    "overrides, status, kind, names",
    [
        ({"max_tokens": None}, 400, "invalid_request_error", "max_tokens"),
        ({"max_tokens": 2**70}, 400, "invalid_request_error", "max_tokens"),
        ({"temperature": 1.5}, 400, "invalid_request_error", "temperature"),
        ({"model": "other"}, 404, "not_found_error", "other"),
        ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, 400,
         "invalid_request_error", "messages[0].content[0].type"),
        # a tool result's content neither text nor blocks (was a 500: iterated as a list)
        ({"messages": [{"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "t", "content": 5}]}]}, 400,
         "invalid_request_error", "messages[0].content[0].content"),
        ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, 400,
         "invalid_request_error", "thinking"),
        ({"stop_sequences": ["x"] * 17}, 400, "invalid_request_error", "stop_sequences"),
        ({"tool_choice": {"type": "tool", "name": "nope"}, "tools": ANTHROPIC_TOOLS}, 400,
         "invalid_request_error", "tool_choice"),
    ],
)  # fmt: skip
def test_errors_come_in_anthropics_shape(server, overrides, status, kind, names):
    body = {"model": MODEL, "max_tokens": 4, "messages": QUESTION, **overrides}
    body = {k: v for k, v in body.items() if v is not None}
    response = httpx.post(f"{server}/v1/messages", json=body, headers={"x-api-key": KEY})
    assert response.status_code == status, response.text
    error = response.json()
    assert error["type"] == "error" and error["error"]["type"] == kind
    assert set(error["error"]) == {"type", "message"} and names in error["error"]["message"]


def test_the_key_goes_in_x_api_key_and_a_wrong_one_is_refused(server):
    wrong = anthropic.Anthropic(base_url=server, api_key="wrong", max_retries=0)
    status, error = error_of(
        lambda: wrong.messages.create(model=MODEL, max_tokens=2, messages=QUESTION)
    )
    assert status == 401 and error["error"]["type"] == "authentication_error"


def test_a_body_over_the_limit_is_refused_in_anthropics_shape(server):
    """The body guard answers before the app: it too speaks the route's API."""
    big = {
        "model": MODEL,
        "max_tokens": 1,
        "messages": [{"role": "user", "content": "x" * 9_000_000}],
    }
    response = httpx.post(f"{server}/v1/messages", json=big, headers={"x-api-key": KEY}, timeout=60)
    assert response.status_code == 413
    assert response.json()["error"]["type"] == "request_too_large"
    assert response.json()["type"] == "error"
