"""Thinking kept apart from the answer (server/reasoning.py): the parser on texts as
thinking models write them, the stream's deltas against the whole answer however the
text arrives, and OpenAI's SDK against a real server whose chat template opens the
thinking (or closes it, with ``enable_thinking: false``)."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import openai
import pytest

from tandem.config import EngineConfig
from tandem.engine.engine import Engine
from tandem.executor import make_executor
from tandem.models.tokenizer import Tokenizer
from tandem.outputs import CompletionOutput, RequestOutput
from tandem.server.api import build_app
from tandem.server.reasoning import HarmonyParser, ThinkParser, parser_for, plan, starts_inside
from tandem.server.responses import ChoiceStream
from tandem.server.tool_calls import ToolCalling
from tandem.serving.async_engine import AsyncEngine
from tests.servers import thread_server

ANSWER = "<think>\nThe capital of France\nis Paris.</think>\n\nParis."


def test_the_thinking_and_the_reply_of_a_whole_answer():
    assert ThinkParser(False).split(ANSWER) == ("\nThe capital of France\nis Paris.", "Paris.")
    assert ThinkParser(False).split("Paris.") == (None, "Paris.")  # no thinking at all
    # The prompt opened the tag: the text starts inside the thinking.
    assert ThinkParser(True).split("so: Paris.</think>Paris.") == ("so: Paris.", "Paris.")
    assert ThinkParser(True).split("cut off mid-thought") == ("cut off mid-thought", "")
    assert ThinkParser(False).split("<think></think>Paris.") == ("", "Paris.")


def test_a_prompt_opens_or_closes_the_thinking():
    assert starts_inside("<|assistant|><think>\n")
    assert not starts_inside("<|assistant|><think>\n\n</think>\n\n")  # enable_thinking off
    assert not starts_inside("<|assistant|>")
    assert parser_for("auto", "{{ '<think>' }}...{{ '</think>' }}") == "think"
    assert parser_for("auto", "{{ messages }}") is None and parser_for("auto", None) is None
    assert parser_for("deepseek_r1", None) == parser_for("qwen3", None) == "think"
    with pytest.raises(ValueError, match="unknown reasoning parser"):
        parser_for("granite", None)


def _stream(text: str, parser: ThinkParser, tools: ToolCalling | None, seed: int):
    """Feed ``text`` to a ChoiceStream in random pieces (a tag may be cut anywhere);
    returns (streamed thinking, streamed content, tool calls streamed, final message)."""
    rng = random.Random(seed)
    state = ChoiceStream("r", "m", 0, ["e"], 1, chat=True, want_logprobs=False, tools=tools,
                         reasoning=parser)  # fmt: skip
    thinking, content, calls = "", "", []
    position = 0
    while position < len(text):
        step = rng.randint(1, 4)
        piece, position = text[position : position + step], position + step
        finish = "stop" if position >= len(text) else None
        completion = CompletionOutput(0, piece, [0] * len(piece), finish)
        output = RequestOutput("e", None, [1], [completion], finish is not None)
        for index, delta in state.update(output):
            chunk = state.chunk(index, delta)
            if chunk is None:
                continue
            message = chunk["choices"][0]["delta"]
            assert message.get("reasoning_content") == message.get("reasoning")
            thinking += message.get("reasoning_content") or ""
            content += message.get("content") or ""
            calls += [c for c in message.get("tool_calls") or [] if c.get("id")]  # new ones
    return thinking, content, calls, state.final_response()["choices"][0]["message"]


@pytest.mark.parametrize("seed", range(6))
def test_streamed_deltas_add_up_to_the_whole_answer(seed):
    parser = ThinkParser(False)
    thinking, content, _, message = _stream(ANSWER, parser, None, seed)
    assert (thinking, content) == parser.split(ANSWER)
    assert message["reasoning_content"] == thinking and message["content"] == content
    opened = ThinkParser(True)  # nothing of the tag ever leaks into either part
    thinking, content, _, _ = _stream("a < b.</think>ok", opened, None, seed)
    assert (thinking, content) == ("a < b.", "ok")


@pytest.mark.parametrize("seed", range(4))
def test_a_tool_call_after_the_thinking_is_read_from_the_reply(seed):
    tools = ToolCalling.of(
        [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}],
        "auto", "hermes",
    )  # fmt: skip
    call = '<tool_call>\n{"name": "weather", "arguments": {}}\n</tool_call>'
    text = f"<think>I should call it.</think>\n{call}"
    thinking, content, calls, message = _stream(text, ThinkParser(False), tools, seed)
    assert thinking == "I should call it." and content == ""
    assert [c["function"]["name"] for c in calls] == ["weather"]
    assert message["tool_calls"][0]["function"]["name"] == "weather"
    assert message["reasoning_content"] == "I should call it."


def test_the_thinking_tokens_are_counted_to_the_end_tags_token():
    pieces = ["<think>", "\nso", " it is", "</", "think", ">\n\n", "Paris", "."]
    ids = list(range(len(pieces)))

    def decode(token_ids):
        return "".join(pieces[i] for i in token_ids)

    text = decode(ids)
    brute = next(n for n in range(len(ids) + 1) if "</think>" in decode(ids[:n]))
    assert ThinkParser(False, decode).thinking_tokens(ids, text) == brute == 6
    assert ThinkParser(False, decode).thinking_tokens(ids[:4], decode(ids[:4])) == 4  # thinking
    assert ThinkParser(False, decode).thinking_tokens(ids[6:], decode(ids[6:])) == 0  # none
    assert ThinkParser(True, decode).thinking_tokens(ids[1:], decode(ids[1:])) == 5
    assert ThinkParser(False).thinking_tokens(ids, text) is None  # no decode: not counted


# -- harmony (gpt-oss) -----------------------------------------------------------------

GPT_OSS = Path(__file__).parent / "chat_templates" / "openai-gpt-oss-120b.jinja"
HARMONY = (
    "<|channel|>analysis<|message|>The user asks where Paris is. <b>France</b>.<|end|>"
    "<|start|>assistant<|channel|>final<|message|>Paris is in France."
)
HARMONY_CALL = (
    "<|channel|>analysis<|message|>Need the weather.<|end|>"
    "<|start|>assistant<|channel|>commentary to=functions.weather <|constrain|>json<|message|>"
    '{"city": "Oslo"}'
)


def test_harmony_keeps_the_analysis_apart_from_the_final_message():
    parser = HarmonyParser(False)
    thinking = "The user asks where Paris is. <b>France</b>."
    assert parser.split(HARMONY) == (thinking, "Paris is in France.")
    assert parser.split(HARMONY + "<|return|>") == (thinking, "Paris is in France.")
    # no analysis: the final message alone; a reply held to a structure: as it is
    assert parser.split("<|channel|>final<|message|>Paris.") == (None, "Paris.")
    assert parser.split('<|channel|>analysis<|message|>x<|end|>{"a": 1}') == ("x", '{"a": 1}')
    inside = "so.<|end|><|start|>assistant<|channel|>final<|message|>ok"
    assert HarmonyParser(True).split(inside) == ("so.", "ok")
    # a preamble (commentary, no recipient) is what the user sees
    preamble = "<|channel|>analysis<|message|>t<|end|><|start|>assistant<|channel|>commentary"
    assert parser.split(f"{preamble}<|message|>Checking.<|end|>") == ("t", "Checking.")


def test_auto_reads_harmony_where_the_template_writes_it():
    template = GPT_OSS.read_text()
    assert parser_for("auto", template) == "harmony"
    assert parser_for("openai_gptoss", None) == parser_for("harmony", None) == "harmony"
    prompt = "<|start|>user<|message|>Hi<|end|><|start|>assistant"
    gated = plan(prompt, 10, False, HarmonyParser)  # the analysis opened for the budget
    assert gated.prompt == prompt + "<|channel|>analysis<|message|>" and gated.starts_inside
    assert not plan(prompt, None, False, HarmonyParser).gated
    assert starts_inside(gated.prompt, HarmonyParser) and not starts_inside(prompt, HarmonyParser)


@pytest.mark.parametrize("seed", range(6))
def test_harmony_deltas_add_up_to_the_whole_answer(seed):
    """However the markers are cut, nothing of a header reaches either part."""
    parser = HarmonyParser(False)
    thinking, content, _, message = _stream(HARMONY, parser, None, seed)
    assert (thinking, content) == parser.split(HARMONY)
    assert message["reasoning_content"] == thinking and message["content"] == content


@pytest.mark.parametrize("seed", range(4))
def test_a_harmony_call_after_the_analysis_is_read_by_the_harmony_format(seed):
    tools = ToolCalling.of(
        [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}],
        "auto", "harmony",
    )  # fmt: skip
    thinking, content, calls, message = _stream(HARMONY_CALL, HarmonyParser(False), tools, seed)
    assert thinking == "Need the weather." and content == ""
    assert [c["function"]["name"] for c in calls] == ["weather"]
    assert message["tool_calls"][0]["function"]["arguments"] == '{"city": "Oslo"}'
    assert message["content"] is None or message["content"] == ""


@pytest.fixture(scope="module")
def harmony_client(model_dirs, tmp_path_factory):
    """A server of a model whose tokenizer has harmony's markers as special tokens
    and whose chat template is gpt-oss's (the random Llama stands in for its weights)."""
    from tokenizers import Tokenizer as Backend

    folder, _ = model_dirs("llama")
    copy = tmp_path_factory.mktemp("harmony-model")
    for path in folder.iterdir():
        shutil.copy(path, copy / path.name)
    backend = Backend.from_file(str(copy / "tokenizer.json"))
    backend.add_special_tokens(["<|start|>", "<|end|>", "<|message|>", "<|channel|>",
                                "<|constrain|>", "<|return|>", "<|call|>"])  # fmt: skip
    backend.save(str(copy / "tokenizer.json"))
    (copy / "chat_template.jinja").write_text(GPT_OSS.read_text())
    config = EngineConfig.from_kwargs(str(copy))
    engine = AsyncEngine(Engine(config, make_executor(config)))
    try:
        with thread_server(build_app(engine, "m")) as url:
            yield openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
    finally:
        engine.shutdown()


