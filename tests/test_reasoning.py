"""Thinking kept apart from the answer (server/reasoning.py): the parser on texts as
thinking models write them, the stream's deltas against the whole answer however the
text arrives, and OpenAI's SDK against a real server whose chat template opens the
thinking (or closes it, with ``enable_thinking: false``)."""

from __future__ import annotations

import random
import shutil

import openai
import pytest

from tandem.config import EngineConfig
from tandem.engine.engine import Engine
from tandem.executor import make_executor
from tandem.outputs import CompletionOutput, RequestOutput
from tandem.server.api import build_app
from tandem.server.reasoning import ThinkParser, parser_for, starts_inside
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
            calls += message.get("tool_calls") or []
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


def test_thinking_turned_off_in_the_template_is_all_content(servers):
    thinking, plain = servers
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    raw = _ask(plain, **off).choices[0].message.content
    message = _ask(thinking, **off).choices[0].message
    assert message.content == raw and getattr(message, "reasoning_content", None) is None
