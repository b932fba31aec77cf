"""Anthropic's Messages API (``POST /v1/messages``, ``/v1/messages/count_tokens``) over
the chat path, so that Anthropic-SDK clients and agents work against a local model.

One translation each way, not a second server:

    MessagesRequest --to_chat--> ChatCompletionRequest   (the chat path's validation,
                                                          limits, tools, grammar,
                                                          metrics and fault isolation)
    chat response   --to_message--> a message            (content blocks, stop_reason)
    chat chunks     --message_events--> Anthropic's events (message_start, ping,
                                          content_block_start / _delta / _stop,
                                          message_delta, message_stop; error)
    APIError        --error_body--> {"type": "error", "error": {"type", "message"}}

Mapped: ``system`` -> a system turn; text blocks -> content parts; ``tool_use`` blocks
-> the assistant's tool_calls; ``tool_result`` blocks -> tool turns (before the user's
text, as Anthropic orders them); ``tools`` (name, description, input_schema) ->
function tools; ``tool_choice`` auto / any / tool / none -> auto / required / a named
function / none, ``disable_parallel_tool_use`` -> parallel_tool_calls false;
``stop_sequences`` -> stop; ``thinking`` -> the chat template's ``enable_thinking``
(``enabled`` / ``adaptive``: on, ``disabled``: off, absent: the template's default)
and ``budget_tokens`` -> the thinking budget the engine enforces. A thinking model's
thinking (server/reasoning.py) comes back as a ``thinking`` block before the text,
streamed as thinking_delta events (its signature is empty: nothing here signs it).
Refused with a 400 naming the field: image and document blocks. ``metadata`` and
cache_control marks are accepted and ignored.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from typing import Any, Literal

from pydantic import BaseModel, Field

from tandem.errors import InvalidParameterError
from tandem.server.errors import APIError
from tandem.server.protocol import (
    INT_LIMIT,
    ChatCompletionRequest,
    _Body,
    joined_text,
    string_field,
)

PATH_PREFIX = "/v1/messages"

# Anthropic's error types by HTTP status (its documented set; 503 is its overloaded).
_ERROR_TYPES = {
    400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
    404: "not_found_error", 408: "timeout_error", 413: "request_too_large",
    429: "rate_limit_error", 503: "overloaded_error", 529: "overloaded_error",
}  # fmt: skip
# Chat fields whose Anthropic names differ, for error messages.
_FIELD_NAMES = {
    "stop": "stop_sequences", "parallel_tool_calls": "tool_choice",
    "thinking_budget": "thinking.budget_tokens",
}  # fmt: skip


class AnthropicErrorDetail(BaseModel):
    type: str
    message: str


class AnthropicErrorResponse(BaseModel):
    """Every error of the Messages API's routes, with its HTTP status."""

    type: Literal["error"]
    error: AnthropicErrorDetail


ERRORS = {status: {"model": AnthropicErrorResponse} for status in (400, 401, 404, 413, 500, 503)}
STREAMING = {
    200: {
        "description": "A message, or with stream=true Anthropic's server-sent events "
        "('event: <type>' and 'data: <JSON>' lines; an error event on failure).",
        "content": {"text/event-stream": {"schema": {"type": "string"}}},
    },
    **ERRORS,
}


class AnthropicMessage(_Body):
    role: Literal["user", "assistant"]
    content: str | list[dict[str, Any]]


class AnthropicTool(_Body):
    name: str
    description: str | None = None
    input_schema: dict[str, Any]


class AnthropicToolChoice(_Body):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False


class CountTokensRequest(_Body):
    model: str
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: AnthropicToolChoice | None = None
    thinking: dict[str, Any] | None = None


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1, le=INT_LIMIT)
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(None, ge=0, le=1)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0, le=INT_LIMIT)
    stream: bool = False
    metadata: dict[str, Any] | None = None


