"""One streamed request to an OpenAI-compatible server, timed the way vLLM times it.

TTFT is the time from sending to the first chunk that carries generated text (a chat
stream's opening role chunk carries none: it is sent before any token exists); each
later such chunk adds an inter-token latency (the gap since the previous one); E2EL
ends at ``[DONE]``. The output token count comes from the final usage chunk
(``stream_options.include_usage``), else from the number of content chunks. Any
failure (a status other than 200, an error frame, a broken connection, a timeout) is
recorded with its message, never dropped.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

import httpx

from tandem.bench.datasets import BenchRequest


@dataclass
class RequestResult:
    success: bool = False
    error: str = ""
    start_time: float = 0.0  # seconds since the benchmark started
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    e2el: float = 0.0
    prompt_len: int = 0
    output_len: int = 0
    cached_tokens: int = 0  # usage.prompt_tokens_details.cached_tokens, where reported

    @property
    def tpot(self) -> float | None:
        if self.output_len < 2:
            return None
        return (self.e2el - self.ttft) / (self.output_len - 1)


@dataclass
class RequestSettings:
    base_url: str
    model: str
    endpoint: str  # "completions" | "chat"
    headers: dict[str, str]
    temperature: float = 0.0
    ignore_eos: bool = False
    timeout: float = 600.0


def request_body(request: BenchRequest, settings: RequestSettings, text: str | None) -> dict:
    body = {
        "model": settings.model,
        "temperature": settings.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if settings.ignore_eos:
        body["ignore_eos"] = True
    if settings.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": text}]
        body["max_completion_tokens"] = request.output_len
    else:
        prompt = request.prompt_token_ids if request.prompt_token_ids is not None else text
        body["prompt"] = prompt
        body["max_tokens"] = request.output_len
    return body


async def send_request(
    http: httpx.AsyncClient,
    request: BenchRequest,
    settings: RequestSettings,
    text: str | None,
    benchmark_start: float,
) -> RequestResult:
    path = "/v1/chat/completions" if settings.endpoint == "chat" else "/v1/completions"
    result = RequestResult(prompt_len=request.prompt_len or 0)
    started = time.perf_counter()
    result.start_time = started - benchmark_start
    last = started
    num_chunks = 0
    usage = None
    try:
        async with http.stream(
            "POST", path, json=request_body(request, settings, text), timeout=settings.timeout
        ) as response:
            if response.status_code != 200:
                body = (await response.aread()).decode(errors="replace")
                result.error = f"HTTP {response.status_code}: {body[:300]}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line.removeprefix("data:").strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    result.error = f"error frame: {chunk['error'].get('message', chunk)}"
                    return result
                now = time.perf_counter()
                if chunk.get("usage"):
                    usage = chunk["usage"]
                choices = chunk.get("choices") or []
                if not choices:
                    continue
                piece = _text_of(choices[0])
                if not piece and choices[0].get("finish_reason") is None:
                    continue  # a chat role chunk, sent before any token exists
                if num_chunks == 0:
                    result.ttft = now - started
                else:
                    result.itl.append(now - last)
                num_chunks += 1
                last = now
        result.e2el = time.perf_counter() - started
    except (httpx.HTTPError, json.JSONDecodeError, OSError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
        return result
    if num_chunks == 0:
        result.error = "the stream ended without a token"
        return result
    if usage is not None:
        result.output_len = usage.get("completion_tokens", 0)
        result.prompt_len = usage.get("prompt_tokens", result.prompt_len)
        details = usage.get("prompt_tokens_details") or {}
        result.cached_tokens = details.get("cached_tokens") or 0
    else:
        result.output_len = num_chunks
    result.success = True
    return result


def _text_of(choice: dict) -> str:
    if "delta" in choice:  # chat
        return choice["delta"].get("content") or ""
    return choice.get("text") or ""
