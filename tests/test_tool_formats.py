"""Tool calls in each family's own format (server/tool_formats/), checked against the
families' real chat templates (tests/chat_templates/, the models' own):

- auto picks the format the template writes;
- a tool conversation renders as transformers renders it;
- each format reads back, whole and streamed in random pieces, the calls its template
  writes for an assistant turn;
- each format's grammar (required and named calls) accepts exactly that spelling, and
  a random-weight model held to it writes calls the format reads back, valid against
  their schemas."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import jsonschema
import pytest

from tandem import LLM, SamplingParams
from tandem.models.tokenizer import Tokenizer
from tandem.outputs import CompletionOutput, RequestOutput
from tandem.runner.grammar_masks import grammar_tokenizer
from tandem.server.protocol import ChatMessage, render_conversation
from tandem.server.responses import ChoiceStream
from tandem.server.tool_calls import ToolCalling
from tandem.server.tool_formats import CHOICES, tool_format
from tandem.server.tool_formats.base import value_end
from tests.test_tool_calls import ADD, WEATHER

TEMPLATES = Path(__file__).parent / "chat_templates"
# template file -> the format auto picks (and, for Mistral, its spelling)
FAMILIES = {
    "Qwen-Qwen3-0.6B.jinja": "hermes",
    "NousResearch-Hermes-3-Llama-3.1-8B-tool_use.jinja": "hermes",
    "Qwen3-Coder.jinja": "qwen3_xml",
    "Qwen3.5-4B.jinja": "qwen3_xml",
    "meta-llama-Llama-3.2-3B-Instruct.jinja": "llama3_json",
    "mistralai-Mistral-Nemo-Instruct-2407.jinja": "mistral",
    "Mistral-Small-3.2-24B-Instruct-2506.jinja": "mistral",
    "deepseek-ai-DeepSeek-V3.1.jinja": "deepseek_v3",
    "openai-gpt-oss-120b.jinja": "harmony",
}

# The tool-calling tests' tools; Hermes 3's template needs every tool described.
TOOLS = [WEATHER, {**ADD, "function": {**ADD["function"], "description": "Adds two numbers."}}]
CALLS = [  # as OpenAI's clients send an assistant's calls back: arguments as JSON text
    {"id": "abcDEF123", "type": "function",
     "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "unit": "celsius"}'}},
    {"id": "xyzXYZ789", "type": "function",
     "function": {"name": "add", "arguments": '{"a": 2, "b": 40}'}},
]  # fmt: skip
QUESTION = [{"role": "user", "content": "The weather in Oslo, and 2 + 40?"}]


def _calls_for(name: str) -> list[dict]:
    """Llama 3.2's and gpt-oss's templates render one call a turn."""
    return CALLS[:1] if name.startswith(("meta-llama", "openai")) else CALLS


@pytest.fixture(scope="module")
def folders(model_dirs, tmp_path_factory):
    """A tiny model folder per template (its tokenizer, the family's chat template)."""
    base = model_dirs("llama")[0]
    made = {}
    for name in FAMILIES:
        folder = tmp_path_factory.mktemp(name.removesuffix(".jinja"))
        for path in base.iterdir():
            if path.name != "chat_template.jinja":
                shutil.copy(path, folder / path.name)
        (folder / "chat_template.jinja").write_text((TEMPLATES / name).read_text())
        made[name] = folder
    return made


def _render(folder: Path, messages: list[dict], generation_prompt: bool) -> str:
    conversation = render_conversation([ChatMessage.model_validate(m) for m in messages])
    return Tokenizer(folder).apply_chat_template(
        conversation, add_generation_prompt=generation_prompt, tools=TOOLS
    )


def _assistant_text(folder: Path, name: str) -> str:
    """What the template writes for the assistant's turn of calls: the rendered
    conversation past the prompt that asks for it."""
    prompt = _render(folder, QUESTION, True)
    turn = {"role": "assistant", "content": None, "tool_calls": _calls_for(name)}
    whole = _render(folder, [*QUESTION, turn], False)
    shared = 0
    while shared < min(len(prompt), len(whole)) and prompt[shared] == whole[shared]:
        shared += 1
    return whole[shared:]


@pytest.mark.parametrize("name", FAMILIES)
def test_auto_picks_the_format_the_template_writes(name):
    template = (TEMPLATES / name).read_text()
    assert tool_format("auto", template).name == FAMILIES[name]
    assert tool_format("auto", None).name == "hermes"
    assert tool_format("auto", "{{ messages }}").name == "hermes"
    mistral = tool_format("auto", template)
    if FAMILIES[name] == "mistral":
        assert mistral.args_spelling == ("[ARGS]" in template)
    with pytest.raises(ValueError, match="unknown tool-call parser"):
        tool_format("granite", template)
    assert {"qwen3_coder", "llama3_json", "json", "deepseek_v31", "pythonic"} <= set(CHOICES)


@pytest.mark.parametrize("name", FAMILIES)
def test_a_tool_conversation_renders_as_transformers_renders_it(name, folders):
    transformers = pytest.importorskip("transformers")
    folder = folders[name]
    history = [
        *QUESTION,
        {"role": "assistant", "content": None, "tool_calls": _calls_for(name)},
        *[{"role": "tool", "tool_call_id": c["id"], "content": "42"} for c in _calls_for(name)],
    ]
    theirs = transformers.AutoTokenizer.from_pretrained(str(folder))
    # transformers' convention: an assistant's call arguments are an object
    decoded = json.loads(json.dumps(history))
    decoded[1]["content"] = ""  # (templates that concatenate the content need text)
    for call in decoded[1]["tool_calls"]:
        call["function"]["arguments"] = json.loads(call["function"]["arguments"])
    expected = theirs.apply_chat_template(
        decoded, tools=TOOLS, tokenize=False, add_generation_prompt=True
    )
    assert _render(folder, history, True) == expected


def _stream(text: str, tools: ToolCalling, seed: int):
    """Feed ``text`` to a ChoiceStream in random pieces; returns the content streamed,
    the calls put together from their deltas, and the whole answer's message."""
    rng = random.Random(seed)
    state = ChoiceStream("r", "m", 0, ["e"], 1, chat=True, want_logprobs=False, tools=tools)
    content, calls, position = "", {}, 0
    while position < len(text):
        step = rng.randint(1, 6)
        piece, position = text[position : position + step], position + step
        finish = "stop" if position >= len(text) else None
        output = RequestOutput("e", None, [1], [CompletionOutput(0, piece, [0], finish)],
                               finish is not None)  # fmt: skip
        for index, delta in state.update(output):
            chunk = state.chunk(index, delta)
            if chunk is None:
                continue
            message = chunk["choices"][0]["delta"]
            content += message.get("content") or ""
            for call in message.get("tool_calls") or []:
                if call["index"] not in calls:
                    calls[call["index"]] = [call["function"]["name"], ""]
                calls[call["index"]][1] += call["function"].get("arguments") or ""
    whole = state.final_response()["choices"][0]["message"]
    return content, [calls[i] for i in sorted(calls)], whole


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("seed", range(3))
def test_each_format_reads_what_its_template_writes_whole_and_streamed(name, folders, seed):
    text = _assistant_text(folders[name], name)
    tools = ToolCalling.of(TOOLS, "auto", tool_format("auto", (TEMPLATES / name).read_text()))
    expected = [(c["function"]["name"], json.loads(c["function"]["arguments"]))
                for c in _calls_for(name)]  # fmt: skip
    _, calls = tools.parse(text)
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == (
        expected
    )
    streamed_content, streamed, whole = _stream(text, tools, seed)
    assert [(n, json.loads(a)) for n, a in streamed] == expected
    # nothing of a call went out as content, not even a tag's first characters
    assert streamed_content.strip() == (whole["content"] or "")
    assert [c["function"]["arguments"] for c in whole["tool_calls"]] == [a for _, a in streamed]


def test_plain_text_stays_content_in_every_format():
    for name in ("hermes", "qwen3_xml", "llama3_json", "mistral", "deepseek_v3", "pythonic",
                 "harmony"):  # fmt: skip
        tools = ToolCalling.of(TOOLS, "auto", name)
        assert tools.parse("It is sunny in Oslo.") == ("It is sunny in Oslo.", [])
        content, calls, _ = _stream("It is sunny in Oslo.", tools, 0)
        assert content == "It is sunny in Oslo." and calls == []


def test_a_number_at_the_end_of_a_growing_text_may_still_grow():
    assert value_end('{"a": 12', 0, final=False) is None
    assert value_end("12", 0, final=False) is None and value_end("12", 0, final=True) == 2
    assert value_end('"a\\"b" tail', 0, final=False) == len('"a\\"b"')


def test_pythonic_calls_read_as_python_reads_them():
    tools = ToolCalling.of(TOOLS, "auto", "pythonic")
    text = "[get_weather(city=\"Oslo\", unit='celsius'), add(a=2, b=40)]"
    _, calls = tools.parse(text)
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Oslo", "unit": "celsius"}),
        ("add", {"a": 2, "b": 40}),
    ]
    _, streamed, _ = _stream(f"<|python_start|>{text}<|python_end|>", tools, 1)
    assert [n for n, _ in streamed] == ["get_weather", "add"]


