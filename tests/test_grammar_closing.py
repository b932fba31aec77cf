"""Required and named tool calls finish within max_tokens (runner/grammar_closing.py).

The search: from states a model reaches (random walks under each format's grammar),
the closing path ends the grammar (the grammar itself says so) and the text then
reads as whole calls whose arguments hold to their schema (the format's parser,
jsonschema). The engine: a random-weight model held to a call, with a budget that
barely fits the shortest call, always answers with a whole call (without closing,
the same requests are cut inside their arguments), also while thinking, while
speculating and with many requests in one batch."""

from __future__ import annotations

import json
import random

import jsonschema
import pytest
import torch

from tandem import LLM, SamplingParams
from tandem.models.tokenizer import Tokenizer
from tandem.runner.grammar_closing import GrammarCloser, closing_path, closing_vocabulary
from tandem.runner.grammar_masks import GrammarMatcher, grammar_tokenizer
from tandem.sampling import ThinkingParams
from tandem.server.tool_calls import ToolCalling
from tandem.server.tool_formats import FORMATS

# A string nothing bounds: a random model writes it until the budget runs out.
LOOKUP = {
    "type": "function",
    "function": {
        "name": "lookup",
        "parameters": {
            "type": "object",
            "properties": {
                "query": {"type": "string"},
                "limit": {"type": "integer"},
                "tags": {"type": "array", "items": {"type": "string"}},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["query", "limit", "unit"],
        },
    },
}
NOTE = {
    "type": "function",
    "function": {
        "name": "note",
        "parameters": {
            "type": "object",
            "properties": {"text": {"type": "string"}, "done": {"type": "boolean"}},
            "required": ["text"],
        },
    },
}
TOOLS = [LOOKUP, NOTE]
SCHEMAS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
NAMED = {"type": "function", "function": {"name": "lookup"}}


@pytest.fixture(scope="module")
def tiny_folder(model_dirs):
    return str(model_dirs("llama", max_position_embeddings=2048)[0])


def _allowed(matcher, vocab_size: int) -> torch.Tensor:
    mask = torch.frombuffer(bytearray(matcher.compute_bitmask()), dtype=torch.int32)
    bits = (mask[:, None] >> torch.arange(32)) & 1
    return bits.flatten()[:vocab_size].nonzero().flatten()


def _check_whole_calls(calling: ToolCalling, text: str) -> None:
    content, calls = calling.parse(text)
    assert calls and content is None, text
    for call in calls:
        name = call["function"]["name"]
        jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS[name])


@pytest.mark.parametrize("choice", ["required", "named"])
@pytest.mark.parametrize("name", [f.name for f in FORMATS])
def test_the_closing_path_ends_every_format_from_where_a_model_may_be(tiny_folder, name, choice):
    tokenizer = Tokenizer(tiny_folder)
    eos = tokenizer.eos_token_id
    vocabulary = grammar_tokenizer(tokenizer, tokenizer.vocab_size, (eos,))
    calling = ToolCalling.of(TOOLS, NAMED if choice == "named" else choice, name)
    grammar = _grammar(calling)
    rng = random.Random(0)
    for walk in range(12):
        matcher = GrammarMatcher(grammar, vocabulary).raw
        written = []
        for _ in range(rng.randrange(60)):  # uniform over what the grammar allows
            allowed = [t for t in _allowed(matcher, tokenizer.vocab_size).tolist() if t != eos]
            if matcher.is_stopped() or not allowed:
                break
            written.append(rng.choice(allowed))
            assert matcher.consume_token(written[-1])
        path = closing_path(matcher, closing_vocabulary(vocabulary))
        assert path is not None and path[-1] == eos, (walk, tokenizer.decode(written, False))
        if not matcher.is_stopped():  # (a grammar that cannot go on stops by itself)
            assert matcher.consume_tokens(path) and matcher.is_stopped()
        _check_whole_calls(calling, tokenizer.decode([*written, *path[:-1]], False))


def _grammar(calling: ToolCalling) -> str:
    from tandem.engine.grammar import grammar_for

    return grammar_for(calling.constraint())


def _budget(folder: str, calling: ToolCalling) -> int:
    """The shortest whole answer's length (the closing path from the grammar's start)."""
    tokenizer = Tokenizer(folder)
    vocabulary = grammar_tokenizer(tokenizer, tokenizer.vocab_size, (tokenizer.eos_token_id,))
    matcher = GrammarMatcher(_grammar(calling), vocabulary)
    return len(GrammarCloser(matcher.raw, closing_vocabulary(vocabulary)).path())


