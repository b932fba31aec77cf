"""DeepSeek V3 and R1 (0528), V3.1 and later: calls between DeepSeek's special tokens.

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Oslo"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>
                                                             (V3.1: the name, then the JSON)
    <｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather
    ```json
    {"city": "Oslo"}
    ```<｜tool▁call▁end｜>                                      (V3 and R1: in a code fence)

Both are read; a grammar writes V3.1's."""  # noqa: E501

from __future__ import annotations

import json
from typing import Any

from tandem.server.tool_formats.base import (
    Call,
    Reading,
    Spelling,
    ToolFormat,
    calls_grammar,
    content_only,
    json_arguments,
    opened_calls,
    value_end,
)

CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, SEP, CALL_END = "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>"
FENCE = "```json"


class DeepSeekV3(ToolFormat):
    name = "deepseek_v3"
    aliases = ("deepseek_v31", "deepseek_r1")
    markers = (CALL_BEGIN, SEP)
    special = True

    def read(self, text: str, final: bool, schemas: dict[str, dict[str, Any]]) -> Reading:
        first = text.find(CALLS_BEGIN)
        if first < 0:
            first = text.find(CALL_BEGIN)  # (some answers open the first call only)
        if first < 0:
            return content_only(text, final, CALLS_BEGIN, CALL_BEGIN)
        return opened_calls(text, final, first, CALL_BEGIN, self._call)

    @staticmethod
    def _call(text: str, at: int, final: bool) -> tuple[Call | None, int | None]:
        sep = text.find(SEP, at)
        if sep < 0:
            return None, None
        name, begin = text[at:sep].strip(), sep + len(SEP)
        if name == "function":  # V3: the name on the line after, the JSON in a fence
            fence = text.find(FENCE, begin)
            if fence < 0:
                return None, None
            name, begin = text[begin:fence].strip(), fence + len(FENCE)
        begin += len(text[begin:]) - len(text[begin:].lstrip())
        end = value_end(text, begin, final)
        if end is None:
            return Call(name, text[begin:].rstrip(), complete=False), None
        close = text.find(CALL_END, end)
        return Call(name, text[begin:end]), (close + len(CALL_END) if close >= 0 else end)

    def grammar(self, tools: dict[str, dict[str, Any]], max_calls: int, literal: Spelling) -> str:
        def call(name: str, rule: str) -> str:
            head = f"{literal(CALL_BEGIN)} {json.dumps(name)} {literal(SEP)}"
            return f"{head} {rule} {literal(CALL_END)}"

        return calls_grammar(
            tools, max_calls, json_arguments(call), before=literal(CALLS_BEGIN),
            after=literal(CALLS_END),
        )  # fmt: skip
