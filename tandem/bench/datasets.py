"""Benchmark prompts: ``random`` (lengths in tokens, exact), ``prefix-repetition``
(N shared prefixes with unique suffixes) and ``jsonl`` (a file of prompts).

Token ids come from real text (this interpreter's standard library sources) run
through the server's tokenizer (``/tokenize``) or a local ``tokenizer.json``, so that
prompts look like text to the model and their lengths are exact in the server's
tokens. Completions send the token ids themselves; chat sends their decoded text.
"""

from __future__ import annotations

import json
import random
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import httpx

from tandem.errors import TandemError


@dataclass
class BenchRequest:
    prompt_token_ids: list[int] | None  # exact prompts (random, prefix-repetition)
    prompt_text: str | None  # text prompts (jsonl) and chat
    prompt_len: int | None  # known before sending; else read from usage
    output_len: int


class TokenizerLike(Protocol):
    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class ServerTokenizer:
    """The server's own tokenizer through ``POST /tokenize`` and ``/detokenize``."""

    def __init__(self, base_url: str, model: str, headers: dict[str, str]) -> None:
        self.http = httpx.Client(base_url=base_url, headers=headers, timeout=60)
        self.model = model

    def encode(self, text: str) -> list[int]:
        body = {"model": self.model, "prompt": text, "add_special_tokens": False}
        response = self.http.post("/tokenize", json=body)
        if response.status_code != 200:
            raise TandemError(
                f"POST /tokenize failed ({response.status_code}): {response.text[:200]}; "
                "pass --tokenizer DIR to tokenize locally"
            )
        return response.json()["tokens"]

    def decode(self, ids: list[int]) -> str:
        response = self.http.post("/detokenize", json={"model": self.model, "tokens": ids})
        response.raise_for_status()
        return response.json()["prompt"]


class LocalTokenizer:
    """A ``tokenizer.json`` in a local folder (the model's own)."""

    def __init__(self, folder: str) -> None:
        from tokenizers import Tokenizer

        path = Path(folder) / "tokenizer.json"
        try:
            self.tokenizer = Tokenizer.from_file(str(path))
        except Exception as exc:  # tokenizers raises a bare Exception for a bad file
            raise TandemError(f"--tokenizer: cannot read {path}: {exc}") from None

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)


def token_pool(tokenizer: TokenizerLike, num_tokens: int, seed: int) -> list[int]:
    """At least ``num_tokens`` token ids of real text: stdlib modules in a seeded order."""
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    random.Random(seed).shuffle(files)
    pool: list[int] = []
    for path in files:
        pool += tokenizer.encode(path.read_text(encoding="utf-8", errors="replace")[:20000])
        if len(pool) >= num_tokens:
            return pool
    raise TandemError(f"the stdlib gave only {len(pool)} tokens; {num_tokens} needed")


def _window(pool: list[int], length: int, rng: random.Random) -> list[int]:
    start = rng.randrange(0, len(pool) - length)
    return pool[start : start + length]


def _length(mean: int, range_ratio: float, rng: random.Random) -> int:
    """Uniform in [mean * (1 - r), mean * (1 + r)], at least 1 (vLLM's range ratio)."""
    low, high = round(mean * (1 - range_ratio)), round(mean * (1 + range_ratio))
    return max(1, rng.randint(low, high))


def random_requests(
    tokenizer: TokenizerLike,
    num_prompts: int,
    input_len: int,
    output_len: int,
    range_ratio: float,
    seed: int,
) -> list[BenchRequest]:
    rng = random.Random(seed)
    pool = token_pool(tokenizer, 2 * round(input_len * (1 + range_ratio)) + 1024, seed)
    requests = []
    for _ in range(num_prompts):
        ids = _window(pool, _length(input_len, range_ratio, rng), rng)
        requests.append(BenchRequest(ids, None, len(ids), _length(output_len, range_ratio, rng)))
    return requests


def prefix_repetition_requests(
    tokenizer: TokenizerLike,
    num_prompts: int,
    prefix_len: int,
    suffix_len: int,
    num_prefixes: int,
    output_len: int,
    seed: int,
) -> list[BenchRequest]:
    """``num_prompts`` prompts, each one of ``num_prefixes`` shared prefixes followed by
    a suffix of its own, in a shuffled order (so that reuse is not only back to back)."""
    rng = random.Random(seed)
    pool = token_pool(tokenizer, 4 * (prefix_len + suffix_len) + 1024, seed)
    prefixes = [_window(pool, prefix_len, rng) for _ in range(num_prefixes)]
    requests = []
    for index in range(num_prompts):
        ids = prefixes[index % num_prefixes] + _window(pool, suffix_len, rng)
        requests.append(BenchRequest(ids, None, len(ids), output_len))
    rng.shuffle(requests)
    return requests


def jsonl_requests(path: str, num_prompts: int, output_len: int) -> list[BenchRequest]:
    """Lines of ``{"prompt": "..." or [token ids], "output_len": 128}`` (output_len
    optional), sent in file order; the file is cycled if it holds fewer than
    ``num_prompts``."""
    requests = []
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                prompt = record["prompt"]
            except (json.JSONDecodeError, KeyError, TypeError) as exc:
                raise TandemError(f"{path}:{number}: expected {{'prompt': ...}} ({exc})") from exc
            length = int(record.get("output_len", output_len))
            if isinstance(prompt, list):
                requests.append(BenchRequest(prompt, None, len(prompt), length))
            else:
                requests.append(BenchRequest(None, prompt, None, length))
    if not requests:
        raise TandemError(f"{path} holds no prompts")
    return [requests[i % len(requests)] for i in range(num_prompts)]
