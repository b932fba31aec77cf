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
    content_only,
    json_arguments,
    json_call,
    opened_calls,
)

OPEN, CLOSE = "<tool_call>", "</tool_call>"


class Hermes(ToolFormat):
    name = "hermes"
    aliases = ("qwen", "qwen2_5", "qwen3")
    markers = (OPEN,)

    def read(self, text: str, final: bool, schemas: dict[str, dict[str, Any]]) -> Reading:
        first = text.find(OPEN)
        if first < 0:
            return content_only(text, final, OPEN)
        return opened_calls(text, final, first, OPEN, json_call)

    def grammar(self, tools: dict[str, dict[str, Any]], max_calls: int, literal: Spelling) -> str:
        def call(name: str, rule: str) -> str:
            head = json.dumps(f'\n{{"name": {json.dumps(name)}, "arguments": ')
            tail = json.dumps("}\n")
            return f"{literal(OPEN)} {head} {rule} {tail} {literal(CLOSE)}"

        return calls_grammar(tools, max_calls, json_arguments(call), between=json.dumps("\n"))