def _answers(llm: LLM, calling: ToolCalling, max_tokens: int, count: int, **extra):
    constraint = calling.constraint()
    prompts = [f"Call a tool, request {i}:" for i in range(count)]
    params = [
        SamplingParams(
            temperature=1.0, seed=seed, max_tokens=max_tokens,
            structured_outputs=constraint, **extra,
        )
        for seed in range(count)
    ]  # fmt: skip
    return [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.mark.parametrize("choice", ["required", "named"])
def test_a_random_model_always_answers_with_a_whole_call_within_a_tight_budget(tiny_folder, choice):
    calling = ToolCalling.of(
        TOOLS, NAMED if choice == "named" else choice, "hermes", parallel=False
    )
    llm = LLM(tiny_folder)
    budget = _budget(tiny_folder, calling) + 6
    tokenizer = llm.get_tokenizer()
    for output in _answers(llm, calling, budget, 16):
        assert len(output.token_ids) <= budget and output.finish_reason == "stop"
        _check_whole_calls(calling, tokenizer.decode(list(output.token_ids), False))

    # The same requests without closing: cut inside their arguments (the test can fail).
    calling.constraint = lambda original=calling.constraint: _unclosed(original())
    cut = [o for o in _answers(llm, calling, budget, 16) if o.finish_reason == "length"]
    assert len(cut) >= 8


def _unclosed(constraint):
    constraint.close_in_budget = False
    return constraint


def test_closing_holds_while_thinking_speculating_and_batched(tiny_folder):
    """The thinking is ended in time for the call to close; drafts stop in the
    window; 24 requests of different budgets in one batch each close."""
    calling = ToolCalling.of(TOOLS, "required", "hermes", parallel=True, max_calls=3)
    shortest = _budget(tiny_folder, calling)
    end = (40, 41, 42)
    thinking = LLM(tiny_folder)
    tokenizer = thinking.get_tokenizer()
    for output in _answers(thinking, calling, shortest + 9, 8, thinking=ThinkingParams(end)):
        ids = list(output.token_ids)
        assert len(ids) <= shortest + 9 and output.finish_reason == "stop"
        after = next(i for i in range(len(ids)) if tuple(ids[i - 3 : i]) == end)
        _check_whole_calls(calling, tokenizer.decode(ids[after:], False))

    spec = {"method": "ngram", "num_speculative_tokens": 3, "disable_by_batch_size": None}
    speculating = LLM(tiny_folder, speculative_config=spec, max_num_seqs=24)
    constraint = calling.constraint()
    prompts = [f"Tool {i}: " + "lookup lookup lookup " * (i % 4) for i in range(24)]
    params = [
        SamplingParams(
            temperature=1.0, seed=i, max_tokens=shortest + 2 + 5 * (i % 6),
            structured_outputs=constraint,
        )
        for i in range(24)
    ]  # fmt: skip
    for output in speculating.generate(prompts, params, use_tqdm=False):
        assert output.outputs[0].finish_reason == "stop"
        _check_whole_calls(calling, tokenizer.decode(list(output.outputs[0].token_ids), False))


def test_a_thinking_model_cannot_stop_before_its_required_call(tiny_folder):
    """End of sequence is banned while a thinking that a grammar waits for goes on
    (here made the likeliest token): the thinking ends, and the call follows."""
    calling = ToolCalling.of(TOOLS, "required", "hermes", parallel=False)
    llm = LLM(tiny_folder)
    tokenizer = llm.get_tokenizer()
    end, eos = (40, 41, 42), tokenizer.eos_token_id
    params = SamplingParams(
        temperature=1.0, seed=0, max_tokens=_budget(tiny_folder, calling) + 40,
        structured_outputs=calling.constraint(), thinking=ThinkingParams(end),
        logit_bias={eos: 50.0},
    )  # fmt: skip
    output = llm.generate("Call a tool:", params, use_tqdm=False)[0].outputs[0]
    ids = list(output.token_ids)
    after = next(i for i in range(len(ids)) if tuple(ids[i - 3 : i]) == end)
    assert eos not in ids[: after - 3] and output.finish_reason == "stop"
    _check_whole_calls(calling, tokenizer.decode(ids[after:], False))
