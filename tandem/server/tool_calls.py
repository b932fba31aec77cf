"""Tool calling for chat completions: the tools into the chat template, the model's
answer out as ``tool_calls``.

    tools, tool_choice  -> ToolCalling.of(body, parser)
      the chat template gets ``tools`` (transformers' variable; Qwen, Hermes, Llama 3
      templates render them); tool_choice "none" leaves them out
      "required"       -> a structured-output constraint: a JSON array of one or more
                          {"name", "arguments"} calls, each tool's arguments held to its
                          ``parameters`` schema with no undeclared properties (one call
                          if parallel_tool_calls is off); an array cut short by
                          max_tokens still gives the calls it completed
      {"function": f}  -> the constraint is f's parameters: the answer is the arguments
      "auto"           -> free text, parsed by the server's --tool-call-parser:
                          hermes: <tool_call>{"name": ..., "arguments": ...}</tool_call>
                          blocks (Hermes, Qwen 2.5/3), the text around them the content
                          json:   an answer that is a JSON call object or list of them
                          (Llama 3 style; "parameters" is read as "arguments")

Streaming with tools: a grammar-held answer (required, a named function) streams its
calls as OpenAI does: a call's first delta has its id and name, the next ones pieces of
its arguments as the model writes them. An "auto" answer's content is sent as it comes
until it may be the start of a call (a "<tool_call>" prefix, or an answer starting with
"{" or "["); the rest is held and parsed when the choice ends (the model may not have
written a call after all), then sent as one ``tool_calls`` delta.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from tandem.errors import InvalidParameterError
from tandem.sampling import StructuredOutputsParams

PARSERS = ("hermes", "json")
HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
_HERMES_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


@dataclass
class ToolCalling:
    tools: list[dict[str, Any]]  # OpenAI's tool objects, as given (the template's input)
    choice: str  # "auto" | "required" | "named"
    parser: str  # how "auto" answers are read (PARSERS)
    parallel: bool = True
    named: str | None = None  # the function tool_choice names
    max_calls: int = 8  # calls a required answer may hold with parallel on (then it ends)

    @classmethod
    def of(
        cls,
        tools: list[dict[str, Any]] | None,
        tool_choice: str | dict[str, Any] | None,
        parser: str,
        parallel: bool = True,
        max_calls: int = 8,
    ) -> ToolCalling | None:
        """None when no tool may be called (no tools, or tool_choice "none")."""
        if tool_choice is not None and not tools and tool_choice != "none":
            raise InvalidParameterError("tool_choice", "needs tools")
        if not tools or tool_choice == "none":
            return None
        names = []
        for index, tool in enumerate(tools):
            function = tool.get("function")
            if tool.get("type") != "function" or not isinstance(function, dict):
                raise InvalidParameterError(
                    f"tools[{index}]", 'must be {"type": "function", "function": {...}}'
                )
            name = function.get("name")
            if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.\-]{1,64}", name):
                raise InvalidParameterError(
                    f"tools[{index}].function.name", "must be 1-64 letters, digits, _ . or -"
                )
            parameters = function.get("parameters", {})
            if not isinstance(parameters, dict):
                raise InvalidParameterError(
                    f"tools[{index}].function.parameters", "must be a JSON schema object"
                )
            names.append(name)
        if len(set(names)) != len(names):
            raise InvalidParameterError("tools", "function names must be unique")
        if tool_choice in (None, "auto"):
            return cls(tools, "auto", parser, parallel, max_calls=max_calls)
        if tool_choice == "required":
            return cls(tools, "required", parser, parallel, max_calls=max_calls)
        if isinstance(tool_choice, dict):
            name = (tool_choice.get("function") or {}).get("name")
            if tool_choice.get("type") != "function" or name not in names:
                raise InvalidParameterError(
                    "tool_choice", f"must name one of the tools ({', '.join(names)})"
                )
            return cls(tools, "named", parser, parallel, name, max_calls)
        raise InvalidParameterError(
            "tool_choice", 'must be "none", "auto", "required" or {"type": "function", ...}'
        )

    def _parameters(self, name: str) -> dict[str, Any]:
        """The schema a call's arguments are held to (see _closed)."""
        for tool in self.tools:
            if tool["function"]["name"] == name:
                return _closed(tool["function"].get("parameters") or {"type": "object"})
        raise KeyError(name)

    def constraint(self) -> StructuredOutputsParams | None:
        """What "required" and a named function hold the answer to (None for auto)."""
        if self.choice == "named":
            return StructuredOutputsParams(json=self._parameters(self.named), source="tool_choice")
        if self.choice != "required":
            return None
        calls = [
            {
                "type": "object",
                "properties": {
                    "name": {"const": tool["function"]["name"]},
                    "arguments": self._parameters(tool["function"]["name"]),
                },
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
            for tool in self.tools
        ]
        # Bounded: a model that repeats a call (small ones do) still ends the array.
        schema = {"type": "array", "items": {"anyOf": calls}, "minItems": 1,
                  "maxItems": self.max_calls if self.parallel else 1}  # fmt: skip
        return StructuredOutputsParams(json=schema, source="tool_choice")

    # -- reading the answer -------------------------------------------------------------

    def parse(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        """(the message content, the tool calls in OpenAI's shape) of a whole answer.
        Text that does not parse as a call stays content."""
        end, calls = self.split(text)
        if not calls:
            # a required answer is calls only: cut short before one was whole, nothing
            return (None if self.choice == "required" else text), []
        return text[:end].strip() or None, calls

    def split(self, text: str) -> tuple[int, list[dict[str, Any]]]:
        """(where the content ends, the calls after it): (len(text), []) without calls."""
        if self.choice == "named":
            return 0, [_call(self.named, text)]
        if self.choice == "required":
            # The grammar makes the answer an array of calls; one cut short by max_tokens
            # still gives the calls it completed.
            calls = _json_calls(text) or _completed_calls(text)
            return (0, calls) if calls else (len(text), [])
        if self.parser == "json":
            calls = _json_calls(text)
            return (0, calls) if calls else (len(text), [])
        calls = []
        for block in _HERMES_BLOCK.findall(text):
            found = _json_calls(block)
            if not found:
                return len(text), []  # a malformed block: the text as the model wrote it
            calls += found
        return (text.index(HERMES_OPEN), calls) if calls else (len(text), [])

    def partial_calls(self, text: str) -> list[tuple[str, str]]:
        """A grammar-held answer (required, a named function) as it streams: its calls
        so far, each once its name is whole, as (name, the raw text of its arguments so
        far). The text only grows, so each call's arguments only grow."""
        if self.choice == "named":
            return [(self.named, text)] if text else []
        return _partial_calls(text)

    def streamable(self, text: str) -> int:
        """How much of a partial answer can go out as content now (the rest may
        become a tool call)."""
        if self.choice != "auto":
            return 0
        if self.parser == "json":
            stripped = text.lstrip()
            return 0 if not stripped or stripped[0] in "{[" else len(text)
        at = text.find(HERMES_OPEN)
        if at >= 0:
            return at
        for keep in range(min(len(HERMES_OPEN) - 1, len(text)), 0, -1):  # a partial tag
            if HERMES_OPEN.startswith(text[-keep:]):
                return len(text) - keep
        return len(text)


def _json_calls(text: str) -> list[dict[str, Any]]:
    """A call object or a list of them (name + arguments, or Llama 3's parameters)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return []
    items = value if isinstance(value, list) else [value]
    calls = []
    for item in items:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            return []
        arguments = item.get("arguments", item.get("parameters", {}))
        calls.append(_call(item["name"], arguments))
    return calls


def _partial_calls(text: str) -> list[tuple[str, str]]:
    """The calls of a JSON array of {"name": ..., "arguments": ...} objects that may be
    unfinished (see ToolCalling.partial_calls), read by one pass over its characters:
    depth 1 is the array, 2 a call object, deeper the inside of its arguments."""
    calls: list[list[Any]] = []  # [name, arguments start, arguments end]
    depth, in_string, escaped, string_start = 0, False, False, 0
    key, expect_key = None, False

    def arguments_begin(at: int) -> None:
        if depth == 2 and not expect_key and key == "arguments" and calls and calls[-1][1] is None:
            calls[-1][1] = at

    def arguments_end(at: int) -> None:
        if calls and calls[-1][1] is not None and calls[-1][2] is None:
            calls[-1][2] = at

    for at, ch in enumerate(text):
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
                if depth == 2 and expect_key:
                    key = json.loads(text[string_start : at + 1])
                elif depth == 2 and key == "name" and calls:
                    calls[-1][0] = json.loads(text[string_start : at + 1])
                elif depth == 2 and key == "arguments":
                    arguments_end(at + 1)
            continue
        if ch.isspace():
            continue
        if ch == '"':
            arguments_begin(at)
            in_string, string_start = True, at
        elif ch in "{[":
            if depth == 1 and ch == "{":
                calls.append([None, None, None])
                expect_key, key = True, None
            arguments_begin(at)
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 2 and key == "arguments":
                arguments_end(at + 1)  # an object or array value closed
            elif depth == 1:
                arguments_end(at)  # the call closed after a scalar value
        elif depth == 2 and ch == ":":
            expect_key = False
        elif depth == 2 and ch == ",":
            if key == "arguments":
                arguments_end(at)
            expect_key, key = True, None
        else:
            arguments_begin(at)  # a number, true, false or null
    return [
        (
            name,
            text[start : len(text) if end is None else end].rstrip() if start is not None else "",
        )
        for name, start, end in calls
        if name is not None
    ]


def _completed_calls(text: str) -> list[dict[str, Any]]:
    """The whole call objects at the start of a JSON array that may be cut short."""
    decoder = json.JSONDecoder()
    at = len(text) - len(text.lstrip())
    if not text.startswith("[", at):
        return []
    items, at = [], at + 1
    while True:
        while at < len(text) and text[at] in " \t\r\n,":
            at += 1
        try:
            item, at = decoder.raw_decode(text, at)
        except json.JSONDecodeError:
            break
        items.append(item)
    return _json_calls(json.dumps(items)) if items else []


def _closed(schema: Any) -> Any:
    """A tool's parameters with no properties beyond those declared (where the schema
    does not say otherwise), in nested objects too: a call's arguments are the
    function's parameters, and a model held to an open object added properties the
    tool never declared until max_tokens cut it short."""
    if not isinstance(schema, dict):
        return schema
    closed = dict(schema)
    if isinstance(schema.get("properties"), dict):
        closed["properties"] = {k: _closed(v) for k, v in schema["properties"].items()}
        closed.setdefault("additionalProperties", False)
    if isinstance(schema.get("items"), dict):
        closed["items"] = _closed(schema["items"])
    return closed


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _call(name: str, arguments: Any) -> dict[str, Any]:
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {
        "id": call_id(),
        "type": "function",
        "function": {"name": name, "arguments": text},
    }
