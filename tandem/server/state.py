"""What every route of one server shares: the engine client, the served model's name
and card, the limits, the key, and the chat path that the OpenAI, Anthropic and
Responses routes all answer through. ``build_app`` (api.py) makes one and keeps it as
``app.state.served``; routes reach it through ``served(request)``."""

from __future__ import annotations

import asyncio
import dataclasses
import secrets
import time
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as distribution_version
from typing import Any

from fastapi import Request

from tandem.errors import InvalidParameterError
from tandem.sampling import SamplingParams, ThinkingParams, model_sampling_defaults
from tandem.server.errors import APIError
from tandem.server.handlers import CompletionHandler, engine_prompt
from tandem.server.limits import ServerLimits
from tandem.server.protocol import ChatCompletionRequest, ErrorResponse
from tandem.server.reasoning import EFFORT_BUDGETS, PARSER_CLASSES, parser_for
from tandem.server.reasoning import plan as reasoning_plan
from tandem.server.tool_calls import ToolCalling, special_literal
from tandem.server.tool_formats import tool_format
from tandem.serving.engine_client import EngineClient

# What each route documents besides its 200 (the framework's 422 is never sent).
ERRORS = {status: {"model": ErrorResponse} for status in (400, 401, 403, 404, 413, 500, 503)}
STREAMING = {
    200: {
        "description": "A JSON response, or with stream=true server-sent events: "
        "'data: <chunk JSON>' lines, an error chunk on failure, then 'data: [DONE]'.",
        "content": {"text/event-stream": {"schema": {"type": "string"}}},
    },
    **ERRORS,
}


def package_version() -> str:
    try:
        return distribution_version("tandem")
    except PackageNotFoundError:  # run from a checkout that is not installed
        return "unknown"


@dataclass
class ServedModel:
    engine: EngineClient
    model_name: str
    api_key: str | None = None
    limits: ServerLimits = field(default_factory=ServerLimits)
    enable_trace_endpoints: bool = False
    tool_call_parser: str = "auto"  # the format chat answers write tool calls in
    # How a thinking model's answers are split (reasoning.py): auto, none, think, ...
    reasoning_parser: str = "auto"

    def __post_init__(self) -> None:
        info = self.engine.info
        self.handler = CompletionHandler(self.engine, self.model_name)
        self.tokenizer = info.tokenizer
        self.max_model_len = info.max_model_len
        self.defaults = model_sampling_defaults(info.generation_config)
        template = getattr(self.tokenizer, "chat_template_source", None)
        self.reasoning = parser_for(self.reasoning_parser, template)
        self._parser = PARSER_CLASSES[self.reasoning] if self.reasoning else None
        self.tool_format = tool_format(self.tool_call_parser, template)
        self._thinking_end: tuple[int, ...] | None = None  # </think>'s (or <|end|>'s) ids
        self.card = {
            "id": self.model_name,
            "object": "model",
            "created": int(time.time()),
            "owned_by": "tandem",
            "root": str(self.engine.config.model),
            "max_model_len": self.max_model_len,
        }

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise APIError(
                404,
                f"the model {name!r} does not exist; this server serves {self.model_name!r}",
                "invalid_request_error",
                "model",
                "model_not_found",
            )

    def need_tokenizer(self, param: str):
        if self.tokenizer is None:
            raise InvalidParameterError(param, "this model has no tokenizer; send token ids")
        return self.tokenizer

    async def chat_prompt(self, body: ChatCompletionRequest, tools: ToolCalling | None):
        """The conversation rendered by the chat template, as token ids."""
        encoder = self.need_tokenizer("messages")
        text = await self.chat_text(body, tools)
        return await asyncio.to_thread(encoder.encode, text, False)

    async def chat_text(self, body: ChatCompletionRequest, tools: ToolCalling | None) -> str:
        encoder = self.need_tokenizer("messages")
        template_variables = dict(body.chat_template_kwargs or {})
        if tools is not None:
            template_variables["tools"] = tools.tools
        return await asyncio.to_thread(  # long conversations: off the event loop
            encoder.apply_chat_template,
            body.conversation(),
            add_generation_prompt=body.add_generation_prompt,
            continue_final_message=body.continue_final_message,
            **template_variables,
        )

    def tool_calling(self, body: ChatCompletionRequest) -> ToolCalling | None:
        literal = special_literal(self.tokenizer)
        return body.tool_calling(self.tool_format, self.limits.max_tool_calls, literal)

    async def chat(self, body: ChatCompletionRequest, request: Request, events=None) -> Any:
        """A chat completion, the path every chat-shaped API takes (``events``: how a
        stream is told in that API's own events)."""
        self.check_model(body.model)
        self.limits.check(body)
        tools = self.tool_calling(body)
        params = body.sampling_params(self.defaults, tools)
        special = tools is not None and tools.format.special  # its markers: special tokens
        if special or (self._parser is not None and self._parser.special):
            params = dataclasses.replace(params, skip_special_tokens=False)
        text = await self.chat_text(body, tools)
        reasoning = None
        if self.reasoning is not None:
            text, params, reasoning = self._thinking(body, text, params)
        elif body.thinking_budget is not None:
            raise InvalidParameterError(
                "thinking_budget",
                "this model is served without thinking (see tandem serve --reasoning-parser)",
            )
        ids = await asyncio.to_thread(self.tokenizer.encode, text, False)
        return await self.handler.serve(
            request, "chatcmpl", [engine_prompt(ids, body.cache_salt)], params, body.stream,
            body.include_usage_in_stream, chat=True, kv_transfer_params=body.kv_transfer_params,
            continuous_usage=body.continuous_usage_in_stream, tools=tools, reasoning=reasoning,
            events=events,
        )  # fmt: skip

    def _thinking(self, body: ChatCompletionRequest, text: str, params: SamplingParams):
        """(prompt text, params, parser) of a chat on a thinking model: the budget and
        the reply's constraint held by the engine (reasoning.plan)."""
        budget = body.thinking_budget
        if budget is None and body.reasoning_effort is not None:
            budget = EFFORT_BUDGETS[body.reasoning_effort]
        parser = self._parser
        plan = reasoning_plan(text, budget, params.structured_outputs is not None, parser)
        if plan.gated:
            if self._thinking_end is None:
                self._thinking_end = tuple(self.tokenizer.encode(parser.end, False))
            thinking = ThinkingParams(self._thinking_end, budget)
            params = dataclasses.replace(params, thinking=thinking)
        return plan.prompt, params, parser(plan.starts_inside, self._decode_all)

    def _decode_all(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=False)


def served(request: Request) -> ServedModel:
    return request.app.state.served


async def check_key(request: Request) -> None:
    """With --api-key, every route but /health, /metrics and /version needs it."""
    api_key = served(request).api_key
    if api_key is None:
        return
    # The scheme is case-insensitive (RFC 7235): "bearer", "Bearer", "BEARER".
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer":
        given = request.headers.get("x-api-key", "")  # Anthropic's header
    if not secrets.compare_digest(given.strip().encode(), api_key.encode()):
        raise APIError(
            401, "invalid or missing API key", "invalid_request_error", code="invalid_api_key"
        )
