"""Pythonic calls (Llama 3.2 and 4 with a pythonic template, and models tuned on it):
the reply is a Python list of calls with keyword arguments.

    [get_weather(city="Oslo", unit="celsius"), add(a=2, b=2)]

Read with Python's own parser (``ast``; values are literals), a call at a time: its
name goes out when ``name(`` is written, its arguments when its ``)`` is. Llama 4's
``<|python_start|>`` / ``<|python_end|>`` around the list are allowed."""

from __future__ import annotations

import ast
import json
import re
from typing import Any

from tandem.server.tool_formats.base import (
    JSON_STYLE,
    Call,
    Reading,
    Spelling,
    ToolFormat,
    calls_grammar,
    calls_or_text,
    parameters,
)

START, END = "<|python_start|>", "<|python_end|>"
_NAME = re.compile(r"\s*([A-Za-z_][A-Za-z0-9_.]*)\s*\(")


class Pythonic(ToolFormat):
    name = "pythonic"
    markers = ("[func_name1(",)

    def read(self, text: str, final: bool, schemas: dict[str, dict[str, Any]]) -> Reading:
        start = len(text) - len(text.lstrip())
        if text.startswith(START, start):
            start += len(START)
        body = text[start:].lstrip()
        if not final and (not body or START.startswith(text.lstrip())):
            return Reading(0)
        if not body.startswith("["):
            return Reading(len(text))
        calls, at = [], len(text) - len(body) + 1
        while True:
            name = _NAME.match(text, at)
            if name is None:
                break
            close = _closing_paren(text, name.end())
            if close is None:
                calls.append(Call(name.group(1), "", complete=False))
                break
            arguments = _arguments(text[name.start() : close + 1].strip())
            if arguments is None:
                break
            calls.append(Call(name.group(1), arguments))
            at = close + 1
            while at < len(text) and text[at] in " ,\n":
                at += 1
        return calls_or_text(text, final, 0, calls)

    def grammar(self, tools: dict[str, dict[str, Any]], max_calls: int, literal: Spelling) -> str:
        def call(index: int, name: str, schema: dict[str, Any]) -> tuple[str, list[str]]:
            parts, rules = parameters(index, schema, _value_rule)
            keywords = _keywords([(f"{json.dumps(key + '=')} {rule}", required)
                                  for key, rule, required in parts])  # fmt: skip
            return f'{json.dumps(name + "(")} {keywords} ")"', rules

        return calls_grammar(tools, max_calls, call, before='"["', between='", "', after='"]"')


def _keywords(parts: list[tuple[str, bool]]) -> str:
    """Keyword arguments joined by ", " (a Lark expression): the required ones in their
    declared order, then each optional one (an optional one is written only after
    those before it, when no argument is required)."""
    required = [part for part, needed in parts if needed]
    optional = [part for part, needed in parts if not needed]
    if required:
        tail = " ".join(f'(", " {part})?' for part in optional)
        return " ".join([' ", " '.join(required), tail]).strip()
    if not optional:
        return ""
    tail = " ".join(f'(", " {part})?' for part in optional[1:])
    return f"({optional[0]} {tail})?".replace(" )?", ")?")


def _closing_paren(text: str, at: int) -> int | None:
    """The ``)`` that closes the call whose arguments start at ``at``."""
    depth, quote, escaped = 1, None, False
    for index in range(at, len(text)):
        ch = text[index]
        if quote:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == quote:
                quote = None
        elif ch in "\"'":
            quote = ch
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
            if depth == 0:
                return index
    return None


def _arguments(source: str) -> str | None:
    """``name(k=v, ...)``'s keyword arguments as a JSON object (None: not literals)."""
    try:
        call = ast.parse(source, mode="eval").body
        if not isinstance(call, ast.Call) or call.args:
            return None
        values = {kw.arg: ast.literal_eval(kw.value) for kw in call.keywords if kw.arg}
        return json.dumps(values, ensure_ascii=False)
    except (SyntaxError, ValueError, TypeError):
        return None


def _value_rule(schema: dict[str, Any]) -> str:
    """A keyword's value: Python's booleans, else JSON (whose strings, numbers and
    lists are Python's; a nested object's true/false/null are not)."""
    if schema.get("type") == "boolean":
        return '"True" | "False"'
    return "%json " + json.dumps({**schema, "x-guidance": JSON_STYLE})
