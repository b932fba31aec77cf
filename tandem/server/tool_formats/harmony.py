"""OpenAI's harmony format (gpt-oss): an answer is messages, each a header and a body.

    <|channel|>analysis<|message|>The user wants Oslo's weather.<|end|>
    <|start|>assistant<|channel|>final<|message|>It is 20 degrees in Oslo.<|return|>

    <|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>
    {"city": "Oslo"}<|call|>

(the generation prompt ends with ``<|start|>assistant``, so the answer's first header
has no ``<|start|>``). A message's channel says what it is: ``analysis`` the reasoning
(reasoning.py's HarmonyParser keeps it apart), ``final`` the reply, ``commentary`` a
call when its header names a recipient (``to=functions.NAME``, before or after the
channel: the template writes it before, models also after), else a preamble the user
sees. A call's body is its arguments' JSON, up to ``<|call|>``. The markers are
special tokens: read only in text that keeps them (``special``). ``<|return|>`` and
``<|call|>`` end the generation, so a text usually ends without them.

This format reads a reply: the content is the text up to the first marker (a final
message's body, as HarmonyParser starts the reply there), the calls are the messages
after it that name a recipient.
"""

from __future__ import annotations

import json
import re
from typing import Any

from tandem.server.tool_formats.base import (
    Call,
    Reading,
    Spelling,
    ToolFormat,
    calls_grammar,
    held_prefix,
    json_arguments,
    value_end,
)

START, CHANNEL, MESSAGE = "<|start|>", "<|channel|>", "<|message|>"
END, RETURN, CALL = "<|end|>", "<|return|>", "<|call|>"
# Where a message's body ends (or a new message begins).
BOUNDARIES = (END, RETURN, CALL, START, CHANNEL)
# A header, whole: an optional "<|start|>assistant", then up to its <|message|>.
HEADER = re.compile(
    r"(?:<\|start\|>assistant)?(?P<header>(?:(?!<\|message\|>|<\|end\|>|<\|start\|>).){0,256}?)"
    r"<\|message\|>",
    re.S,
)
RECIPIENT = re.compile(r"to=functions\.([^\s<]+)")
_RECIPIENT_FIRST = " to=functions."  # a header right after the prompt's <|start|>assistant


def boundary(text: str, at: int, final: bool) -> int:
    """Where the body starting at ``at`` ends: its first marker; with none, the text's
    end (while it grows, less what may be a marker's start)."""
    found = [i for i in (text.find(m, at) for m in BOUNDARIES) if i >= 0]
    if found:
        return min(found)
    return len(text) if final else len(text) - max(held_prefix(text, m) for m in BOUNDARIES)


def opens_header(text: str, at: int, final: bool) -> bool:
    """Whether the text from ``at`` is (or, while it grows, may be) a header whose
    ``<|message|>`` has not come yet."""
    rest = text[at:]
    if final:
        return False
    heads = (START, CHANNEL, _RECIPIENT_FIRST, _RECIPIENT_FIRST.lstrip())
    return any(rest.startswith(h) or h.startswith(rest) for h in heads)


class Harmony(ToolFormat):
    name = "harmony"
    aliases = ("openai", "gpt_oss")
    markers = (f"{CHANNEL}commentary", CALL)
    special = True

    def read(self, text: str, final: bool, schemas: dict[str, dict[str, Any]]) -> Reading:
        if re.match(r"\s*to=", text) or opens_header(text, 0, final):
            content_end = 0  # a call's header straight away
        else:
            content_end = boundary(text, 0, final)
        calls: list[Call] = []
        at = content_end
        while at < len(text):
            if text.startswith(END, at) or text.startswith(RETURN, at):
                at = text.find("|>", at) + 2
                continue
            header = HEADER.match(text, at)
            if header is None:
                break
            recipient = RECIPIENT.search(header.group("header"))
            if recipient is None:  # a message that is no call (a preamble): passed over
                at = boundary(text, header.end(), final)
                if at == header.end():
                    break
                continue
            body = header.end()
            stop = text.find(CALL, body)
            if stop < 0:  # the last call: it ends with the text (<|call|> stopped it)
                end = len(text) if final else len(text) - held_prefix(text, CALL)
                arguments = text[body:end].strip()
                whole = final or value_end(arguments, 0, final) == len(arguments) > 0
                calls.append(Call(recipient.group(1), arguments, complete=whole))
                break
            calls.append(Call(recipient.group(1), text[body:stop].strip()))
            at = stop + len(CALL)
        return Reading(content_end, calls)

    def grammar(self, tools: dict[str, dict[str, Any]], max_calls: int, literal: Spelling) -> str:
        """One call (``<|call|>`` ends the generation), spelled as the template writes
        it; its ``<|start|>assistant`` where the thinking came first."""

        def call(name: str, rule: str) -> str:
            head = json.dumps(f"{_RECIPIENT_FIRST}{name}")
            return (
                f'({literal(START)} "assistant")? {head} {literal(CHANNEL)} '
                f'"commentary json" {literal(MESSAGE)} {rule} {literal(CALL)}'
            )

        return calls_grammar(tools, 1, json_arguments(call))