def test_a_harmony_budget_ends_the_analysis_and_a_required_call_follows(harmony_client):
    """The budget opens the analysis in the prompt and forces its <|end|> (one special
    token); a required call is then written in harmony's header, special tokens and
    all, and read back as the call."""
    budget = _ask(harmony_client, thinking_budget=3, max_tokens=12)
    message = budget.choices[0].message
    assert message.reasoning_content and "<|" not in message.reasoning_content
    assert budget.usage.completion_tokens_details.reasoning_tokens == 3 + 1
    weather = {
        "type": "function",
        "function": {
            "name": "weather",
            "description": "The weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
    called = harmony_client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "Weather in Oslo?"}], max_tokens=60,
        temperature=0, tools=[weather], tool_choice="required",
        extra_body={"thinking_budget": 2},
    ).choices[0]  # fmt: skip
    assert called.finish_reason == "tool_calls", called
    call = called.message.tool_calls[0].function
    assert call.name == "weather" and isinstance(json.loads(call.arguments)["city"], str)
    assert called.message.reasoning_content and not called.message.content


# -- a real server, OpenAI's SDK --------------------------------------------------------

# A template that opens the thinking in the generation prompt, or closes it empty when
# the request turns thinking off (chat_template_kwargs), as thinking models' do.
THINKING_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n"
    "{% else %}<think>\n{% endif %}{% endif %}"
)


