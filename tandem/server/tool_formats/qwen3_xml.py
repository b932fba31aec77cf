"""Qwen3-Coder and Qwen3.5: each call an XML-like block, one tag per parameter, the
values as plain text.

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Oslo
    </parameter>
    </function>
    </tool_call>

A value is read by its parameter's schema (a string stays text; numbers, booleans,
objects and arrays are JSON), so the arguments come out as the JSON object OpenAI's
API carries; while streaming they grow a parameter at a time."""

from __future__ import annotations

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
    content_only,
    opened_calls,
    parameters,
)

OPEN, CLOSE = "<tool_call>", "</tool_call>"
FUNCTION, FUNCTION_END = "<function=", "</function>"
PARAMETER_END = "</parameter>"
_PARAMETER = re.compile(r"\s*<parameter=([^>\n]+)>")


class Qwen3Xml(ToolFormat):
    name = "qwen3_xml"
    aliases = ("qwen3_coder",)
    markers = (FUNCTION, "<parameter=")

    def read(self, text: str, final: bool, schemas: dict[str, dict[str, Any]]) -> Reading:
        starts = [at for at in (text.find(OPEN), text.find(FUNCTION)) if at >= 0]
        if not starts:
            return content_only(text, final, OPEN, FUNCTION)

        def read_call(text: str, at: int, final: bool):
            return self._call(text, at, final, schemas)

        return opened_calls(text, final, min(starts), FUNCTION, read_call)

    @staticmethod
    def _call(text: str, at: int, final: bool, schemas) -> tuple[Call | None, int | None]:
        close = text.find(">", at)
        if close < 0 or "\n" in text[at:close]:
            return None, None
        name = text[at:close].strip()
        properties = (schemas.get(name) or {}).get("properties") or {}
        pairs, at = [], close + 1
        while True:
            parameter = _PARAMETER.match(text, at)
            if parameter is None:
                break
            end = text.find(PARAMETER_END, parameter.end())
            if end < 0:
                break
            key = parameter.group(1).strip()
            raw = text[parameter.end() : end].removeprefix("\n").removesuffix("\n")
            pairs.append(f"{json.dumps(key)}: {_value(raw, properties.get(key))}")
            at = end + len(PARAMETER_END)
        arguments = "{" + ", ".join(pairs)
        done = text.find(FUNCTION_END, at)
        if done < 0 or text[at:done].strip():
            return Call(name, arguments, complete=False), None
        end = done + len(FUNCTION_END)
        after = text[end:].lstrip()
        if after.startswith(CLOSE):
            end = len(text) - len(after) + len(CLOSE)
        return Call(name, arguments + "}"), end

    def grammar(self, tools: dict[str, dict[str, Any]], max_calls: int, literal: Spelling) -> str:
        def call(index: int, name: str, schema: dict[str, Any]) -> tuple[str, list[str]]:
            parts, rules = parameters(index, schema, _value_rule)
            written = []
            for key, rule, required in parts:
                part = f'{json.dumps(f"<parameter={key}>{chr(10)}")} {rule} "\\n</parameter>\\n"'
                written.append(part if required else f"({part})?")
            head = f"{literal(OPEN)} " + json.dumps(f"\n{FUNCTION}{name}>\n")
            tail = json.dumps(f"{FUNCTION_END}\n") + f" {literal(CLOSE)}"
            return f"{head} {' '.join(written)} {tail}", rules

        # (Qwen3-Coder's template writes a newline before every call, the first too)
        return calls_grammar(tools, max_calls, call, before='"\\n"?', between='"\\n"')


def _value(raw: str, schema: dict[str, Any] | None) -> str:
    """A parameter's text as JSON, by its schema's type (text, when it is a string or
    does not parse)."""
    kind = (schema or {}).get("type")
    if kind == "string" or (kind is None and schema and "enum" in schema
                            and all(isinstance(v, str) for v in schema["enum"])):  # fmt: skip
        return json.dumps(raw, ensure_ascii=False)
    try:
        return json.dumps(json.loads(raw), ensure_ascii=False)
    except json.JSONDecodeError:
        return json.dumps(raw, ensure_ascii=False)


def _value_rule(schema: dict[str, Any]) -> str:
    """The grammar of one parameter's text (a string stays on one line: its end is
    the line with ``</parameter>``)."""
    enum = schema.get("enum")
    if enum and all(isinstance(v, str) and "\n" not in v for v in enum):
        return " | ".join(json.dumps(v) for v in enum)
    kind = schema.get("type")
    if kind == "string":
        most = schema.get("maxLength")
        return f"/[^<\\n]{{0,{most}}}/" if isinstance(most, int) else "/[^<\\n]*/"
    # numbers, booleans, objects, arrays: as JSON writes them (bounds and all)
    return "%json " + json.dumps({**schema, "x-guidance": JSON_STYLE})
