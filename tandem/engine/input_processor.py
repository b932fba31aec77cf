"""InputProcessor: a user's prompt and parameters -> a validated, typed EngineRequest.

Everything a request can be refused for is checked here, before it crosses a thread
or a process: the prompt's form and token ids (within the vocabulary), its length
against the context, max_tokens against the context and the KV capacity, the prefix
cache salt, and the disaggregation parameters (parsed once into KVTransferParams).
``LLM``, the server and the CLI all go through it, so the HTTP and Python APIs refuse
exactly the same things with the same messages; a refused request leaves nothing
behind.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tandem.engine import clock
from tandem.engine.kv_transfer_params import KVTransferParams
from tandem.errors import InvalidParameterError, require_unicode
from tandem.sampling import SamplingParams

if TYPE_CHECKING:
    from tandem.models.tokenizer import Tokenizer
    from tandem.step import RunnerInfo

PromptInput = str | list[int] | dict[str, Any]


@dataclass(frozen=True)
class EngineRequest:
    """A request that passed validation: what the engine core needs, as plain data."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams  # max_tokens resolved (never None)
    arrival_time: float
    cache_salt: str | None = None
    kv_transfer: KVTransferParams | None = None
    grammar: str | None = None  # structured outputs: the compiled constraint (grammar.py)


