"""Request bodies of the OpenAI API (plus vLLM's extensions), as pydantic models.

Unknown fields are ignored, as OpenAI-compatible servers do; but a known field that
would change the meaning of the answer and that tandem does not implement (the legacy
functions/function_call, best_of, suffix, vLLM's prompt_logprobs) is refused with a
400, never silently dropped. Structured outputs come as OpenAI's ``response_format``,
vLLM's ``structured_outputs`` or its older ``guided_*`` fields; at most one per
request. Tools and tool_choice: tool_calls.py.
Type errors become 400s naming the field (see api.py); value checks happen once, in
SamplingParams, so the HTTP API and the Python API reject exactly the same things.
``ErrorResponse`` is the error body every route documents.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from tandem.errors import InvalidParameterError, require_unicode
from tandem.sampling import (
    MAX_LOGPROBS,
    SEED_MAX,
    SEED_MIN,
    SamplingParams,
    StructuredOutputsParams,
)
from tandem.server.tool_calls import ToolCalling
from tandem.server.tool_formats.base import Spelling, ToolFormat, text_literal

# Every integer a client sends is at most this: above any count, token id or top_k a
# model can use, and far inside the 64-bit integers of the engine's wire format (a
# top_k of 2^70 reached the encoder and came back as a 500).
INT_LIMIT = 2**31 - 1
TokenId = Annotated[int, Field(ge=0, le=INT_LIMIT)]


def string_field(obj: dict[str, Any], key: str, where: str) -> str:
    """``obj[key]``, which must be a string (InvalidParameterError naming where.key)."""
    value = obj.get(key)
    if not isinstance(value, str):
        raise InvalidParameterError(f"{where}.{key}", "must be a string")
    return value


def joined_text(value: Any, where: str, part_types: tuple[str, ...]) -> str:
    """A string, or a list of text parts (of ``part_types``) joined: the content of
    the Messages and Responses APIs' turns, as the chat path joins its parts."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise InvalidParameterError(where, "must be a string or a list of text parts")
    parts = []
    for index, part in enumerate(value):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in part_types:
            raise InvalidParameterError(
                f"{where}[{index}].type", f"{kind!r} parts are not supported"
            )
        parts.append(string_field(part, "text", f"{where}[{index}]"))
    return "".join(parts)


class _Body(BaseModel):
    # Strict: "1" is not an integer nor "true" a boolean; the schema is the contract.
    model_config = ConfigDict(extra="ignore", strict=True)


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str  # a specific code ("invalid_api_key") or the status's name ("bad_request")


class ErrorResponse(BaseModel):
    """Every error, with its HTTP status: 400 bad request, 401 bad key, 404 unknown
    model or route, 405, 408 slow body, 413 body too large, 500, 503 queue full."""

    error: ErrorDetail


class StreamOptions(_Body):
    include_usage: bool = False  # a last chunk with the usage
    continuous_usage_stats: bool = False  # with include_usage: the usage so far in every chunk


class JSONSchema(_Body):
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    """OpenAI's ``response_format``: free text, any JSON object, or JSON that
    validates against ``json_schema.schema``."""

    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchema | None = None


class StructuredOutputs(_Body):
    """vLLM's ``structured_outputs``: exactly one constraint. Its other options
    (structural tags, whitespace patterns) are refused, not ignored."""

    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)
    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class ContentPart(BaseModel):
    """A part of a message's content; only ``{"type": "text", "text": ...}`` is
    supported (any other type is a 400 that says so)."""

    model_config = ConfigDict(extra="allow", strict=True)
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    # Extra fields (name, tool_calls, tool_call_id...) reach the chat template as given.
    model_config = ConfigDict(extra="allow", strict=True)
    role: str = Field(min_length=1)
    # None only for an assistant message that made tool calls (its ``tool_calls``).
    content: str | list[ContentPart] | None = None