def to_chat(body: CountTokensRequest) -> ChatCompletionRequest:
    """The chat request that answers ``body`` (InvalidParameterError names the
    Messages API's field)."""
    messages = []
    system = joined_text(body.system, "system", ("text",)) if body.system is not None else ""
    if system:
        messages.append({"role": "system", "content": system})
    for index, message in enumerate(body.messages):
        messages += _chat_messages(message, f"messages[{index}]")
    chat: dict[str, Any] = {"model": body.model, "messages": messages}
    if body.thinking is not None:
        chat.update(_thinking(body.thinking, getattr(body, "max_tokens", None)))
    if isinstance(body, MessagesRequest):
        chat.update(max_tokens=body.max_tokens, stream=body.stream)
        if body.stream:  # the usage in every chunk: message_start needs the prompt's
            chat["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
        for name in ("temperature", "top_p", "top_k"):
            if getattr(body, name) is not None:
                chat[name] = getattr(body, name)
        if body.stop_sequences:
            chat["stop"] = body.stop_sequences
    if body.tools:
        chat["tools"] = [
            {"type": "function", "function": {
                "name": tool.name, "description": tool.description or "",
                "parameters": tool.input_schema,
            }}
            for tool in body.tools
        ]  # fmt: skip
    choice = body.tool_choice
    if choice is not None:
        if choice.type == "tool" and not choice.name:
            raise InvalidParameterError("tool_choice.name", 'is required with type "tool"')
        chat["tool_choice"] = {
            "auto": "auto", "any": "required", "none": "none",
            "tool": {"type": "function", "function": {"name": choice.name}},
        }[choice.type]  # fmt: skip
        chat["parallel_tool_calls"] = not choice.disable_parallel_tool_use
    return ChatCompletionRequest.model_validate(chat)


def _thinking(thinking: dict[str, Any], max_tokens: int | None) -> dict[str, Any]:
    """The chat fields for Anthropic's ``thinking``: the template's switch, the budget."""
    kind = thinking.get("type")
    if kind not in ("enabled", "adaptive", "disabled"):
        raise InvalidParameterError("thinking.type", "must be enabled, adaptive or disabled")
    fields: dict[str, Any] = {"chat_template_kwargs": {"enable_thinking": kind != "disabled"}}
    budget = thinking.get("budget_tokens")
    if budget is not None and kind != "enabled":
        raise InvalidParameterError("thinking.budget_tokens", 'goes with type "enabled"')
    if budget is not None:
        if type(budget) is not int or budget < 1:
            raise InvalidParameterError("thinking.budget_tokens", "must be an integer >= 1")
        if max_tokens is not None and budget >= max_tokens:
            raise InvalidParameterError("thinking.budget_tokens", "must be less than max_tokens")
        fields["thinking_budget"] = budget
    return fields


def _chat_messages(message: AnthropicMessage, where: str) -> list[dict[str, Any]]:
    """One Anthropic turn as chat messages: its tool results as tool turns first,
    then its text (and, for the assistant, its tool calls)."""
    if isinstance(message.content, str):
        return [{"role": message.role, "content": message.content}]
    parts, calls, results = [], [], []
    for index, block in enumerate(message.content):
        at = f"{where}.content[{index}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            parts.append({"type": "text", "text": string_field(block, "text", at)})
        elif kind == "tool_use" and message.role == "assistant":
            arguments = block.get("input", {})
            if not isinstance(arguments, dict):
                raise InvalidParameterError(f"{at}.input", "must be an object")
            calls.append({
                "id": string_field(block, "id", at), "type": "function",
                "function": {"name": string_field(block, "name", at),
                             "arguments": json.dumps(arguments, ensure_ascii=False)},
            })  # fmt: skip
        elif kind == "tool_result" and message.role == "user":
            content = block.get("content", "")
            text = joined_text(content, f"{at}.content", ("text",)) if content is not None else ""
            if block.get("is_error") is True:
                text = f"Error: {text}"
            results.append(
                {
                    "role": "tool",
                    "tool_call_id": string_field(block, "tool_use_id", at),
                    "content": text,
                }
            )
        elif kind in ("thinking", "redacted_thinking") and message.role == "assistant":
            continue  # earlier reasoning: not part of what the model reads again
        else:
            raise InvalidParameterError(
                f"{at}.type", f"{kind!r} blocks are not supported in {message.role} messages"
            )
    turns = results
    if message.role == "user" and parts:
        turns.append({"role": "user", "content": parts})
    elif message.role == "assistant" and (parts or calls):
        turn: dict[str, Any] = {"role": "assistant", "content": parts or None}
        if calls:
            turn["tool_calls"] = calls
        turns.append(turn)
    if not turns:
        raise InvalidParameterError(f"{where}.content", "is empty")
    return turns


# -- the answer ----------------------------------------------------------------------


def _stop(finish: str | None, stop_reason: Any) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) for a chat choice's finish."""
    if finish == "length":
        return "max_tokens", None
    if finish == "tool_calls":
        return "tool_use", None
    if isinstance(stop_reason, str):
        return "stop_sequence", stop_reason
    return "end_turn", None


def _tool_use(call: dict[str, Any]) -> dict[str, Any] | None:
    """A chat tool call as a tool_use block (None: arguments that are not an object)."""
    try:
        arguments = json.loads(call["function"]["arguments"])
    except json.JSONDecodeError:
        return None
    if not isinstance(arguments, dict):
        return None
    return {
        "type": "tool_use", "id": _tool_use_id(call["id"]), "name": call["function"]["name"],
        "input": arguments,
    }  # fmt: skip


def _tool_use_id(call_id: str) -> str:
    return "toolu_" + call_id.removeprefix("call_")


