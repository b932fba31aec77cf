"""Tool calling for chat completions: the tools into the chat template, the model's
answer out as ``tool_calls``, in the format of the model's family (tool_formats/).

    tools, tool_choice  -> ToolCalling.of(tools, tool_choice, format)
      the chat template gets ``tools`` (transformers' variable); tool_choice "none"
      leaves them out
      "auto"           -> free text, read by the format: the content, then its calls
      "required"       -> a grammar in the format's own syntax: one or more calls
                          (one if parallel_tool_calls is off, at most max_calls), each
                          tool's arguments held to its ``parameters`` schema with no
                          undeclared properties
      {"function": f}  -> the same grammar, one call of f

Streaming: content goes out as it comes until it may be the start of a call (the
format holds back a partial marker); a call goes out as soon as its name is written
(its id and name), then its arguments in pieces as the model writes them. Nothing
sent as content is ever a call, and a call is never sent as content.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from tandem.errors import InvalidParameterError
from tandem.sampling import StructuredOutputsParams
from tandem.server.tool_formats import tool_format
from tandem.server.tool_formats.base import Reading, Spelling, ToolFormat, text_literal


@dataclass
class ToolCalling:
    tools: list[dict[str, Any]]  # OpenAI's tool objects, as given (the template's input)
    choice: str  # "auto" | "required" | "named"
    format: ToolFormat  # how the model writes calls (tool_formats/)
    parallel: bool = True
    named: str | None = None  # the function tool_choice names
    max_calls: int = 8  # calls a required answer may hold with parallel on (then it ends)
    # How the grammar spells a marker: as the tokenizer's special token where it has one.
    literal: Spelling = text_literal
    schemas: dict[str, dict[str, Any]] = field(init=False)  # name -> closed parameters

    def __post_init__(self) -> None:
        self.schemas = {
            tool["function"]["name"]: _closed(tool["function"].get("parameters") or
                                              {"type": "object"})
            for tool in self.tools
        }  # fmt: skip

    @classmethod
    def of(
        cls,
        tools: list[dict[str, Any]] | None,
        tool_choice: str | dict[str, Any] | None,
        format: ToolFormat | str,
        parallel: bool = True,
        max_calls: int = 8,
        literal: Spelling = text_literal,
    ) -> ToolCalling | None:
        """None when no tool may be called (no tools, or tool_choice "none");
        ``format``: a ToolFormat, or a parser's name."""
        if isinstance(format, str):
            format = tool_format(format, None)
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
        if tool_choice in (None, "auto", "required"):
            choice = "auto" if tool_choice in (None, "auto") else "required"
            return cls(tools, choice, format, parallel, max_calls=max_calls, literal=literal)
        if isinstance(tool_choice, dict):
            name = (tool_choice.get("function") or {}).get("name")
            if tool_choice.get("type") != "function" or name not in names:
                raise InvalidParameterError(
                    "tool_choice", f"must name one of the tools ({', '.join(names)})"
                )
            return cls(tools, "named", format, parallel, name, max_calls, literal)
        raise InvalidParameterError(
            "tool_choice", 'must be "none", "auto", "required" or {"type": "function", ...}'
        )

    def constraint(self) -> StructuredOutputsParams | None:
        """What "required" and a named function hold the answer to, in the format's
        own syntax (None for auto), closed within max_tokens: a call cut inside its
        arguments would be no call."""
        if self.choice == "auto":
            return None
        if self.choice == "named":
            tools, most = {self.named: self.schemas[self.named]}, 1
        else:
            tools, most = self.schemas, (self.max_calls if self.parallel else 1)
        grammar = self.format.grammar(tools, most, self.literal)
        return StructuredOutputsParams(grammar=grammar, source="tool_choice", close_in_budget=True)

    # -- reading the answer -------------------------------------------------------------

    def read(self, text: str, final: bool) -> Reading:
        """The content and the calls of an answer, whole (``final``) or growing."""
        return self.format.read(text, final, self.schemas)

    def parse(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        """(the message content, the tool calls in OpenAI's shape) of a whole answer.
        A call cut short (max_tokens) is left out; text that holds no whole call stays
        content (none for a grammar-held answer, which is calls only)."""
        reading = self.read(text, final=True)
        calls = [self.call(c.name, c.arguments) for c in reading.calls if c.complete]
        if not calls:
            return (text if self.choice == "auto" else None), []
        return text[: reading.content_end].strip() or None, calls

    def call(self, name: str, arguments: str) -> dict[str, Any]:
        return {
            "id": self.format.call_id(), "type": "function",
            "function": {"name": name, "arguments": arguments},
        }  # fmt: skip


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


def special_literal(tokenizer: Any) -> Spelling:
    """How a tool grammar spells a marker for this tokenizer: the special token it has
    for the text (a model writes "[TOOL_CALLS]" as one token, which the text's bytes
    would never give), else the text."""

    def literal(text: str) -> str:
        ids = tokenizer.encode(text, False) if tokenizer is not None else []
        if len(ids) == 1 and tokenizer.decode(ids, True) == "":
            return f"<[{ids[0]}]>"
        return text_literal(text)

    return literal
