"""Required tool calls under tight max_tokens: how many answers hold a whole call, with
the grammar closed within the budget (runner/grammar_closing.py) and without, and
what closing costs a step. One mixed batch on the real model: 136 chat requests
(three tools, one with free-text arguments), temperature 1, max_tokens from 32 to
128 in turn, parallel calls off, in the format the model's template is read in
(hermes for SmolLM2). A budget below the shortest whole call (the closing path from
the grammar's start) can hold no call: such requests are counted apart.

    python -m benchmarks.tool_call_budgets [--model smollm2-135m-instruct] [--requests 136]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jsonschema

from benchmarks.common import machine
from tandem import LLM, SamplingParams
from tandem.engine.grammar import grammar_for
from tandem.models.catalog import is_installed
from tandem.runner.grammar_closing import GrammarCloser, closing_path, closing_vocabulary
from tandem.runner.grammar_masks import GrammarMatcher, grammar_tokenizer
from tandem.server.tool_calls import ToolCalling, special_literal
from tandem.server.tool_formats import tool_format


def _tool(name: str, properties: dict, required: list[str]) -> dict:
    parameters = {"type": "object", "properties": properties, "required": required}
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


TOOLS = [
    _tool("write_file", {"path": {"type": "string"}, "text": {"type": "string"}},
          ["path", "text"]),
    _tool("get_weather", {"city": {"type": "string"},
                          "unit": {"enum": ["celsius", "fahrenheit"]}}, ["city", "unit"]),
    _tool("search", {"query": {"type": "string"}, "limit": {"type": "integer"}},
          ["query", "limit"]),
]  # fmt: skip
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
QUESTIONS = [
    "Write a short poem about the sea into poem.txt.",
    "What is the weather in Lisbon?",
    "Find recent papers on speculative decoding.",
    "Save my meeting notes: we agreed to ship on Friday and review the budget.",
]
BUDGETS = (32, 40, 48, 64, 96, 128)


def whole_calls(calling: ToolCalling, text: str) -> bool:
    """Whether the answer holds at least one call, every one valid for its schema."""
    _, calls = calling.parse(text)
    try:
        for call in calls:
            jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS[
                call["function"]["name"]])  # fmt: skip
    except (jsonschema.ValidationError, json.JSONDecodeError):
        return False
    return bool(calls)


def shortest_call(llm: LLM, calling: ToolCalling) -> int:
    """Tokens of the shortest whole answer, the end of sequence included."""
    info = llm.engine.model_info
    vocabulary = grammar_tokenizer(info.tokenizer, info.vocab_size,
                                   tuple(info.eos_token_ids))  # fmt: skip
    matcher = GrammarMatcher(grammar_for(calling.constraint()), vocabulary)
    return len(GrammarCloser(matcher.raw, closing_vocabulary(vocabulary)).path())


def search_costs(llm: LLM, calling: ToolCalling, answers: list[list[int]]) -> list[float]:
    """Microseconds of one closing-path search from each state along these answers
    (what a request pays a step in its closing window)."""
    info = llm.engine.model_info
    vocabulary = grammar_tokenizer(info.tokenizer, info.vocab_size, tuple(info.eos_token_ids))
    grammar, closers = grammar_for(calling.constraint()), closing_vocabulary(vocabulary)
    costs = []
    for answer in answers:
        matcher = GrammarMatcher(grammar, vocabulary).raw
        for token in answer:
            if matcher.is_stopped():
                break
            start = time.perf_counter()
            closing_path(matcher, closers)
            costs.append((time.perf_counter() - start) * 1e6)
            matcher.consume_token(token)
    return costs


def run(
    llm: LLM, calling: ToolCalling, closing: bool, requests: int, shortest: int
) -> tuple[list[list[int]], dict]:
    """(the answers' token ids, their figures)."""
    constraint = calling.constraint()
    constraint.close_in_budget = closing
    conversations = [
        [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}] for i in range(requests)
    ]
    params = [
        SamplingParams(temperature=1.0, seed=i, max_tokens=BUDGETS[i % len(BUDGETS)],
                       structured_outputs=constraint)
        for i in range(requests)
    ]  # fmt: skip
    start = time.perf_counter()
    outputs = llm.chat(conversations, params, use_tqdm=False,
                       chat_template_kwargs={"tools": TOOLS})  # fmt: skip
    elapsed = time.perf_counter() - start
    tokenizer = llm.get_tokenizer()
    answers = [o.outputs[0] for o in outputs]
    held = [whole_calls(calling, tokenizer.decode(list(a.token_ids), False)) for a in answers]
    fits = [p.max_tokens >= shortest for p in params]
    whole = sum(h for h, f in zip(held, fits, strict=True) if f)
    whole_short = sum(h for h, f in zip(held, fits, strict=True) if not f)
    tokens = sum(len(a.token_ids) for a in answers)
    tpot = statistics.median(o.metrics.tpot for o in outputs if o.metrics.tpot)
    cut = sum(a.finish_reason == "length" for a in answers)
    figures = {"whole": whole, "fits": sum(fits), "whole_short": whole_short, "cut": cut,
               "tok_s": tokens / elapsed, "tpot_ms": tpot * 1e3}  # fmt: skip
    return [list(a.token_ids) for a in answers], figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default = "smollm2-135m-instruct" if is_installed("smollm2-135m-instruct") else None
    parser.add_argument("--model", default=default, required=default is None)
    parser.add_argument("--requests", type=int, default=136)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    print(machine())
    llm = LLM(args.model, max_num_seqs=32)
    tokenizer = llm.get_tokenizer()
    format = tool_format("auto", getattr(tokenizer, "chat_template_source", None))
    calling = ToolCalling.of(TOOLS, "required", format, parallel=False,
                             literal=special_literal(tokenizer))  # fmt: skip
    shortest = shortest_call(llm, calling)
    print(
        f"{args.model}: {args.requests} required calls, format {format.name}, "
        f"max_tokens {', '.join(map(str, BUDGETS))} in turn, temperature 1; "
        f"the shortest whole call takes {shortest} tokens"
    )
    print(
        "| grammar | whole calls, budget fits the shortest | whole, budget too small | "
        "cut at max_tokens | output tok/s | median TPOT |"
    )
    print("|---|---|---|---|---|---|")
    for closing in (False, True):
        repeats = [run(llm, calling, closing, args.requests, shortest) for _ in range(args.repeats)]
        answers, runs = repeats[-1][0], [figures for _, figures in repeats]
        median = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        label = "closed within max_tokens" if closing else "not closed (before)"
        print(
            f"| {label} | {median['whole']:.0f} / {median['fits']:.0f} | "
            f"{median['whole_short']:.0f} / {args.requests - median['fits']:.0f} | "
            f"{median['cut']:.0f} | {median['tok_s']:.1f} | {median['tpot_ms']:.2f} ms |"
        )

    costs = search_costs(llm, calling, answers[:16])
    print(
        f"closing-path search, from each state of 16 answers ({len(costs)} searches): "
        f"median {statistics.median(costs):.0f} us, max {max(costs):.0f} us"
    )


if __name__ == "__main__":
    main()
