"""Llama 3.1 to 3.3 (and the ``json`` answers of other models): the whole reply is a
call object, its arguments under ``parameters``; several are joined by "; ".

    {"name": "get_weather", "parameters": {"city": "Oslo"}}

A reply that does not start with ``{`` (or Llama's ``<|python_tag|>``) is content."""

from __future__ import annotations

import json
from typing import Any

from tandem.server.tool_formats.base import (
    Reading,
    Spelling,
    ToolFormat,
    calls_grammar,
    calls_or_text,
    json_arguments,
    json_calls,
)

PYTHON_TAG = "<|python_tag|>"


class Llama3Json(ToolFormat):
    name = "llama3_json"
    aliases = ("json", "llama4_json")
    markers = ('"parameters": dictionary of argument name',)

    def read(self, text: str, final: bool, schemas: dict[str, dict[str, Any]]) -> Reading:
        start = len(text) - len(text.lstrip())
        if text.startswith(PYTHON_TAG, start):
            start += len(PYTHON_TAG)
            start += len(text[start:]) - len(text[start:].lstrip())
        rest = text[start:]
        if not final and (not rest.strip() or PYTHON_TAG.startswith(text.lstrip())):
            return Reading(0)  # may still become a call
        if not rest.startswith("{"):
            return Reading(len(text))
        return calls_or_text(text, final, 0, json_calls(text, start, final, ";"))

    def grammar(self, tools: dict[str, dict[str, Any]], max_calls: int, literal: Spelling) -> str:
        def call(name: str, rule: str) -> str:
            head = json.dumps(f'{{"name": {json.dumps(name)}, "parameters": ')
            return f"{head} {rule} {json.dumps('}')}"

        return calls_grammar(tools, max_calls, json_arguments(call), between=json.dumps("; "))