def test_a_qwen3_xml_value_is_read_by_its_schema():
    tools = ToolCalling.of(TOOLS, "auto", "qwen3_xml")
    text = ("<tool_call>\n<function=add>\n<parameter=a>\n7\n</parameter>\n<parameter=b>\n"
            "8\n</parameter>\n</function>\n</tool_call>")  # fmt: skip
    _, calls = tools.parse(text)
    assert json.loads(calls[0]["function"]["arguments"]) == {"a": 7, "b": 8}  # numbers
    text = text.replace("add", "get_weather").replace("=a>", "=city>").replace("=b>", "=unit>")
    _, calls = tools.parse(text)
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "7", "unit": "8"}  # text


# -- grammars ---------------------------------------------------------------------------


def _accepts(grammar: str, text: str, tokenizer: Tokenizer) -> bool:
    return _accepts_ids(grammar, tokenizer.encode(text, False), tokenizer)


def _accepts_ids(grammar: str, ids: list[int], tokenizer: Tokenizer) -> bool:
    import llguidance

    llg = grammar_tokenizer(tokenizer, tokenizer.vocab_size, (tokenizer.eos_token_id,))
    matcher = llguidance.LLMatcher(llg, grammar)
    return matcher.consume_tokens(ids) and matcher.is_accepting()