@pytest.fixture(scope="module")
def thinking_folder(model_dirs, tmp_path_factory):
    folder, _ = model_dirs("llama")
    copy = tmp_path_factory.mktemp("thinking-model")
    for path in folder.iterdir():
        shutil.copy(path, copy / path.name)
    (copy / "chat_template.jinja").write_text(THINKING_TEMPLATE)
    return copy


@pytest.fixture(scope="module")
def servers(thinking_folder):
    """The same model behind two servers: reasoning parser auto (think, from the
    template) and none."""
    config = EngineConfig.from_kwargs(str(thinking_folder))
    engine = AsyncEngine(Engine(config, make_executor(config)))
    try:
        with thread_server(build_app(engine, "m")) as auto, thread_server(
            build_app(engine, "m", reasoning_parser="none")
        ) as plain:  # fmt: skip
            yield (openai.OpenAI(base_url=f"{auto}/v1", api_key="x", max_retries=0),
                   openai.OpenAI(base_url=f"{plain}/v1", api_key="x", max_retries=0))  # fmt: skip
    finally:
        engine.shutdown()


def _ask(client, stream=False, **extra):
    return client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "Where is Paris?"}], max_tokens=8,
        temperature=0, stream=stream, extra_body={"ignore_eos": True, **extra},
    )  # fmt: skip


