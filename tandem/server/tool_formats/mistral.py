"""Mistral: calls after the ``[TOOL_CALLS]`` token, in one of two spellings.

    [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo"}, "id": "a1b2c3d4e"}]
                                        (v3 tokenizers: Mistral 7B v0.3, Nemo, Small 3.0)
    [TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}
                                        (v11 and later: Small 3.1/3.2, Devstral, Ministral 3;
                                         [CALL_ID]id may come before [ARGS])

Both are read; a grammar writes the spelling of the served template (``[ARGS]`` in
it: the second). Mistral's templates refuse call ids that are not 9 letters and
digits, so the calls of this format get such ids."""

from __future__ import annotations

import json
import re
import secrets
import string
from typing import Any

from tandem.server.tool_formats.base import (
    Call,
    Reading,
    Spelling,
    ToolFormat,
    calls_grammar,
    calls_or_text,
    content_only,
    json_arguments,
    json_calls,
    value_end,
)

TOOL_CALLS, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
_NAME = re.compile(r"\s*([A-Za-z0-9_.\-]+)")


class Mistral(ToolFormat):
    name = "mistral"
    markers = (TOOL_CALLS,)
    special = True

    def __init__(self, args_spelling: bool = False) -> None:
        self.args_spelling = args_spelling  # write name[ARGS]{...} (v11), not a list

    def fitted(self, template: str | None) -> Mistral:
        return Mistral(template is not None and ARGS in template)

    @staticmethod
    def call_id() -> str:
        alphabet = string.ascii_letters + string.digits
        return "".join(secrets.choice(alphabet) for _ in range(9))

    def read(self, text: str, final: bool, schemas: dict[str, dict[str, Any]]) -> Reading:
        first = text.find(TOOL_CALLS)
        if first < 0:
            return content_only(text, final, TOOL_CALLS)
        at = first + len(TOOL_CALLS)
        body = text[at:].lstrip()
        if body.startswith("["):
            calls = json_calls(text, len(text) - len(body) + 1, final, ",")
        else:
            calls = self._named(text, at, final)
        return calls_or_text(text, final, first, calls)

    @staticmethod
    def _named(text: str, at: int, final: bool) -> list[Call]:
        calls = []
        while True:
            if text.startswith(TOOL_CALLS, at):
                at += len(TOOL_CALLS)
            name = _NAME.match(text, at)
            if name is None:
                return calls
            at = name.end()
            if text.startswith(CALL_ID, at):
                args = text.find(ARGS, at)
                if args < 0:
                    return calls
                at = args
            if not text.startswith(ARGS, at):
                return calls  # the name may still grow: not committed yet
            begin = at + len(ARGS)
            end = value_end(text, begin, final)
            if end is None:
                calls.append(Call(name.group(1), text[begin:].rstrip(), complete=False))
                return calls
            calls.append(Call(name.group(1), text[begin:end]))
            at = len(text) - len(text[end:].lstrip())

    def grammar(self, tools: dict[str, dict[str, Any]], max_calls: int, literal: Spelling) -> str:
        if self.args_spelling:

            def spelled(name: str, rule: str) -> str:  # (Small 3.2 writes an id first)
                call_id = f"({literal(CALL_ID)} /[A-Za-z0-9]{{9}}/)?"
                return f"{literal(TOOL_CALLS)} {json.dumps(name)} {call_id} {literal(ARGS)} {rule}"

            return calls_grammar(tools, max_calls, json_arguments(spelled))

        id_key, id_end = json.dumps(', "id": "'), json.dumps('"}')

        def listed(name: str, rule: str) -> str:  # with the id Mistral's templates write
            head = json.dumps(f'{{"name": {json.dumps(name)}, "arguments": ')
            return f"{head} {rule} {id_key} /[A-Za-z0-9]{{9}}/ {id_end}"

        return calls_grammar(
            tools, max_calls, json_arguments(listed), before=f'{literal(TOOL_CALLS)} "["',
            between=json.dumps(", "), after='"]"',
        )  # fmt: skip