@pytest.mark.parametrize("name", FAMILIES)
def test_a_required_grammar_accepts_the_templates_own_spelling(name, folders):
    template = (TEMPLATES / name).read_text()
    tokenizer = Tokenizer(folders[name])
    tools = ToolCalling.of(TOOLS, "required", tool_format("auto", template))
    text = _assistant_text(folders[name], name)
    for end in ("<|im_end|>", "<|eot_id|>", "</s>", "<｜end▁of▁sentence｜>"):
        text = text.split(end)[0]
    text = text.split("</think>\n\n")[-1]  # (Qwen3's and Qwen3.5's empty thinking)
    grammar = tools.constraint().grammar
    assert _accepts(grammar, text.rstrip("\n") if FAMILIES[name] != "qwen3_xml" else text,
                    tokenizer), text  # fmt: skip
    assert not _accepts(grammar, text.replace("get_weather", "get_weathr"), tokenizer)


@pytest.mark.parametrize(
    "format_name",
    ["hermes", "qwen3_xml", "llama3_json", "mistral", "deepseek_v3", "pythonic", "harmony"],
)
def test_a_model_held_to_each_grammar_writes_calls_its_format_reads(format_name, model_dirs):
    llm = LLM(str(model_dirs("llama")[0]))
    for choice in ("required", {"type": "function", "function": {"name": "add"}}):
        tools = ToolCalling.of(TOOLS, choice, format_name, parallel=False)
        held = tools.constraint()
        params = [
            SamplingParams(temperature=1.0, seed=seed, max_tokens=400, structured_outputs=held)
            for seed in range(3)
        ]
        prompt = {"prompt_token_ids": [5, 6, 7, 8]}
        for output in llm.generate([prompt] * 3, params, use_tqdm=False):
            completion = output.outputs[0]
            assert completion.finish_reason == "stop", completion.text
            content, calls = tools.parse(completion.text)
            assert content is None and len(calls) == 1, completion.text
            function = calls[0]["function"]
            schema = tools.schemas[function["name"]]
            jsonschema.validate(json.loads(function["arguments"]), schema)
            if choice != "required":
                assert function["name"] == "add"