def test_the_sdk_gets_reasoning_content_apart_from_the_content(servers):
    thinking, plain = servers
    raw = _ask(plain).choices[0].message
    assert raw.content and getattr(raw, "reasoning_content", None) is None
    message = _ask(thinking).choices[0].message
    # The prompt opened the thinking and 8 tokens never close it: all of it is thinking.
    assert message.reasoning_content == raw.content and message.content == ""
    streamed = [c.choices[0].delta for c in _ask(thinking, stream=True) if c.choices]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in streamed) == raw.content
    assert "".join(d.content or "" for d in streamed) == ""
    # usage counts the thinking's tokens: here all 8, streamed (the usage chunk) too
    assert _ask(thinking).usage.completion_tokens_details.reasoning_tokens == 8
    chunks = list(_ask(thinking, stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].usage.completion_tokens_details.reasoning_tokens == 8
    assert _ask(plain).usage.completion_tokens_details is None  # no parser: not counted


def test_thinking_turned_off_in_the_template_is_all_content(servers):
    thinking, plain = servers
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    raw = _ask(plain, **off).choices[0].message.content
    answer = _ask(thinking, **off)
    message = answer.choices[0].message
    assert message.content == raw and getattr(message, "reasoning_content", None) is None
    assert answer.usage.completion_tokens_details.reasoning_tokens == 0


# -- the thinking budget, and the Anthropic and Responses APIs ---------------------------


def _plain_thinking(servers, tokens: int) -> str:
    """What the model thinks in its first ``tokens`` tokens (the parser-less server)."""
    return _ask(servers[1], max_tokens=tokens).choices[0].message.content


def test_a_thinking_budget_ends_the_thinking_and_the_reply_follows(servers, thinking_folder):
    thinking, _ = servers
    budget = _ask(thinking, thinking_budget=3, max_tokens=14)
    message = budget.choices[0].message
    assert message.reasoning_content == _plain_thinking(servers, 3)
    assert message.content and budget.usage.completion_tokens == 14
    # the 3 thinking tokens and the forced end's (counted by decoding prefixes)
    end = Tokenizer(thinking_folder).encode("</think>", add_special_tokens=False)
    assert budget.usage.completion_tokens_details.reasoning_tokens == 3 + len(end)
    # OpenAI's effort names a budget: none ends the thinking at once.
    none = _ask(thinking, reasoning_effort="none", max_tokens=12).choices[0].message
    assert none.reasoning_content == "" and none.content


def test_a_structured_reply_comes_after_free_thinking(servers):
    thinking, _ = servers
    choices = ["yes", "no"]
    answer = thinking.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "Is Paris in France?"}],
        max_tokens=20, temperature=0, extra_body={"structured_outputs": {"choice": choices},
                                                  "thinking_budget": 4},
    ).choices[0]  # fmt: skip
    assert answer.message.reasoning_content and answer.message.content in choices
    assert answer.finish_reason == "stop"


