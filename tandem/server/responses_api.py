"""OpenAI's Responses API (``POST /v1/responses``), stateless, over the chat path: the
OpenAI Agents SDK's default API.

One translation each way, as for the Messages API (anthropic.py):

    ResponsesRequest --to_chat--> ChatCompletionRequest
    chat response    --to_response--> a response object (output items, usage)
    chat chunks      --response_events--> the Responses stream events

Served: ``input`` as a string or items (messages with input_text / output_text parts,
``function_call`` and ``function_call_output`` items; reasoning items are skipped),
``instructions``, function ``tools``, ``tool_choice`` (auto, none, required, a named
function), ``parallel_tool_calls``, ``text.format`` (text, json_object, json_schema),
``max_output_tokens``, ``temperature``, ``top_p``; ``reasoning.effort`` (a thinking
budget, reasoning.EFFORT_BUDGETS) and a thinking model's thinking as a ``reasoning``
item before the message (its text in ``content`` as reasoning_text, streamed as
response.reasoning_text.delta; no summary is written); ``metadata`` and ``user`` are
accepted and change nothing.
Refused with a 400 naming the field, since each would change what is answered:
stored responses (``store: true``), ``previous_response_id``, ``conversation``,
``background``, prompt templates (``prompt``), ``include``, ``truncation: "auto"``,
built-in tools (anything but ``type: "function"``), image and file inputs.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from pydantic import Field

from tandem.errors import InvalidParameterError
from tandem.server.errors import APIError
from tandem.server.protocol import (
    INT_LIMIT,
    ChatCompletionRequest,
    _Body,
    joined_text,
    string_field,
)
from tandem.server.reasoning import EFFORT_BUDGETS

_TEXT_PARTS = ("input_text", "output_text", "text")


class ResponsesRequest(_Body):
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    text: dict[str, Any] | None = None
    max_output_tokens: int | None = Field(None, ge=1, le=INT_LIMIT)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    stream: bool = False
    reasoning: dict[str, Any] | None = None  # its effort: a thinking budget
    # Accepted: they change nothing here.
    metadata: dict[str, str] | None = None
    user: str | None = None
    # Refused unless off (see to_chat).
    store: bool | None = None
    previous_response_id: str | None = None
    conversation: str | dict[str, Any] | None = None
    background: bool | None = None
    prompt: dict[str, Any] | None = None
    include: list[str] | None = None
    truncation: str | None = None

    def refuse_stateful(self) -> None:
        refused = {
            "store": (self.store is True, "stored responses are not served (send store: false)"),
            "previous_response_id": (self.previous_response_id is not None,
                                     "stored responses are not served: send the whole input"),
            "conversation": (self.conversation is not None, "conversations are not stored here"),
            "background": (self.background is True, "background responses are not served"),
            "prompt": (self.prompt is not None, "prompt templates are not served"),
            "include": (bool(self.include), "no extra output data is served"),
            "truncation": (self.truncation not in (None, "disabled"),
                           'only "disabled": an input over the context is a 400'),
        }  # fmt: skip
        for name, (set_, message) in refused.items():
            if set_:
                raise InvalidParameterError(name, message)


def to_chat(body: ResponsesRequest) -> ChatCompletionRequest:
    body.refuse_stateful()
    messages: list[dict[str, Any]] = []
    if body.instructions:
        messages.append({"role": "system", "content": body.instructions})
    if isinstance(body.input, str):
        messages.append({"role": "user", "content": body.input})
    else:
        for index, item in enumerate(body.input):
            _add_item(messages, item, f"input[{index}]")
    if not messages:
        raise InvalidParameterError("input", "is empty")
    chat: dict[str, Any] = {"model": body.model, "messages": messages, "stream": body.stream}
    if body.stream:
        chat["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
    if body.max_output_tokens is not None:
        chat["max_tokens"] = body.max_output_tokens
    for name in ("temperature", "top_p"):
        if getattr(body, name) is not None:
            chat[name] = getattr(body, name)
    effort = (body.reasoning or {}).get("effort")
    if effort is not None:
        if effort not in EFFORT_BUDGETS:
            choices = ", ".join(EFFORT_BUDGETS)
            raise InvalidParameterError("reasoning.effort", f"must be one of {choices}")
        chat["reasoning_effort"] = effort
    if body.tools:
        chat["tools"] = [_function_tool(tool, f"tools[{i}]") for i, tool in enumerate(body.tools)]
        chat["parallel_tool_calls"] = body.parallel_tool_calls
    if body.tool_choice is not None:
        chat["tool_choice"] = _tool_choice(body.tool_choice)
    format_ = (body.text or {}).get("format")
    if format_ is not None:
        chat["response_format"] = _response_format(format_)
    return ChatCompletionRequest.model_validate(chat)


def _add_item(messages: list[dict[str, Any]], item: dict[str, Any], where: str) -> None:
    kind = item.get("type", "message")
    if kind == "message":
        role = item.get("role")
        if role not in ("user", "system", "developer", "assistant"):
            raise InvalidParameterError(
                f"{where}.role", "must be user, system, developer or assistant"
            )
        messages.append({
            "role": "system" if role == "developer" else role,
            "content": joined_text(item.get("content"), f"{where}.content", _TEXT_PARTS),
        })  # fmt: skip
    elif kind == "function_call":
        call = {
            "id": string_field(item, "call_id", where), "type": "function",
            "function": {"name": string_field(item, "name", where),
                         "arguments": string_field(item, "arguments", where)},
        }  # fmt: skip
        last = messages[-1] if messages else None
        if last is not None and last["role"] == "assistant":
            last.setdefault("tool_calls", []).append(call)  # parallel calls: one turn
        else:
            messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
    elif kind == "function_call_output":
        output = item.get("output")
        text = (
            output
            if isinstance(output, str)
            else joined_text(output, f"{where}.output", _TEXT_PARTS)
        )
        messages.append(
            {"role": "tool", "tool_call_id": string_field(item, "call_id", where), "content": text}
        )
    elif kind == "reasoning":
        return  # earlier reasoning: not part of what the model reads again
    else:
        raise InvalidParameterError(f"{where}.type", f"{kind!r} items are not supported")


def _function_tool(tool: dict[str, Any], where: str) -> dict[str, Any]:
    if tool.get("type") != "function":
        raise InvalidParameterError(
            f"{where}.type", f"{tool.get('type')!r}: only function tools are served"
        )
    function = {"name": tool.get("name"), "parameters": tool.get("parameters") or {}}
    if tool.get("description") is not None:
        function["description"] = tool["description"]
    return {"type": "function", "function": function}


def _tool_choice(choice: str | dict[str, Any]) -> str | dict[str, Any]:
    if isinstance(choice, str):
        return choice  # auto, none, required (others: the chat path's 400)
    if choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    raise InvalidParameterError("tool_choice", 'must be "auto", "none", "required" or a function')


def _response_format(format_: dict[str, Any]) -> dict[str, Any] | None:
    kind = format_.get("type")
    if kind == "text":
        return {"type": "text"}
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        schema = {
            k: format_[k] for k in ("name", "schema", "strict", "description") if k in format_
        }
        return {"type": "json_schema", "json_schema": schema}
    raise InvalidParameterError("text.format.type", "must be text, json_object or json_schema")


# -- the answer ----------------------------------------------------------------------


def _message_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {
        "type": "message", "id": item_id, "status": status, "role": "assistant",
        "content": [_text_part(text)] if status == "completed" else [],
    }  # fmt: skip


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _reasoning_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {
        "type": "reasoning", "id": item_id, "status": status, "summary": [],
        "content": [{"type": "reasoning_text", "text": text}] if status == "completed" else [],
    }  # fmt: skip


def _call_item(item_id: str, call_id: str, name: str, arguments: str, status: str):
    return {
        "type": "function_call", "id": item_id, "call_id": call_id, "name": name,
        "arguments": arguments, "status": status,
    }  # fmt: skip


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponseShape:
    """The response object's fields, from the request (they echo it) and the answer."""

    def __init__(self, body: ResponsesRequest, model: str) -> None:
        self.id = _item_id("resp")
        self.created_at = int(time.time())
        self.body = body
        self.model = model

    def object(self, status: str, output: list[dict[str, Any]], usage=None, finish=None):
        body = self.body
        incomplete = status == "incomplete"
        return {
            "id": self.id, "object": "response", "created_at": self.created_at,
            "status": status, "model": self.model, "output": output,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "instructions": body.instructions, "metadata": body.metadata or {},
            "parallel_tool_calls": body.parallel_tool_calls,
            "temperature": body.temperature, "top_p": body.top_p,
            "max_output_tokens": body.max_output_tokens,
            "tool_choice": body.tool_choice if body.tool_choice is not None else "auto",
            "tools": body.tools or [], "text": body.text or {"format": {"type": "text"}},
            "reasoning": body.reasoning, "store": False, "truncation": "disabled",
            "user": body.user,
            "usage": usage,
        }  # fmt: skip


