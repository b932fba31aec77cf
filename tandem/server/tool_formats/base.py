"""What every tool-call format is: one descriptor per family's way of writing calls.

A format reads a model's reply, whole or growing, into content and calls, and writes
the grammar that holds a required or named call to its own syntax (so the model
writes what its chat template taught it):

    read(text, final, schemas) -> Reading(content_end, calls)
        text[:content_end]  the content: while the text grows, only as far as it can
                            never turn out to be (the start of) a call
        calls               each call once its name is written: (name, its arguments'
                            JSON text so far, complete); the arguments only grow as
                            the text does, so a stream sends each call's name once
                            and then pieces of its arguments
    grammar(tools, max_calls, literal) -> a Lark grammar (llguidance): one to
        ``max_calls`` calls of the given tools, each one's arguments held to its
        parameters' schema, in the format's own spelling

The helpers below read JSON calls the way JSON formats write them.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

# JSON as chat templates render it (transformers' tojson: ", " and ": "), no other
# whitespace: a small model left free to add whitespace may add it forever.
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass
class Call:
    name: str
    arguments: str  # the arguments' JSON text so far (all of it once complete)
    complete: bool = True


@dataclass
class Reading:
    content_end: int
    calls: list[Call] = field(default_factory=list)


# How a grammar spells a piece of text: a special token by its id when the tokenizer
# has one for it (a model writes "[TOOL_CALLS]" as one token), else the text.
Spelling = Callable[[str], str]


def text_literal(text: str) -> str:
    return json.dumps(text)


class ToolFormat:
    name: ClassVar[str]
    aliases: ClassVar[tuple[str, ...]] = ()  # vLLM's names for the same format
    # Auto: a chat template containing all of these is read by this format.
    markers: ClassVar[tuple[str, ...]] = ()
    # Written as special tokens by the models of this family: read only if the text
    # keeps special tokens (the request's skip_special_tokens is turned off).
    special: ClassVar[bool] = False

    def fitted(self, chat_template: str | None) -> ToolFormat:
        """This format as the served template spells it (most have one spelling)."""
        return self

    @staticmethod
    def call_id() -> str:
        """An id for a call the model made (OpenAI's shape; some templates want their own)."""
        return f"call_{uuid.uuid4().hex[:24]}"

    def read(self, text: str, final: bool, schemas: dict[str, dict[str, Any]]) -> Reading:
        raise NotImplementedError

    def grammar(self, tools: dict[str, dict[str, Any]], max_calls: int, literal: Spelling) -> str:
        raise NotImplementedError


# -- JSON calls ----------------------------------------------------------------------

_SCALAR = re.compile(r"-?\d+(\.\d+)?([eE][+-]?\d+)?|true|false|null")
_NAME_FIRST = re.compile(
    r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"(?:arguments|parameters)"\s*:\s*'
)


# A JSON string (group 1: its closing quote; missing while it is still being written)
# or a bracket: what a scan of a value steps over, a match at a time (a long string
# argument is one step, not one per character).
_JSON_PIECE = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*(?:(")|\\?\Z)|[{}\[\]]')


def value_end(text: str, start: int, final: bool) -> int | None:
    """Where the JSON value starting at ``text[start]`` ends (None: not yet whole, or
    not JSON). A number at the end of a growing text may still grow."""
    if start >= len(text):
        return None
    first = text[start]
    if first in "{[":
        depth = 0
        for piece in _JSON_PIECE.finditer(text, start):
            token = piece.group()
            if token[0] == '"':
                if piece.group(1) is None:
                    return None  # a string still open
            elif token in "{[":
                depth += 1
            else:
                depth -= 1
                if depth == 0:
                    return piece.end()
        return None
    if first == '"':
        piece = _JSON_PIECE.match(text, start)
        return piece.end() if piece is not None and piece.group(1) is not None else None
    match = _SCALAR.match(text, start)
    if match is None or (match.end() == len(text) and not final):
        return None
    return match.end()


def json_call(text: str, start: int, final: bool) -> tuple[Call | None, int | None]:
    """The call object at ``text[start]`` (``{"name": ..., "arguments": ...}``, or
    Llama's ``parameters``): (the call so far, or None before its name is whole;
    where the object ends, or None while it is open)."""
    partial = None
    named = _NAME_FIRST.match(text, start)
    if named is not None:  # the usual order: the name streams before the arguments
        name = json.loads(named.group(1))
        begin = named.end()
        end = value_end(text, begin, final)
        if end is None:
            return Call(name, text[begin:].rstrip(), complete=False), None
        close = len(text) - len(text[end:].lstrip())
        if text.startswith("}", close):
            return Call(name, text[begin:end]), close + 1
        partial = Call(name, text[begin:end], complete=False)  # more keys follow
    try:  # other keys or another order: the whole object, once it is whole
        value, end = json.JSONDecoder().raw_decode(text, len(text) - len(text[start:].lstrip()))
    except json.JSONDecodeError:
        return partial, None
    call = call_of(value)
    if call is not None and partial is not None:  # what streamed stays the arguments
        call.arguments = partial.arguments
    return call, end if call is not None else None


def call_of(value: Any) -> Call | None:
    """A decoded call object as a Call (None: not one)."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    return Call(value["name"], arguments)


def content_only(text: str, final: bool, *tags: str) -> Reading:
    """A reply with no call begun: all content, less (while it grows) what may be the
    start of one of ``tags``."""
    return Reading(len(text) if final else len(text) - max(held_prefix(text, t) for t in tags))


def calls_or_text(text: str, final: bool, content_end: int, calls: list[Call]) -> Reading:
    """The content before the calls and the calls; a whole reply that holds no whole
    call is the text as the model wrote it."""
    if final and not any(call.complete for call in calls):
        return Reading(len(text))
    return Reading(content_end, calls)


ReadCall = Callable[[str, int, bool], "tuple[Call | None, int | None]"]


def opened_calls(text: str, final: bool, first: int, opener: str, read_call: ReadCall) -> Reading:
    """A reply whose content ends at ``first`` and whose calls each open with
    ``opener``; ``read_call(text, after_opener, final)`` reads one: (the call so far
    or None, where it ends or None while it is open)."""
    calls, at = [], text.find(opener, first)
    while at >= 0:
        call, end = read_call(text, at + len(opener), final)
        if call is None:
            break
        calls.append(call)
        if end is None:
            break
        at = text.find(opener, end)
    return calls_or_text(text, final, first, calls)


def json_calls(text: str, at: int, final: bool, separator: str) -> list[Call]:
    """JSON call objects from ``text[at]`` on, one after another with ``separator``
    between them."""
    calls = []
    while True:
        call, end = json_call(text, at, final)
        if call is None:
            return calls
        calls.append(call)
        if end is None:
            return calls
        after = text[end:].lstrip()
        if not after.startswith(separator):
            return calls
        at = len(text) - len(after) + len(separator)


def held_prefix(text: str, tag: str) -> int:
    """How many characters at the end of ``text`` may be the start of ``tag``."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0


def schema_rule(schema: dict[str, Any]) -> str:
    """A tool's parameters as an inline JSON schema of a Lark grammar."""
    return "%json " + json.dumps({**schema, "x-guidance": JSON_STYLE})


# (index, tool name, its parameters' schema) -> (the call's Lark expression, its rules)
WriteCall = Callable[[int, str, dict[str, Any]], "tuple[str, list[str]]"]


def json_arguments(call: Callable[[str, str], str]) -> WriteCall:
    """A call whose arguments are one JSON object: ``call(name, rule)`` spells the
    call of tool ``name`` around the rule ``rule`` of its arguments."""

    def write(index: int, name: str, schema: dict[str, Any]) -> tuple[str, list[str]]:
        rule = f"args_{index}"
        return call(name, rule), [f"{rule}: {schema_rule(schema)}"]

    return write


def parameters(
    index: int, schema: dict[str, Any], value_rule: Callable[[dict[str, Any]], str]
) -> tuple[list[tuple[str, str, bool]], list[str]]:
    """A call written a parameter at a time: (each declared parameter as (key, the
    rule of its value, required), the value rules; ``value_rule(schema)`` is a value's
    grammar)."""
    required = set(schema.get("required") or ())
    parts, lines = [], []
    for number, (key, sub) in enumerate((schema.get("properties") or {}).items()):
        rule = f"value_{index}_{number}"
        lines.append(f"{rule}: {value_rule(sub)}")
        parts.append((key, rule, key in required))
    return parts, lines


def calls_grammar(
    tools: dict[str, dict[str, Any]],
    max_calls: int,
    call: WriteCall,
    before: str = "",
    between: str = "",
    after: str = "",
) -> str:
    """A Lark grammar of 1 to ``max_calls`` calls: ``before``, the calls with
    ``between`` them, ``after`` (each a Lark expression or ""); ``call`` writes one
    call of a tool (json_arguments, or a format's own a parameter at a time)."""
    lines = []
    alternatives = []
    for index, (name, schema) in enumerate(tools.items()):
        expression, rules = call(index, name, schema)
        lines += [f"call_{index}: {expression}", *rules]
        alternatives.append(f"call_{index}")
    repeat = f"({between} call){{0,{max_calls - 1}}}" if max_calls > 1 else ""
    parts = " ".join(part for part in (before, "call", repeat, after) if part)
    return "\n".join([f"start: {parts}", f"call: {' | '.join(alternatives)}", *lines])