def test_a_budget_without_a_thinking_model_is_refused_naming_the_field(servers):
    with pytest.raises(openai.BadRequestError) as refused:
        _ask(servers[1], thinking_budget=3)
    assert refused.value.body["param"] == "thinking_budget"


@pytest.fixture(scope="module")
def anthropic_client(servers):
    anthropic = pytest.importorskip("anthropic")
    return anthropic.Anthropic(base_url=str(servers[0].base_url).removesuffix("/v1/"),
                               api_key="x", max_retries=0)  # fmt: skip


def _message(client, **options):
    return dict(model="m", max_tokens=14, extra_body={"temperature": 0},
                messages=[{"role": "user", "content": "Where is Paris?"}], **options)  # fmt: skip


def test_anthropic_thinking_comes_as_a_thinking_block_whole_and_streamed(servers, anthropic_client):
    options = _message(anthropic_client, thinking={"type": "enabled", "budget_tokens": 3})
    message = anthropic_client.messages.create(**options)
    assert [block.type for block in message.content] == ["thinking", "text"]
    assert message.content[0].thinking == _plain_thinking(servers, 3)
    with anthropic_client.messages.stream(**options) as stream:
        kinds = [event.delta.type for event in stream if event.type == "content_block_delta"]
        streamed = stream.get_final_message()
    assert {"thinking_delta", "signature_delta", "text_delta"} <= set(kinds)

    def blocks(content):
        return [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in content]

    assert blocks(streamed.content) == blocks(message.content)


def test_anthropic_thinking_disabled_turns_it_off_in_the_template(servers, anthropic_client):
    options = _message(anthropic_client, thinking={"type": "disabled"})
    message = anthropic_client.messages.create(**options)
    off = _ask(servers[1], max_tokens=14, chat_template_kwargs={"enable_thinking": False})
    assert [block.type for block in message.content] == ["text"]
    assert message.content[0].text == off.choices[0].message.content.strip()


def test_a_budget_as_large_as_max_tokens_is_anthropics_400(anthropic_client):
    import anthropic

    with pytest.raises(anthropic.BadRequestError, match="budget_tokens"):
        anthropic_client.messages.create(**_message(
            anthropic_client, thinking={"type": "enabled", "budget_tokens": 14}))  # fmt: skip
    with pytest.raises(anthropic.BadRequestError, match="budget_tokens"):  # (not ignored)
        anthropic_client.messages.create(**_message(
            anthropic_client, thinking={"type": "adaptive", "budget_tokens": 4}))  # fmt: skip


def test_the_responses_api_returns_a_reasoning_item_whole_and_streamed(servers):
    client = servers[0]
    options = dict(model="m", input="Where is Paris?", max_output_tokens=8, temperature=0)
    response = client.responses.create(**options)
    assert [item.type for item in response.output] == ["reasoning"]  # 8 tokens: all thinking
    assert response.usage.output_tokens_details.reasoning_tokens == 8
    assert response.output[0].content[0].text == _plain_thinking(servers, 8)
    minimal = client.responses.create(**options, reasoning={"effort": "minimal"})
    assert [item.type for item in minimal.output] == ["message"]  # no thinking: no item
    assert minimal.output_text
    # (the SDK's responses.stream accumulates completed responses only; these stop at
    # max_output_tokens: incomplete)
    events = list(client.responses.create(**options, reasoning={"effort": "minimal"},
                                          stream=True))  # fmt: skip
    done = [e.item for e in events if e.type == "response.output_item.done"]
    assert [item.type for item in done] == ["message"]
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == (
        minimal.output_text
    )
    streamed = client.responses.create(**options, stream=True)
    done = {e.type: e for e in streamed if e.type.startswith("response.reasoning_text")}
    assert done["response.reasoning_text.done"].text == response.output[0].content[0].text
    with pytest.raises(openai.BadRequestError, match=r"reasoning\.effort"):
        client.responses.create(**options, reasoning={"effort": "extreme"})