class InputProcessor:
    def __init__(
        self,
        tokenizer: Tokenizer | None,
        vocab_size: int,
        max_model_len: int,
        block_size: int,
        num_blocks: int,
        hidden_size: int = 0,
        generates: bool = True,
        num_labels: int = 0,
    ) -> None:
        """``hidden_size``: the width of an embedding (0: not known, not checked);
        ``generates``: False for a model that makes vectors only (an encoder, a
        decoder with a score head); ``num_labels``: its classification head's outputs
        (0: none, it cannot score pairs)."""
        self.hidden_size = hidden_size
        self.generates = generates
        self.num_labels = num_labels
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.num_blocks = num_blocks

    @classmethod
    def of(cls, info: RunnerInfo) -> InputProcessor:
        """The input processor for the model a runner describes."""
        return cls(
            info.tokenizer, info.vocab_size, info.max_model_len, info.block_size,
            info.num_blocks, info.hidden_size, info.generates, info.num_labels,
        )  # fmt: skip

    def process(
        self,
        request_id: str,
        prompt: PromptInput,
        params: SamplingParams,
        arrival_time: float | None = None,
        kv_transfer_params: dict[str, Any] | None = None,
    ) -> EngineRequest:
        """Validate and normalise; raise InvalidParameterError naming the field.
        ``prompt`` may be ``{"prompt": a, "prompt_pair": b}``: two texts a scoring
        request reads together (a cross-encoder's query and document)."""
        if isinstance(prompt, dict) and "prompt_pair" in prompt:
            text, prompt_ids, params = self._pair(prompt, params)
        else:
            text, prompt_ids = self.tokenize(prompt)
        max_tokens = self._validate(prompt_ids, params)
        if max_tokens != params.max_tokens:
            params = dataclasses.replace(params, max_tokens=max_tokens)
        cache_salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
        if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
            raise InvalidParameterError("cache_salt", "must be a non-empty string")
        transfer = None
        if kv_transfer_params:
            transfer = KVTransferParams.parse(kv_transfer_params, len(prompt_ids), self.block_size)
            if transfer.do_remote_decode and params.n != 1:
                raise InvalidParameterError("n", "a request decoded remotely takes n = 1")
        return EngineRequest(
            request_id,
            text,
            prompt_ids,
            params,
            arrival_time or clock.now(),
            cache_salt,
            transfer,
            self._grammar(params),
        )

    def _grammar(self, params: SamplingParams) -> str | None:
        """A structured-output constraint compiled (a 400 if the library cannot)."""
        if params.structured_outputs is None:
            return None
        if self.tokenizer is None:
            raise InvalidParameterError(
                "structured_outputs", "needs a model with a tokenizer (grammars are text)"
            )
        from tandem.engine.grammar import grammar_for

        return grammar_for(params.structured_outputs)

    def tokenize(self, prompt: PromptInput) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                ids = prompt["prompt_token_ids"]
                if not isinstance(ids, list) or not all(isinstance(t, int) for t in ids):
                    raise InvalidParameterError("prompt_token_ids", "must be a list of integers")
                return prompt.get("prompt"), list(ids)
            prompt = prompt.get("prompt")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidParameterError(
                    "prompt", "this model has no tokenizer; pass prompt_token_ids"
                )
            require_unicode(prompt, "prompt")
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return None, list(prompt)
        raise InvalidParameterError(
            "prompt", "must be a string, a list of token ids or {'prompt_token_ids': [...]}"
        )

    def _pair(
        self, prompt: dict[str, Any], params: SamplingParams
    ) -> tuple[str, list[int], SamplingParams]:
        """Two texts as one prompt, joined by the tokenizer; the pooling told where
        the second starts."""
        first, second = prompt.get("prompt"), prompt["prompt_pair"]
        if params.pooling is None:
            raise InvalidParameterError("prompt_pair", "only a scoring request reads a pair")
        for name, value in (("prompt", first), ("prompt_pair", second)):
            if not isinstance(value, str):
                raise InvalidParameterError(name, "must be a string")
            require_unicode(value, name)
        if self.tokenizer is None:
            raise InvalidParameterError("prompt_pair", "this model has no tokenizer")
        ids, second_at = self.tokenizer.encode_pair(first, second)
        pooling = dataclasses.replace(params.pooling, second_segment=second_at)
        return first, ids, dataclasses.replace(params, pooling=pooling)

    def _validate_pooling(self, prompt_ids: list[int], params: SamplingParams) -> int:
        """An embedding request: its prompt within the context, its dimensions within
        the model's; it generates nothing (max_tokens is 1: the step that pools)."""
        if params.n != 1:
            raise InvalidParameterError("n", "an embedding request has one result")
        pooling = params.pooling
        if pooling.pooling == "classify" and not self.num_labels:
            raise InvalidParameterError(
                "pooling", "this model has no classification head: it embeds, it does not score"
            )
        if pooling.second_segment is not None and pooling.second_segment >= len(prompt_ids):
            raise InvalidParameterError(
                "second_segment", f"must be inside the prompt of {len(prompt_ids)} tokens"
            )
        if len(prompt_ids) > self.max_model_len:
            raise InvalidParameterError(
                "input", f"is {len(prompt_ids)} tokens; the context is {self.max_model_len}"
            )
        dimensions = params.pooling.dimensions
        if dimensions is not None and self.hidden_size and dimensions > self.hidden_size:
            raise InvalidParameterError(
                "dimensions", f"is {dimensions}; this model's embeddings have {self.hidden_size}"
            )
        self._check_blocks(len(prompt_ids), "input")
        return 1

    def _validate(self, prompt_ids: list[int], params: SamplingParams) -> int:
        """Check the prompt and the token budget; returns max_tokens resolved."""
        if not prompt_ids:
            raise InvalidParameterError("prompt", "is empty")
        vocab = self.vocab_size
        if any(t < 0 or t >= vocab for t in prompt_ids):
            raise InvalidParameterError("prompt", f"token ids must be in [0, {vocab})")
        # They index the logits (banned below min_tokens): one out of range would fail
        # the whole batch's sampling step, not just this request.
        if any(t >= vocab for t in params.stop_token_ids or ()):
            raise InvalidParameterError("stop_token_ids", f"token ids must be in [0, {vocab})")
        if any(t >= vocab for t in params.logit_bias or ()):
            raise InvalidParameterError("logit_bias", f"keys must be token ids in [0, {vocab})")
        if params.thinking is not None and max(params.thinking.end_token_ids) >= vocab:
            raise InvalidParameterError("thinking", f"end_token_ids must be in [0, {vocab})")
        if params.pooling is not None:
            return self._validate_pooling(prompt_ids, params)
        if not self.generates:
            raise InvalidParameterError(
                "model", "this model makes embeddings and scores (an encoder or a classifier), "
                "not text",
            )  # fmt: skip
        room = self.max_model_len - len(prompt_ids)
        if room < 1:
            raise InvalidParameterError(
                "prompt",
                f"is {len(prompt_ids)} tokens; the context (max_model_len) is "
                f"{self.max_model_len}, leaving no room to generate",
            )
        max_tokens = params.max_tokens if params.max_tokens is not None else room
        if max_tokens > room:
            raise InvalidParameterError(
                "max_tokens",
                f"prompt ({len(prompt_ids)} tokens) + max_tokens ({max_tokens}) exceeds "
                f"max_model_len ({self.max_model_len})",
            )
        self._check_blocks(len(prompt_ids) + max_tokens, "max_tokens")
        return max_tokens

    def _check_blocks(self, tokens: int, param: str) -> None:
        needed = -(-tokens // self.block_size)
        if needed > self.num_blocks:
            raise InvalidParameterError(
                param,
                f"the request needs {needed} KV blocks but the cache has only "
                f"{self.num_blocks}; raise num_blocks or kv_cache_memory",
            )