def test_an_auto_call_goes_out_as_soon_as_its_name_is_committed():
    """Fed a character at a time (a step each), the call's name goes out by the step
    that writes ``"arguments": ``, and each later step's argument text with it."""
    tools = ToolCalling.of(TOOLS, "auto", "hermes")
    text = 'Checking.<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 40}}\n</tool_call>'
    state = ChoiceStream("r", "m", 0, ["e"], 1, chat=True, want_logprobs=False, tools=tools)
    named_at, pieces = None, []
    for at, ch in enumerate(text):
        finish = "stop" if at == len(text) - 1 else None
        output = RequestOutput("e", None, [1], [CompletionOutput(0, ch, [0], finish)],
                               finish is not None)  # fmt: skip
        for index, delta in state.update(output):
            chunk = state.chunk(index, delta)
            for call in (chunk or {"choices": [{"delta": {}}]})["choices"][0]["delta"].get(
                "tool_calls"
            ) or []:
                if call.get("id"):
                    named_at = at
                pieces.append((at, call["function"].get("arguments") or ""))
    key = text.index('"arguments"')
    assert key < named_at <= key + len('"arguments": ')  # no later than its key is written
    assert "".join(p for _, p in pieces) == '{"a": 2, "b": 40}'
    assert len(pieces) > 10  # the arguments went out as they were written


def test_markers_that_are_special_tokens_are_written_and_read_as_them(folders, tmp_path):
    """A Mistral-style tokenizer keeps [TOOL_CALLS] and [ARGS] as special tokens: the
    grammar spells them as those tokens (their text's bytes would never give them) and
    the reply, decoded with special tokens kept, reads back."""
    from tokenizers import Tokenizer as Backend

    from tandem.server.tool_calls import special_literal

    folder = folders["Mistral-Small-3.2-24B-Instruct-2506.jinja"]
    for path in folder.iterdir():
        shutil.copy(path, tmp_path / path.name)
    backend = Backend.from_file(str(tmp_path / "tokenizer.json"))
    backend.add_special_tokens(["[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"])
    backend.save(str(tmp_path / "tokenizer.json"))
    tokenizer = Tokenizer(tmp_path)
    literal = special_literal(tokenizer)
    calls_id, args_id = (tokenizer.encode(t, False)[0] for t in ("[TOOL_CALLS]", "[ARGS]"))
    assert literal("[TOOL_CALLS]") == f"<[{calls_id}]>" and literal("add") == '"add"'
    template = (TEMPLATES / "Mistral-Small-3.2-24B-Instruct-2506.jinja").read_text()
    tools = ToolCalling.of(TOOLS, "required", tool_format("auto", template), literal=literal)
    grammar = tools.constraint().grammar
    ids = [calls_id, *tokenizer.encode("add", False), args_id,
           *tokenizer.encode('{"a": 1, "b": 2}', False)]  # fmt: skip
    assert _accepts_ids(grammar, ids, tokenizer)
    _, calls = tools.parse(tokenizer.decode(ids, skip_special_tokens=False))
    assert [c["function"]["name"] for c in calls] == ["add"]
    assert tokenizer.decode(ids, skip_special_tokens=True).startswith("add")  # (why it's off)
