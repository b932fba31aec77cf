"""OpenAI's Responses API, checked with OpenAI's own SDK (``responses.create`` and
``responses.stream``, whose accumulator checks the event sequence) against a real
server: the same greedy tokens as the chat and Messages APIs for the same
conversation, function calls held to their schemas and streamed as argument deltas,
json_schema outputs, and every stateful or unserved field refused with a 400 naming
it."""

from __future__ import annotations

import json

import anthropic
import jsonschema
import openai
import pytest

from tandem.server.launch import tandem_process
from tests.servers import MODEL, serve
from tests.test_tool_calls import TOOLS, tool_model

QUESTION = "What is 2 + 2?"
FUNCTIONS = [{"type": "function", **tool["function"]} for tool in TOOLS]
SCHEMAS = {tool["name"]: tool["parameters"] for tool in FUNCTIONS}


@pytest.fixture(scope="module")
def server(model_dirs, tmp_path_factory):
    with serve(tool_model(model_dirs, tmp_path_factory)) as url:
        yield url


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0)


def test_the_three_apis_give_the_same_greedy_tokens(client, server):
    system = "You are terse."
    response = client.responses.create(
        model=MODEL, input=QUESTION, instructions=system, max_output_tokens=12, temperature=0
    )
    chat = client.chat.completions.create(
        model=MODEL, max_tokens=12, temperature=0,
        messages=[{"role": "system", "content": system}, {"role": "user", "content": QUESTION}],
    )  # fmt: skip
    message = anthropic.Anthropic(base_url=server, api_key="unused").messages.create(
        model=MODEL, max_tokens=12, system=system, extra_body={"temperature": 0},
        messages=[{"role": "user", "content": QUESTION}],
    )  # fmt: skip
    text = chat.choices[0].message.content
    assert response.output_text == text == message.content[0].text
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.usage.output_tokens == chat.usage.completion_tokens
    assert response.object == "response" and response.id.startswith("resp_")
    assert response.status == (
        "incomplete" if chat.choices[0].finish_reason == "length" else "completed"
    )
    if response.status == "incomplete":
        assert response.incomplete_details.reason == "max_output_tokens"
    # the same conversation as items
    items = client.responses.create(
        model=MODEL, max_output_tokens=12, temperature=0,
        input=[{"role": "developer", "content": system},
               {"role": "user", "content": [{"type": "input_text", "text": QUESTION}]}],
    )  # fmt: skip
    assert items.output_text == text


def test_a_stream_adds_up_to_the_response(client):
    options = dict(model=MODEL, input=QUESTION, max_output_tokens=16, temperature=0)
    whole = client.responses.create(**options)
    with client.responses.stream(**options) as stream:
        events = list(stream)
    kinds = [event.type for event in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert "response.output_text.delta" in kinds and "response.output_item.done" in kinds
    # cut by max_output_tokens, as OpenAI's streams end: response.incomplete (the SDK's
    # get_final_response waits for response.completed only)
    assert kinds[-1] == f"response.{whole.status}"
    final = events[-1].response
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert final.output_text == deltas == whole.output_text
    assert final.usage.output_tokens == whole.usage.output_tokens
    assert [e.sequence_number for e in events] == list(range(len(events)))


@pytest.mark.parametrize("stream", [False, True])
def test_required_function_calls_are_valid_and_streamed_as_deltas(client, stream):
    options = dict(
        model=MODEL, input=QUESTION, tools=FUNCTIONS, tool_choice="required",
        parallel_tool_calls=False, max_output_tokens=120, temperature=1.0,
    )  # fmt: skip
    if stream:
        with client.responses.stream(**options) as events:
            deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
            response = events.get_final_response()
        assert len(deltas) > 2
        assert "".join(deltas) == response.output[0].arguments
    else:
        response = client.responses.create(**options)
    [call] = response.output
    assert call.type == "function_call" and call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
    # the call and its output continue the conversation
    follow = client.responses.create(
        model=MODEL, max_output_tokens=4, tools=FUNCTIONS,
        input=[{"role": "user", "content": QUESTION},
               {"type": "function_call", "call_id": call.call_id, "name": call.name,
                "arguments": call.arguments},
               {"type": "function_call_output", "call_id": call.call_id, "output": "4"}],
    )  # fmt: skip
    assert follow.status in ("completed", "incomplete")


def test_a_json_schema_format_holds_the_output(client):
    schema = {
        "type": "object", "properties": {"answer": {"type": "integer"}},
        "required": ["answer"], "additionalProperties": False,
    }  # fmt: skip
    response = client.responses.create(
        model=MODEL, input=QUESTION, max_output_tokens=40, temperature=1.0,
        text={"format": {"type": "json_schema", "name": "answer", "schema": schema}},
    )  # fmt: skip
    jsonschema.validate(json.loads(response.output_text), schema)


@pytest.mark.parametrize(
    "overrides, param",
    [
        ({"store": True}, "store"),
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"background": True}, "background"),
        ({"truncation": "auto"}, "truncation"),
        ({"include": ["message.output_text.logprobs"]}, "include"),
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
         "input[0].content[0].type"),
        ({"max_output_tokens": 2**70}, "max_output_tokens"),
        ({"text": {"format": {"type": "xml"}}}, "text.format.type"),
    ],
)  # fmt: skip
def test_what_is_not_served_is_refused_naming_the_field(client, overrides, param):
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(**{"model": MODEL, "input": QUESTION, **overrides})
    assert refused.value.body["param"] == param


@pytest.fixture(scope="module")
def real_server():
    with tandem_process("serve") as url:  # the bundled model's real weights: it ends answers
        yield url


def test_an_openai_agents_sdk_agent_runs_a_tool_turn(real_server):
    """The OpenAI Agents SDK, unchanged, on its default Responses model: it calls the
    tool (required on the first turn), gets the tool's output back as an input item,
    and answers (a random model would never end its answer: the SDK treats a response
    cut by max_output_tokens as a failure)."""
    from agents import (
        Agent,
        ModelSettings,
        OpenAIResponsesModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )

    set_tracing_disabled(True)  # (tracing would export to OpenAI's servers)
    client = openai.AsyncOpenAI(base_url=f"{real_server}/v1", api_key="unused")
    model = openai.OpenAI(base_url=f"{real_server}/v1", api_key="unused").models.list().data[0].id
    asked = []

    @function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        asked.append(city)
        return "sunny"

    agent = Agent(
        name="weather",
        instructions="Answer with the weather.",
        tools=[get_weather],
        model=OpenAIResponsesModel(model=model, openai_client=client),
        # (one call a turn: SmolLM2, held to a list of calls in Hermes' spelling, repeats
        # its call when it may)
        model_settings=ModelSettings(
            tool_choice="required", parallel_tool_calls=False, max_tokens=256, temperature=0.2
        ),
    )
    result = Runner.run_sync(agent, "What is the weather in Oslo?", max_turns=4)
    assert len(asked) == 1  # one call; the SDK then resets tool_choice to auto
    kinds = [item.type for item in result.new_items]
    assert kinds[:2] == ["tool_call_item", "tool_call_output_item"]
    assert isinstance(result.final_output, str)