def _usage(chat_usage: dict[str, Any]) -> dict[str, Any]:
    return {
        "input_tokens": chat_usage["prompt_tokens"],
        "input_tokens_details": {
            "cached_tokens": (chat_usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        },
        "output_tokens": chat_usage["completion_tokens"],
        "output_tokens_details": {
            "reasoning_tokens": (chat_usage.get("completion_tokens_details") or {}).get(
                "reasoning_tokens", 0
            )
        },
        "total_tokens": chat_usage["prompt_tokens"] + chat_usage["completion_tokens"],
    }


def to_response(answer: dict[str, Any], shape: ResponseShape) -> dict[str, Any]:
    """A chat completion (one choice) as a response object."""
    choice = answer["choices"][0]
    message = choice["message"]
    output = []
    if message.get("reasoning_content"):  # (an empty thinking: no item, as when streamed)
        output.append(_reasoning_item(_item_id("rs"), message["reasoning_content"], "completed"))
    if message.get("content"):
        output.append(_message_item(_item_id("msg"), message["content"], "completed"))
    for call in message.get("tool_calls") or []:
        function = call["function"]
        output.append(
            _call_item(
                _item_id("fc"), call["id"], function["name"], function["arguments"], "completed"
            )
        )
    status = "incomplete" if choice["finish_reason"] == "length" else "completed"
    return shape.object(status, output, _usage(answer["usage"]))


async def response_events(
    chunks: AsyncIterator[dict[str, Any] | APIError], shape: ResponseShape
) -> AsyncIterator[str]:
    """Chat stream chunks (the usage in each; an APIError if the request fails midway)
    as the Responses API's server-sent events, each with its sequence number."""
    sequence = 0
    output: list[dict[str, Any]] = []  # finished items
    current: dict[str, Any] | None = None  # the item being streamed
    text = ""
    usage = finish = None

    def event(kind: str, **payload: Any) -> str:
        nonlocal sequence
        data = {"type": kind, "sequence_number": sequence, **payload}
        sequence += 1
        return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"

    def close() -> list[str]:
        """The done events of the item being streamed."""
        nonlocal current, text
        if current is None:
            return []
        index, item_id = len(output), current["id"]
        if current["type"] == "reasoning":
            done = _reasoning_item(item_id, text, "completed")
            events = [
                event("response.reasoning_text.done", item_id=item_id, output_index=index,
                      content_index=0, text=text),
            ]  # fmt: skip
        elif current["type"] == "message":
            done = _message_item(item_id, text, "completed")
            events = [
                event("response.output_text.done", item_id=item_id, output_index=index,
                      content_index=0, text=text, logprobs=[]),
                event("response.content_part.done", item_id=item_id, output_index=index,
                      content_index=0, part=_text_part(text)),
            ]  # fmt: skip
        else:
            done = {**current, "status": "completed"}
            events = [
                event("response.function_call_arguments.done", item_id=item_id,
                      output_index=index, name=done["name"], arguments=done["arguments"])
            ]  # fmt: skip
        events.append(event("response.output_item.done", output_index=index, item=done))
        output.append(done)
        current, text = None, ""
        return events

    def open_item(item: dict[str, Any]) -> list[str]:
        """Close the item being streamed, start ``item``: their events."""
        nonlocal current
        events = close()
        current = item
        return [*events, event("response.output_item.added", output_index=len(output), item=item)]

    yield event("response.created", response=shape.object("in_progress", []))
    yield event("response.in_progress", response=shape.object("in_progress", []))
    async for chunk in chunks:
        if isinstance(chunk, APIError):
            error = chunk.body()["error"]
            yield event("error", code=error["code"], message=error["message"], param=error["param"])
            return
        if chunk.get("usage"):
            usage = _usage(chunk["usage"])
        for choice in chunk["choices"]:
            delta = choice["delta"]
            if delta.get("reasoning_content"):
                if current is None or current["type"] != "reasoning":
                    for opened in open_item(_reasoning_item(_item_id("rs"), "", "in_progress")):
                        yield opened
                text += delta["reasoning_content"]
                yield event("response.reasoning_text.delta", item_id=current["id"],
                            output_index=len(output), content_index=0,
                            delta=delta["reasoning_content"])  # fmt: skip
            if delta.get("content"):
                if current is None or current["type"] != "message":
                    for opened in open_item(_message_item(_item_id("msg"), "", "in_progress")):
                        yield opened
                    yield event(
                        "response.content_part.added", item_id=current["id"],
                        output_index=len(output), content_index=0, part=_text_part(""),
                    )  # fmt: skip
                text += delta["content"]
                yield event("response.output_text.delta", item_id=current["id"],
                            output_index=len(output), content_index=0, delta=delta["content"],
                            logprobs=[])  # fmt: skip
            for call in delta.get("tool_calls") or []:
                if call.get("id"):  # a new call
                    name = call["function"]["name"]
                    item = _call_item(_item_id("fc"), call["id"], name, "", "in_progress")
                    for opened in open_item(item):
                        yield opened
                piece = call["function"].get("arguments") or ""
                if piece:
                    current["arguments"] += piece
                    yield event("response.function_call_arguments.delta", item_id=current["id"],
                                output_index=len(output), delta=piece)  # fmt: skip
            finish = choice.get("finish_reason") or finish
    for done in close():
        yield done
    status = "incomplete" if finish == "length" else "completed"
    yield event(f"response.{status}", response=shape.object(status, output, usage))
