"""Hermes and Qwen (2.5, 3, QwQ): each call a JSON object in its own block.

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Oslo"}}
    </tool_call>

The text before the first block is the content."""

from __future__ import annotations

import json
from typing import Any

from tandem.server.tool_formats.base import (
    Reading,
    Spelling,
    ToolFormat,
    calls_grammar,
    held_prefix,
    json_call,
)

OPEN, CLOSE = "<tool_call>", "</tool_call>"


class Hermes(ToolFormat):
    name = "hermes"
    aliases = ("qwen", "qwen2_5", "qwen3")
    markers = (OPEN,)

    def read(self, text: str, final: bool, schemas: dict[str, dict[str, Any]]) -> Reading:
        first = text.find(OPEN)
        if first < 0:
            return Reading(len(text) if final else len(text) - held_prefix(text, OPEN))
        calls, at = [], first
        while at >= 0:
            call, end = json_call(text, at + len(OPEN), final)
            if call is None:
                break
            calls.append(call)
            if end is None:
                break
            at = text.find(OPEN, end)
        if final and not any(call.complete for call in calls):
            return Reading(len(text))  # no whole call: the text as the model wrote it
        return Reading(first, calls)

    def grammar(self, tools: dict[str, dict[str, Any]], max_calls: int, literal: Spelling) -> str:
        def call(name: str, rule: str) -> str:
            head = json.dumps(f'\n{{"name": {json.dumps(name)}, "arguments": ')
            tail = json.dumps("}\n")
            return f"{literal(OPEN)} {head} {rule} {tail} {literal(CLOSE)}"

        return calls_grammar(tools, max_calls, call, between=json.dumps("\n"))