def to_message(response: dict[str, Any]) -> dict[str, Any]:
    """A chat completion (one choice) as a message."""
    choice = response["choices"][0]
    message = choice["message"]
    content = []
    if message.get("reasoning_content"):  # (an empty thinking: no block, as when streamed)
        content.append({"type": "thinking", "thinking": message["reasoning_content"],
                        "signature": ""})  # fmt: skip
    if message.get("content"):
        content.append({"type": "text", "text": message["content"]})
    for call in message.get("tool_calls") or []:
        block = _tool_use(call)
        content.append(block or {"type": "text", "text": call["function"]["arguments"]})
    stop_reason, stop_sequence = _stop(choice["finish_reason"], choice.get("stop_reason"))
    usage = response["usage"]
    return {
        "id": f"msg_{uuid.uuid4().hex}", "type": "message", "role": "assistant",
        "model": response["model"], "content": content, "stop_reason": stop_reason,
        "stop_sequence": stop_sequence,
        "usage": {"input_tokens": usage["prompt_tokens"],
                  "output_tokens": usage["completion_tokens"]},
    }  # fmt: skip


def _event(name: str, payload: dict[str, Any]) -> str:
    return f"event: {name}\ndata: {json.dumps({'type': name, **payload}, ensure_ascii=False)}\n\n"


async def message_events(chunks: AsyncIterator[dict[str, Any] | APIError], model: str):
    """Chat stream chunks (with the usage in each, and an APIError if the request fails
    midway) as Anthropic's server-sent events."""
    usage = {"input_tokens": 0, "output_tokens": 0}
    open_block: int | None = None  # the index of the content block being streamed
    kind = None  # its type
    blocks = 0
    finish = stop_reason = None
    started = False

    def close() -> str | None:
        nonlocal open_block
        if open_block is None:
            return None
        event = _event("content_block_stop", {"index": open_block})
        if kind == "thinking":  # a thinking block ends with its signature (none here)
            signature = {"type": "signature_delta", "signature": ""}
            event = _event("content_block_delta", {"index": open_block, "delta": signature}) + event
        open_block = None
        return event

    def start(content_block: dict[str, Any]) -> str:
        nonlocal open_block, kind, blocks
        open_block, kind, blocks = blocks, content_block["type"], blocks + 1
        return _event("content_block_start", {"index": open_block, "content_block": content_block})

    async for chunk in chunks:
        if isinstance(chunk, APIError):
            yield _event("error", {"error": error_body(chunk)["error"]})
            return
        if chunk.get("usage"):
            usage = {"input_tokens": chunk["usage"]["prompt_tokens"],
                     "output_tokens": chunk["usage"]["completion_tokens"]}  # fmt: skip
        if not started:
            started = True
            yield _event("message_start", {"message": {
                "id": f"msg_{uuid.uuid4().hex}", "type": "message", "role": "assistant",
                "model": model, "content": [], "stop_reason": None, "stop_sequence": None,
                "usage": {**usage, "output_tokens": 0},
            }})  # fmt: skip
            yield _event("ping", {})
        for choice in chunk["choices"]:
            delta = choice["delta"]
            if delta.get("reasoning_content"):
                if kind != "thinking" or open_block is None:
                    if (event := close()) is not None:
                        yield event
                    yield start({"type": "thinking", "thinking": "", "signature": ""})
                yield _event("content_block_delta", {
                    "index": open_block,
                    "delta": {"type": "thinking_delta", "thinking": delta["reasoning_content"]},
                })  # fmt: skip
            if delta.get("content"):
                if kind != "text" or open_block is None:
                    if (event := close()) is not None:
                        yield event
                    yield start({"type": "text", "text": ""})
                yield _event("content_block_delta", {
                    "index": open_block, "delta": {"type": "text_delta", "text": delta["content"]},
                })  # fmt: skip
            for call in delta.get("tool_calls") or []:
                arguments = call["function"].get("arguments") or ""
                if call.get("id"):  # a new call
                    if (event := close()) is not None:
                        yield event
                    yield start({"type": "tool_use", "id": _tool_use_id(call["id"]),
                                 "name": call["function"]["name"], "input": {}})  # fmt: skip
                if arguments:
                    yield _event("content_block_delta", {
                        "index": open_block,
                        "delta": {"type": "input_json_delta", "partial_json": arguments},
                    })  # fmt: skip
            if choice.get("finish_reason"):
                finish, stop_reason = choice["finish_reason"], choice.get("stop_reason")
    if (event := close()) is not None:
        yield event
    reason, sequence = _stop(finish, stop_reason)
    yield _event("message_delta", {
        "delta": {"stop_reason": reason, "stop_sequence": sequence},
        "usage": {"output_tokens": usage["output_tokens"]},
    })  # fmt: skip
    yield _event("message_stop", {})


def error_body(error: APIError) -> dict[str, Any]:
    """An error in Anthropic's shape."""
    message = str(error)
    if error.param in _FIELD_NAMES and message.startswith(error.param):
        message = _FIELD_NAMES[error.param] + message[len(error.param) :]
    kind = _ERROR_TYPES.get(
        error.status, "api_error" if error.status >= 500 else "invalid_request_error"
    )
    return {"type": "error", "error": {"type": kind, "message": message}}