def render_conversation(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as chat templates expect them: content parts joined into plain text
    (chat completions and /tokenize count the same tokens); an assistant's tool calls
    with no content keep ``content: None``, as transformers passes them."""
    rendered = []
    for index, message in enumerate(messages):
        content = message.content
        if content is None:
            if message.role != "assistant" or not getattr(message, "tool_calls", None):
                raise InvalidParameterError(
                    f"messages[{index}].content",
                    "is required (only an assistant message with tool_calls may omit it)",
                )
            rendered.append({**message.model_dump(), "content": None})
            continue
        if isinstance(content, list):
            if any(part.type != "text" or part.text is None for part in content):
                raise InvalidParameterError(
                    f"messages[{index}].content", "only text parts are supported"
                )
            content = "".join(part.text for part in content)
        require_unicode(content, f"messages[{index}].content")
        rendered.append({**message.model_dump(exclude_none=True), "content": content})
    for message in rendered:
        if message.get("tool_calls"):
            message["tool_calls"] = [_with_decoded_arguments(c) for c in message["tool_calls"]]
    return rendered


def _with_decoded_arguments(call: Any) -> Any:
    """A call whose JSON-text arguments (OpenAI's shape) are an object again, as chat
    templates take them (transformers' convention: Llama's and Qwen3-Coder's templates
    iterate or re-encode them); text that is not a JSON object stays text."""
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("arguments"), str):
        return call
    try:
        arguments = json.loads(function["arguments"])
    except json.JSONDecodeError:
        return call
    if not isinstance(arguments, dict):
        return call
    return {**call, "function": {**function, "arguments": arguments}}


# Fields of OpenAI's API (and vLLM's) that change what the answer means and that tandem
# does not implement: refused when set to anything but their "off" value.
_UNSUPPORTED_OFF_VALUES: dict[str, tuple[Any, ...]] = {
    "best_of": (None, 1),
    "suffix": (None, ""),
    "functions": (None, []),
    "function_call": (None, "none", "auto"),
    "prompt_logprobs": (None,),  # vLLM's field; completions' echo + logprobs gives them
}


class _Sampling(_Body):
    """Fields shared by completions and chat completions. ``None`` means unset: the
    model's recommended value (generation_config.json) or vLLM's default applies."""

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1, le=INT_LIMIT)
    n: int = Field(1, ge=1, le=INT_LIMIT)
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1, le=INT_LIMIT)
    min_p: float | None = Field(None, ge=0, le=1)
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0)
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = None
    min_tokens: int = Field(0, ge=0, le=INT_LIMIT)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    cache_salt: str | None = None  # requests with different salts never share cached KV
    # Disaggregated serving (tandem.disagg): {"do_remote_decode": true} to a prefill
    # instance; the parameters it returned, to a decode instance.
    kv_transfer_params: dict[str, Any] | None = None
    # token id (a string, as JSON keys are) -> bias added to its logit, in [-100, 100]
    logit_bias: dict[str, float] | None = None
    # Structured outputs: at most one of these (tandem/engine/grammar.py). guided_*: vLLM's
    # older names for the same constraints.
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # Refused unless off (see _UNSUPPORTED_OFF_VALUES); typed so the schema shows it.
    prompt_logprobs: int | None = None

    def refuse_unsupported(self) -> None:
        for name, off in _UNSUPPORTED_OFF_VALUES.items():
            value = getattr(self, name, None)
            if value not in off:
                raise InvalidParameterError(name, "is not supported by this server")

    @property
    def include_usage_in_stream(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage_in_stream(self) -> bool:
        return self.include_usage_in_stream and self.stream_options.continuous_usage_stats

    def _sampling_params(self, defaults: dict[str, Any], max_tokens: int | None, logprobs):
        self.refuse_unsupported()
        chosen = {
            name: getattr(self, name)
            for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
            if getattr(self, name) is not None
        }
        if max_tokens is not None:
            chosen["max_tokens"] = max_tokens
        elif "max_tokens" not in defaults:
            chosen["max_tokens"] = None  # the rest of the context
        return SamplingParams(
            **{**defaults, **chosen},
            n=self.n,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            seed=self.seed,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            min_tokens=self.min_tokens,
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            logit_bias=self._logit_bias(),
            structured_outputs=self._structured_outputs(),
        )

    def _structured_outputs(self) -> StructuredOutputsParams | None:
        """The one constraint asked for, whichever field asked (None: free text)."""
        given: list[StructuredOutputsParams] = []
        response_format = self.response_format
        if response_format is not None and response_format.type != "text":
            schema = response_format.json_schema
            if response_format.type == "json_object" or schema is None or schema.schema_ is None:
                if response_format.type == "json_schema" and schema is None:
                    raise InvalidParameterError(
                        "response_format.json_schema", "is required with type json_schema"
                    )
                given.append(StructuredOutputsParams(json_object=True, source="response_format"))
            else:
                given.append(StructuredOutputsParams(json=schema.schema_, source="response_format"))
        if self.structured_outputs is not None:
            fields = self.structured_outputs.model_dump(exclude_none=True)
            if "json_" in fields:
                fields["json"] = fields.pop("json_")
            given.append(StructuredOutputsParams(**fields, source="structured_outputs"))
        for name, field in (
            ("guided_json", "json"), ("guided_regex", "regex"),
            ("guided_choice", "choice"), ("guided_grammar", "grammar"),
        ):  # fmt: skip
            value = getattr(self, name)
            if value is not None:
                given.append(StructuredOutputsParams(**{field: value}, source=name))
        if len(given) > 1:
            raise InvalidParameterError(
                given[1].source, f"cannot be combined with {given[0].source}"
            )
        return given[0] if given else None

    def _logit_bias(self) -> dict[int, float] | None:
        if not self.logit_bias:
            return None
        bias = {}
        for key, value in self.logit_bias.items():
            if not key.isascii() or not key.isdigit():
                raise InvalidParameterError("logit_bias", f"keys must be token ids, got {key!r}")
            bias[int(key)] = value
        return bias


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[TokenId] | list[list[TokenId]]
    # OpenAI's default for completions; 0 only with echo (score the prompt alone).
    max_tokens: int | None = Field(16, ge=0, le=INT_LIMIT)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    # The prompt before the completion, its tokens' logprobs first with logprobs (how
    # lm-eval-harness scores log-likelihoods: echo, logprobs 1, max_tokens 0).
    echo: bool = False
    best_of: int | None = None  # refused unless 1
    suffix: str | None = None  # refused

    def prompts(self) -> list[str | list[int]]:
        """The batch: one string, a list of strings, token ids, or lists of them."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if not prompt:
            raise InvalidParameterError("prompt", "is empty")
        if isinstance(prompt[0], int):
            return [list(prompt)]
        return list(prompt)

    def sampling_params(self, defaults: dict[str, Any]) -> SamplingParams:
        if self.max_tokens == 0 and not self.echo:
            raise InvalidParameterError("max_tokens", "must be >= 1 (0 only with echo)")
        # max_tokens 0: one token runs the prompt; the response drops it (responses.Echo).
        max_tokens = 1 if self.max_tokens == 0 else self.max_tokens
        params = self._sampling_params(defaults, max_tokens, self.logprobs)
        if self.echo and self.logprobs is not None:
            params = dataclasses.replace(params, prompt_logprobs=self.logprobs)
        return params


# Template variables the server passes itself (the conversation, the special tokens).
RESERVED_TEMPLATE_VARIABLES = {
    "messages", "add_generation_prompt", "continue_final_message", "bos_token", "eos_token",
    "unk_token", "pad_token", "tools",
}  # fmt: skip


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, le=INT_LIMIT)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True
    # Assistant prefill: continue the last message (needs add_generation_prompt false).
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    # Thinking models (server/reasoning.py): the most tokens the thinking may take before
    # its end is forced, or OpenAI's effort, which names such a budget (EFFORT_BUDGETS).
    thinking_budget: int | None = Field(None, ge=0, le=INT_LIMIT)
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = None
    # Tool calling (tool_calls.py): OpenAI's function tools, rendered by the chat template.
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    # Refused unless off (see _UNSUPPORTED_OFF_VALUES): typed so the schema shows them.
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None

    def tool_calling(
        self, format: ToolFormat | str, max_calls: int = 8, literal: Spelling = text_literal
    ) -> ToolCalling | None:
        """The tools this answer may call (None: none may be called); ``format``: the
        ToolFormat (or its name) the model writes calls in."""
        return ToolCalling.of(
            self.tools, self.tool_choice, format, self.parallel_tool_calls, max_calls, literal
        )

    def sampling_params(
        self, defaults: dict[str, Any], tools: ToolCalling | None = None
    ) -> SamplingParams:
        """``tools``: "required" and a named function constrain the answer to calls."""
        params = self._chat_sampling_params(defaults)
        constraint = tools.constraint() if tools is not None else None
        if constraint is None:
            return params
        if params.structured_outputs is not None:
            raise InvalidParameterError(
                params.structured_outputs.source,
                f"cannot be combined with tool_choice {self.tool_choice!r}",
            )
        return dataclasses.replace(params, structured_outputs=constraint)

    def _chat_sampling_params(self, defaults: dict[str, Any]) -> SamplingParams:
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidParameterError("top_logprobs", "requires logprobs to be true")
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        max_tokens = self.max_tokens
        if self.max_completion_tokens is not None:  # 0 is a value, not "unset"
            if self.max_completion_tokens < 1:
                raise InvalidParameterError(
                    "max_completion_tokens", f"must be >= 1, got {self.max_completion_tokens}"
                )
            max_tokens = self.max_completion_tokens
        if self.chat_template_kwargs:
            reserved = RESERVED_TEMPLATE_VARIABLES & set(self.chat_template_kwargs)
            if reserved:
                raise InvalidParameterError(
                    "chat_template_kwargs",
                    f"may not set {', '.join(sorted(reserved))} (the server sets them)",
                )
        return self._sampling_params(defaults, max_tokens, logprobs)

    def conversation(self) -> list[dict[str, Any]]:
        return render_conversation(self.messages)


class TokenizeRequest(_Body):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[TokenId]
