"""Tool calling: the parsers on known answers, and a live server whose model has a
Hermes-style chat template with tools (built here, as Qwen and Hermes templates are):
``tool_choice: required`` and a named function always give calls with valid
arguments (the grammar holds even a random-weight model to them), streamed or not."""

from __future__ import annotations

import json
import shutil

import jsonschema
import openai
import pytest

from tandem.errors import InvalidParameterError
from tandem.server.launch import tandem_process
from tandem.server.tool_calls import ToolCalling
from tests.servers import MODEL, serve

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 12},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 999},
                           "b": {"type": "integer", "minimum": 0, "maximum": 999}},
            "required": ["a", "b"],
            "additionalProperties": False,
        },
    },
}  # fmt: skip
TOOLS = [WEATHER, ADD]
PARAMETERS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}

# As Hermes and Qwen 2.5 templates do: the tools in a system turn, calls and results
# in the history.
TOOL_TEMPLATE = """
{%- if tools %}<|im_start|>system
You can call these functions: <tools>{% for tool in tools %}{{ tool | tojson }}{% endfor %}</tools>
Answer with <tool_call>{"name": ..., "arguments": ...}</tool_call> blocks.<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == "assistant" and message.tool_calls %}<|im_start|>assistant
{% for call in message.tool_calls %}<tool_call>{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}</tool_call>{% endfor %}<|im_end|>
{% elif message.role == "tool" %}<|im_start|>user
<tool_response>{{ message.content }}</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""  # noqa: E501


# -- the parsers ---------------------------------------------------------------------------


def calling(choice="auto", parser="hermes", **options) -> ToolCalling:
    return ToolCalling.of(TOOLS, choice, parser, **options)


def test_hermes_blocks_are_calls_and_the_text_before_them_content():
    text = (
        'Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", '
        '"unit": "celsius"}}\n</tool_call><tool_call>{"name": "add", "arguments": '
        '{"a": 1, "b": 2}}</tool_call>'
    )
    content, calls = calling().parse(text)
    assert content == "Let me check."
    assert [c["function"]["name"] for c in calls] == ["get_weather", "add"]
    assert json.loads(calls[1]["function"]["arguments"]) == {"a": 1, "b": 2}
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)
    assert calling().parse("Just text.") == ("Just text.", [])
    broken = "<tool_call>{not json</tool_call>"
    assert calling().parse(broken) == (broken, [])


def test_json_answers_are_calls_llama_style():
    tools = calling(parser="json")
    _, calls = tools.parse('{"name": "add", "parameters": {"a": 3, "b": 4}}')
    assert calls[0]["function"]["name"] == "add"
    assert json.loads(calls[0]["function"]["arguments"]) == {"a": 3, "b": 4}
    two = '{"name": "add", "parameters": {"a": 1}}; {"name": "add", "parameters": {"b": 2}}'
    assert len(tools.parse(two)[1]) == 2
    assert tools.parse("The answer is 7.") == ("The answer is 7.", [])


def test_streaming_holds_back_only_what_may_become_a_call():
    hermes = calling()
    assert hermes.read("Hello there", final=False).content_end == len("Hello there")
    assert hermes.read("Sure <tool_", final=False).content_end == len("Sure ")
    growing = hermes.read('Ok <tool_call>{"name": "add", "arguments": {"a": 1', final=False)
    assert growing.content_end == len("Ok ")
    assert [(c.name, c.arguments, c.complete) for c in growing.calls] == [("add", '{"a": 1', False)]
    assert calling(parser="json").read('  {"name"', final=False).content_end == 0


def test_required_and_named_constraints_are_grammars_in_the_format():
    required = calling("required", parallel=False).constraint()
    assert required.source == "tool_choice" and "<tool_call>" in required.grammar
    assert 'name\\": \\"add' in required.grammar  # the name as the template spells it
    assert "{0," not in required.grammar  # parallel off: one call
    assert "{0,2}" in calling("required", max_calls=3).constraint().grammar
    named = calling({"type": "function", "function": {"name": "add"}}).constraint().grammar
    assert "add" in named and "get_weather" not in named


OPEN_WEATHER = {  # as clients write tools: no additionalProperties
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"},
                           "where": {"type": "object", "properties": {"lat": {"type": "number"}}}},
            "required": ["city"],
        },
    },
}  # fmt: skip


def test_arguments_are_held_to_the_declared_properties():
    """A model held to an open object added undeclared properties until max_tokens."""
    schema = ToolCalling.of([OPEN_WEATHER], "required", "hermes").schemas["get_weather"]
    jsonschema.validate({"city": "Oslo", "where": {"lat": 59.9}}, schema)
    for extra in ({"city": "Oslo", "season": "winter"}, {"city": "O", "where": {"x": 1}}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(extra, schema)
    # what the client said stays: an explicit additionalProperties is kept
    open_tool = json.loads(json.dumps(OPEN_WEATHER))
    open_tool["function"]["parameters"]["additionalProperties"] = True
    arguments = ToolCalling.of([open_tool], "required", "hermes").schemas["get_weather"]
    jsonschema.validate({"city": "Oslo", "season": "winter"}, arguments)


def test_a_required_answer_cut_short_keeps_its_completed_calls():
    arguments = '{"city": "Oslo", "unit": "celsius"}'
    call = f'<tool_call>\n{{"name": "get_weather", "arguments": {arguments}}}\n</tool_call>'
    content, calls = calling("required").parse(f'{call}\n{call}\n<tool_call>\n{{"name": "get_w')
    assert content is None and len(calls) == 2
    assert json.loads(calls[1]["function"]["arguments"])["city"] == "Oslo"
    # cut before any call was whole: no calls, and never the raw text as content
    assert calling("required").parse('<tool_call>\n{"name": "get_w') == (None, [])


@pytest.mark.parametrize(
    ("tools", "choice", "param"),
    [
        ([{"type": "retrieval"}], "auto", "tools[0]"),
        ([{"type": "function", "function": {"name": "has space"}}], "auto",
         "tools[0].function.name"),
        ([WEATHER, WEATHER], "auto", "tools"),
        (TOOLS, {"type": "function", "function": {"name": "nope"}}, "tool_choice"),
        (TOOLS, "sometimes", "tool_choice"),
        (None, "required", "tool_choice"),
    ],
)  # fmt: skip
def test_bad_tools_are_refused_naming_the_field(tools, choice, param):
    with pytest.raises(InvalidParameterError) as refused:
        ToolCalling.of(tools, choice, "hermes")
    assert refused.value.param == param


def test_no_tools_or_choice_none_means_plain_chat():
    assert ToolCalling.of(None, None, "hermes") is None
    assert ToolCalling.of(TOOLS, "none", "hermes") is None


# -- a live server ----------------------------------------------------------------------------


def tool_model(model_dirs, tmp_path_factory) -> str:
    """A tiny random model folder whose chat template renders tools (TOOL_TEMPLATE);
    the server tests of the three APIs serve it."""
    folder = tmp_path_factory.mktemp("tool-model")
    shutil.copytree(
        model_dirs("llama", max_position_embeddings=2048)[0], folder, dirs_exist_ok=True
    )
    (folder / "chat_template.jinja").write_text(TOOL_TEMPLATE)  # (read before the config's)
    return str(folder)


@pytest.fixture(scope="module")
def client(model_dirs, tmp_path_factory):
    with serve(tool_model(model_dirs, tmp_path_factory)) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


QUESTION = [{"role": "user", "content": "What is the weather in Oslo, and 2 + 2?"}]


def check_calls(calls, names=tuple(PARAMETERS)) -> None:
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), PARAMETERS[call.function.name])


def streamed_calls(chunks):
    """The tool calls of a stream, put together as OpenAI's streams are: a call's first
    delta has its id, type and name, the next ones pieces of its arguments."""
    calls, pieces, finish = {}, {}, None
    for chunk in chunks:
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            for delta in choice.delta.tool_calls or []:
                if delta.index not in calls:
                    assert delta.id and delta.function.name
                    calls[delta.index], pieces[delta.index] = delta, 0
                else:
                    assert delta.id is None and delta.function.name is None
                    calls[delta.index].function.arguments += delta.function.arguments
                pieces[delta.index] += 1
    return [calls[i] for i in sorted(calls)], finish, pieces


@pytest.mark.parametrize("stream", [False, True])
def test_required_always_gives_valid_calls(client, stream):
    for seed in range(4):
        reply = client.chat.completions.create(
            model=MODEL, messages=QUESTION, tools=TOOLS, tool_choice="required",
            max_tokens=120, temperature=1.0, seed=seed, stream=stream,
            parallel_tool_calls=False,  # (a random model would list calls forever)
        )  # fmt: skip
        if stream:
            calls, finish, pieces = streamed_calls(reply)
            assert max(pieces.values()) > 2  # the arguments arrive as the model writes them
        else:
            calls, finish = reply.choices[0].message.tool_calls, reply.choices[0].finish_reason
        assert finish == "tool_calls"
        check_calls(calls)


def test_parallel_required_calls_cut_short_still_give_their_calls(client):
    """A random model lists calls until max_tokens: the calls it completed come back."""
    for seed in range(3):
        reply = client.chat.completions.create(
            model=MODEL, messages=QUESTION, tools=TOOLS, tool_choice="required",
            max_tokens=120, temperature=1.0, seed=seed,
        )  # fmt: skip
        check_calls(reply.choices[0].message.tool_calls)
        assert reply.choices[0].message.content is None


def test_a_named_function_is_called(client):
    options = dict(
        model=MODEL, messages=QUESTION, tools=TOOLS, max_tokens=80, temperature=1.0, seed=3,
        tool_choice={"type": "function", "function": {"name": "add"}},
    )  # fmt: skip
    reply = client.chat.completions.create(**options)
    (call,) = reply.choices[0].message.tool_calls
    check_calls([call], names=("add",))
    assert reply.choices[0].message.content is None
    (streamed,), finish, pieces = streamed_calls(
        client.chat.completions.create(**options, stream=True)
    )
    assert finish == "tool_calls" and pieces[0] > 2
    assert json.loads(streamed.function.arguments) == json.loads(call.function.arguments)


def test_tools_reach_the_template_and_none_leaves_them_out(client):
    def prompt_tokens(**options):
        reply = client.chat.completions.create(
            model=MODEL, messages=QUESTION, max_tokens=1, **options
        )
        return reply.usage.prompt_tokens

    plain = prompt_tokens()
    assert prompt_tokens(tools=TOOLS) > plain + 50  # the tools' descriptions are in it
    assert prompt_tokens(tools=TOOLS, tool_choice="none") == plain


def test_a_tool_calling_conversation_continues(client):
    first = client.chat.completions.create(
        model=MODEL, messages=QUESTION, tools=TOOLS, tool_choice="required", max_tokens=120,
        temperature=0, parallel_tool_calls=False,
    )  # fmt: skip
    message = first.choices[0].message
    history = [
        *QUESTION,
        message.model_dump(exclude_none=True),
        *[{"role": "tool", "tool_call_id": c.id, "content": "42"} for c in message.tool_calls],
    ]
    reply = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, max_tokens=8)
    assert reply.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_tool_choice_with_response_format_is_refused(client):
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(
            model=MODEL, messages=QUESTION, tools=TOOLS, tool_choice="required",
            response_format={"type": "json_object"},
        )  # fmt: skip
    assert refused.value.body["param"] == "response_format"


# -- real weights: the tracker's reproducer ---------------------------------------------------

CITY = {  # as the reproducer wrote it: no additionalProperties
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
        },
    },
}  # fmt: skip


@pytest.fixture(scope="module")
def real_client():
    with tandem_process("serve") as url:  # the bundled model's real weights
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


@pytest.mark.parametrize("parallel", [True, False])
@pytest.mark.parametrize("stream", [False, True])
def test_required_calls_on_real_weights_are_complete_and_valid(real_client, parallel, stream):
    """SmolLM2 under tool_choice required once repeated calls (parallel on) or added
    undeclared properties (parallel off) until max_tokens and answered with no call."""
    model = real_client.models.list().data[0].id
    closed = {**CITY["function"]["parameters"], "additionalProperties": False}
    for seed, max_tokens in ((0, 64), (1, 48)):
        reply = real_client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "What is the weather in Oslo?"}],
            tools=[CITY], tool_choice="required", parallel_tool_calls=parallel,
            max_tokens=max_tokens, temperature=1.0, seed=seed, stream=stream,
        )  # fmt: skip
        if stream:
            calls, finish, _ = streamed_calls(reply)
        else:
            calls, finish = reply.choices[0].message.tool_calls, reply.choices[0].finish_reason
            assert reply.choices[0].message.content is None
        assert calls and (finish == "tool_calls" or (parallel and finish == "length"))
        if not parallel:
            assert len(calls) == 1
        for call in calls if not stream or finish == "tool_calls" else calls[:-1]:
            jsonschema.validate(json.loads(call.function.arguments), closed)
