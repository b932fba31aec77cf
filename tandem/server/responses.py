"""OpenAI response shapes: turns the engine's RequestOutputs (deltas when streaming,
the final output otherwise) into stream chunks and final responses, for completions
and chat completions.

One HTTP request may hold several engine requests (a list of prompts), each with n
samples; choice ``i * n + j`` is sample j of prompt i, as OpenAI numbers them.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tandem.outputs import Logprob, RequestOutput
from tandem.server.reasoning import ThinkParser
from tandem.server.tool_calls import ToolCalling

# JSON has no -Infinity; a token the model rules out entirely gets this instead.
MIN_LOGPROB = -9999.0


@dataclass
class Echo:
    """Completions' ``echo``: each choice starts with its prompt (and, with logprobs,
    the prompt tokens' logprobs, the first one null). ``decode`` turns token ids into
    text; ``drop_generated``: max_tokens 0, the prompt alone (one token was generated
    only to run the prompt, and is not shown or counted)."""

    decode: Callable[[list[int]], str]
    drop_generated: bool = False


@dataclass
class _Choice:
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    sent_tokens: int = 0  # tokens whose logprobs were streamed
    sent_offset: int = 0  # characters those tokens decode to (completions' text_offset)
    sent_content: int = 0  # with tools or thinking: characters of the reply streamed
    sent_thinking: int = 0  # with a reasoning parser: characters of thinking streamed
    sent_arguments: list[int] = field(default_factory=list)  # per streamed call: its
    # characters of arguments sent
    calls_from: int = 0  # where the reply's calls start (content stops there)
    thinking_tokens: int | None = None  # counted once its thinking has ended


class ChoiceStream:
    def __init__(
        self,
        response_id: str,
        model: str,
        created: int,
        engine_ids: list[str],
        n: int,
        chat: bool,
        want_logprobs: bool,
        echo: Echo | None = None,
        tools: ToolCalling | None = None,
        reasoning: ThinkParser | None = None,
    ) -> None:
        """``tools``: a chat whose answers may be tool calls (tool_calls.py);
        ``reasoning``: a chat whose answers may think first (reasoning.py): the
        thinking goes out as ``reasoning_content`` (and vLLM's newer ``reasoning``),
        and the rest (content, tool calls) is read from the reply alone."""
        self.response_id, self.model, self.created = response_id, model, created
        self.reasoning = reasoning
        self.chat = chat
        self.n = n
        self.want_logprobs = want_logprobs
        self.echo = echo
        self.tools = tools
        # Per prompt, with echo: its text and its tokens' logprobs (completions' shape).
        self.echoed: dict[int, tuple[str, dict[str, list] | None]] = {}
        self.echo_sent: set[int] = set()  # choices whose echo went out (streaming)
        self._prompt_index = {engine_id: i for i, engine_id in enumerate(engine_ids)}
        self.choices = [_Choice() for _ in range(len(engine_ids) * n)]
        self.prompt_tokens = [0] * len(engine_ids)
        self.cached_tokens = [0] * len(engine_ids)

    @property
    def num_choices(self) -> int:
        return len(self.choices)

    def note_prompt(self, output: RequestOutput) -> int:
        """Record the prompt's token counts (for the usage); returns its index."""
        prompt_index = self._prompt_index[output.request_id]
        self.prompt_tokens[prompt_index] = len(output.prompt_token_ids)
        self.cached_tokens[prompt_index] = output.num_cached_tokens
        if self.echo is not None and prompt_index not in self.echoed:
            self.echoed[prompt_index] = self._echo_of(output)
            base = len(self.echoed[prompt_index][0])
            for choice in self.choices[prompt_index * self.n : (prompt_index + 1) * self.n]:
                choice.sent_offset = base  # generated tokens' text_offset follow the prompt
        return prompt_index

    def _echo_of(self, output: RequestOutput) -> tuple[str, dict[str, list] | None]:
        ids = output.prompt_token_ids
        text = output.prompt if output.prompt is not None else self.echo.decode(ids)
        if not self.want_logprobs or output.prompt_logprobs is None:
            return text, None
        shaped: dict[str, list] = {
            "tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": [],
        }  # fmt: skip
        offset = 0
        for token_id, entry in zip(ids, output.prompt_logprobs, strict=True):
            if entry is None:  # the first token: nothing before it to score it
                piece, logprob, top = self.echo.decode([token_id]), None, None
            else:
                piece, logprob = entry[token_id].decoded_token or "", entry[token_id].logprob
                logprob = _finite(logprob)
                top = {(e.decoded_token or ""): _finite(e.logprob) for e in entry.values()}
            shaped["tokens"].append(piece)
            shaped["token_logprobs"].append(logprob)
            shaped["top_logprobs"].append(top)
            shaped["text_offset"].append(offset)
            offset += len(piece)
        return text, shaped

    def update(self, output: RequestOutput) -> list[tuple[int, dict[str, Any]]]:
        """Take one engine request's output (its completions carry only what is new:
        the DELTA or FINAL_ONLY output kinds); return the choices that changed with
        their delta (new text, new tokens' logprobs, finish)."""
        prompt_index = self.note_prompt(output)
        deltas = []
        for completion in output.outputs:
            index = prompt_index * self.n + completion.index
            choice = self.choices[index]
            if self.echo is not None and index not in self.echo_sent:
                self.echo_sent.add(index)
                text, logprobs = self.echoed[prompt_index]
                deltas.append((index, {"text": text, "logprobs": logprobs,
                                       "finish_reason": None, "stop_reason": None}))  # fmt: skip
            if self.echo is not None and self.echo.drop_generated:
                completion = _nothing_generated(completion)
            choice.text += completion.text
            choice.token_ids.extend(completion.token_ids)
            choice.logprobs.extend(completion.logprobs or [])
            finishing = completion.finish_reason is not None and choice.finish_reason is None
            choice.finish_reason, choice.stop_reason = (
                completion.finish_reason,
                completion.stop_reason,
            )
            if not completion.text and not finishing:
                continue
            end = len(choice.token_ids)
            delta = {
                "text": completion.text,
                "logprobs": self._logprobs(choice, choice.sent_tokens, end, choice.sent_offset),
                "finish_reason": choice.finish_reason if finishing else None,
                "stop_reason": choice.stop_reason if finishing else None,
            }
            if self.want_logprobs:
                choice.sent_offset += sum(
                    len(choice.logprobs[i][token].decoded_token or "")
                    for i, token in enumerate(choice.token_ids[choice.sent_tokens : end],
                                              choice.sent_tokens)
                )  # fmt: skip
            choice.sent_tokens = end
            deltas.append((index, delta))
        return deltas

    # -- shapes ----------------------------------------------------------------------

    def header(self, kind: str) -> dict[str, Any]:
        objects = {
            ("chunk", True): "chat.completion.chunk",
            ("final", True): "chat.completion",
            ("chunk", False): "text_completion",
            ("final", False): "text_completion",
        }
        return {
            "id": self.response_id,
            "object": objects[kind, self.chat],
            "created": self.created,
            "model": self.model,
        }

    def role_chunk(self, index: int) -> dict[str, Any]:
        choice = {
            "index": index,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }
        return {**self.header("chunk"), "choices": [choice]}

    def chunk(self, index: int, delta: dict[str, Any]) -> dict[str, Any] | None:
        """A stream chunk for a choice's delta (None: nothing to send yet: text held
        back because it may be a tool call)."""
        if self.chat:
            finish = delta["finish_reason"]
            state = self.choices[index]
            if self.tools is None and self.reasoning is None:
                message = {"content": delta["text"]} if delta["text"] else {}
            else:
                message = self._thinking_delta(state, finish is not None)
                if self.tools is None:
                    message.update(self._reply_delta(state, finish is not None))
                else:
                    message.update(self._tool_delta(state, finish is not None))
                if (message.get("tool_calls") or state.sent_arguments) and finish == "stop":
                    finish = "tool_calls"
                if not message and finish is None and delta["logprobs"] is None:
                    return None
            choice = {
                "index": index,
                "delta": message,
                "logprobs": delta["logprobs"],
                "finish_reason": finish,
                "stop_reason": delta["stop_reason"],  # vLLM's: the stop string or token hit
            }
        else:
            choice = {"index": index, **delta}
        return {**self.header("chunk"), "choices": [choice]}

    def _reply(self, choice: _Choice, finishing: bool) -> str:
        """The part of the answer that is the reply (after any thinking); while the
        answer grows, only as far as it cannot be taken back."""
        if self.reasoning is None:
            return choice.text
        parts = self.reasoning.parts(choice.text, final=finishing)
        return choice.text[parts.reply_start : parts.reply_end]

    def _thinking_delta(self, choice: _Choice, finishing: bool) -> dict[str, Any]:
        if self.reasoning is None:
            return {}
        parts = self.reasoning.parts(choice.text, final=finishing)
        thinking = choice.text[parts.thinking_start : parts.thinking_end]
        if len(thinking) <= choice.sent_thinking:
            return {}
        piece = thinking[choice.sent_thinking :]
        choice.sent_thinking = len(thinking)
        return {"reasoning_content": piece, "reasoning": piece}

    def _reply_delta(self, choice: _Choice, finishing: bool) -> dict[str, Any]:
        reply = self._reply(choice, finishing)
        if len(reply) <= choice.sent_content:
            return {}
        piece = reply[choice.sent_content :]
        choice.sent_content = len(reply)
        return {"content": piece}

    def _tool_delta(self, choice: _Choice, finishing: bool) -> dict[str, Any]:
        """The content that may go out now, and the calls' news: a new call's id and
        name, then its arguments as far as the model wrote them. Content stops where
        the first call starts: a call once sent stays a call (one cut short by
        max_tokens and not yet begun is never sent, as the whole answer leaves it out)."""
        reply = self._reply(choice, finishing)
        reading = self.tools.read(reply, finishing)
        deltas = []
        for index, call in enumerate(reading.calls):
            if index == len(choice.sent_arguments):
                if finishing and not call.complete:
                    break
                if not choice.sent_arguments:
                    choice.calls_from = reading.content_end
                choice.sent_arguments.append(len(call.arguments))
                deltas.append({"index": index, **self.tools.call(call.name, call.arguments)})
            elif len(call.arguments) > choice.sent_arguments[index]:
                piece = call.arguments[choice.sent_arguments[index] :]
                choice.sent_arguments[index] = len(call.arguments)
                deltas.append({"index": index, "function": {"arguments": piece}})
        end = reading.content_end
        if choice.sent_arguments:
            end = min(end, choice.calls_from)
        message: dict[str, Any] = {}
        if self.tools.choice == "auto" and end > choice.sent_content:
            message["content"] = reply[choice.sent_content : end]
            choice.sent_content = end
        if deltas:
            message["tool_calls"] = deltas
        return message

    def usage_chunk(self) -> dict[str, Any]:
        return {**self.header("chunk"), "choices": [], "usage": self.usage()}

    def final_response(self) -> dict[str, Any]:
        choices = []
        for index, choice in enumerate(self.choices):
            base = len(self.echoed[index // self.n][0]) if self.echo is not None else 0
            logprobs = self._logprobs(choice, 0, len(choice.token_ids), base)
            if self.chat:
                thinking, reply = None, choice.text
                if self.reasoning is not None:
                    thinking, reply = self.reasoning.split(choice.text)
                message: dict[str, Any] = {"role": "assistant", "content": reply}
                finish = choice.finish_reason
                if self.tools is not None:
                    content, calls = self.tools.parse(reply)
                    if calls:
                        message = {"role": "assistant", "content": content, "tool_calls": calls}
                        finish = "tool_calls" if finish == "stop" else finish
                if thinking is not None:
                    message["reasoning_content"] = message["reasoning"] = thinking
                choices.append(
                    {
                        "index": index,
                        "message": message,
                        "logprobs": logprobs,
                        "finish_reason": finish,
                        "stop_reason": choice.stop_reason,  # as vLLM's chat choices
                    }
                )
            else:
                text = choice.text
                if self.echo is not None:
                    echoed_text, echoed_logprobs = self.echoed[index // self.n]
                    text = echoed_text + text
                    logprobs = _joined(echoed_logprobs, logprobs)
                choices.append(
                    {
                        "index": index,
                        "text": text,
                        "logprobs": logprobs,
                        "finish_reason": choice.finish_reason,
                        "stop_reason": choice.stop_reason,
                    }
                )
        return {**self.header("final"), "choices": choices, "usage": self.usage()}

    def usage(self) -> dict[str, Any]:
        prompt = sum(self.prompt_tokens)
        completion = sum(len(c.token_ids) for c in self.choices)
        usage = {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(self.cached_tokens)},
        }
        if self.reasoning is not None:
            counts = [self._thinking_tokens(choice) for choice in self.choices]
            if None not in counts:
                usage["completion_tokens_details"] = {"reasoning_tokens": sum(counts)}
        return usage

    def _thinking_tokens(self, choice: _Choice) -> int | None:
        """A choice's thinking tokens so far (counted once, when its thinking ended)."""
        if choice.thinking_tokens is not None:
            return choice.thinking_tokens
        count = self.reasoning.thinking_tokens(choice.token_ids, choice.text)
        if count is not None and count < len(choice.token_ids):  # the end is written
            choice.thinking_tokens = count
        return count

    def _logprobs(self, choice: _Choice, start: int, end: int, offset: int = 0):
        """Logprobs of tokens [start, end) in OpenAI's shape; ``offset``: where token
        ``start`` begins in the text (the decoded tokens before it, end to end)."""
        if not self.want_logprobs:
            return None
        tokens = [
            (token_id, choice.logprobs[i])
            for i, token_id in enumerate(choice.token_ids[start:end], start)
        ]
        if self.chat:
            return {"content": [_chat_logprob(token_id, entry) for token_id, entry in tokens]}
        result: dict[str, list] = {
            "tokens": [],
            "token_logprobs": [],
            "top_logprobs": [],
            "text_offset": [],
        }
        for token_id, entry in tokens:
            chosen = entry[token_id]
            text = chosen.decoded_token or ""
            result["tokens"].append(text)
            result["token_logprobs"].append(_finite(chosen.logprob))
            result["top_logprobs"].append(
                {(e.decoded_token or ""): _finite(e.logprob) for e in entry.values()}
            )
            result["text_offset"].append(offset)
            offset += len(text)
        return result


def _nothing_generated(completion):
    """The completion without its tokens (echo with max_tokens 0), keeping its finish."""
    return dataclasses.replace(
        completion, text="", token_ids=[], logprobs=[] if completion.logprobs is not None else None
    )


def _joined(first: dict[str, list] | None, second: dict[str, list] | None):
    if first is None or second is None:
        return first or second
    return {key: first[key] + second[key] for key in first}


def _finite(value: float) -> float:
    return value if math.isfinite(value) else MIN_LOGPROB


def _chat_logprob(token_id: int, entry: dict[int, Logprob]) -> dict[str, Any]:
    def shaped(logprob: Logprob) -> dict[str, Any]:
        text = logprob.decoded_token or ""
        return {"token": text, "logprob": _finite(logprob.logprob), "bytes": list(text.encode())}

    ranked = sorted((e for e in entry.values() if e.rank is not None), key=lambda e: e.rank)
    return {**shaped(entry[token_id]), "top_logprobs": [shaped(e) for e in ranked]}
