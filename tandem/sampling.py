"""SamplingParams: the user's knobs for one request, with vLLM's names and meanings.

Every value is validated when the object is made, so a bad value is an error naming
the field before anything is queued.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from dataclasses import dataclass, field

from tandem.errors import InvalidParameterError

MAX_LOGPROBS = 20


class RequestOutputKind(enum.Enum):
    """What each RequestOutput of a request carries (vLLM's names)."""

    CUMULATIVE = 0  # everything so far, every step it advances
    DELTA = 1  # only what is new since its previous output (streaming)
    FINAL_ONLY = 2  # one output, when it finishes (batch generation)


@dataclass
class StructuredOutputsParams:
    """A constraint on the text generated (vLLM's names): exactly one of a JSON schema
    (``json``, as a dict or its JSON text), any JSON object (``json_object``), a
    regular expression, a list of literal choices, or a grammar (Lark, or llama.cpp's
    GBNF). tandem/engine/grammar.py turns it into token masks."""

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    # The request field it came from (response_format, guided_json...): errors name it.
    source: str = field(default="structured_outputs", compare=False)
    # Finish the grammar within max_tokens: near the budget the runner writes a short
    # way to its end (runner/grammar_closing.py). Required and named tool calls set it.
    close_in_budget: bool = False

    def __post_init__(self) -> None:
        given = [name for name in STRUCTURED_FIELDS if getattr(self, name) not in (None, False)]
        if len(given) != 1:
            raise InvalidParameterError(
                self.source,
                f"give exactly one of {', '.join(STRUCTURED_FIELDS)} (got {given or 'none'})",
            )
        if self.choice is not None and (
            not self.choice or any(not isinstance(c, str) or not c for c in self.choice)
        ):
            raise InvalidParameterError(
                self.source, "choice must be a non-empty list of non-empty strings"
            )
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise InvalidParameterError(self.source, f"{name} must be a non-empty string")

    def constraint(self) -> tuple[str, object]:
        """(the field given, its value)."""
        name = next(n for n in STRUCTURED_FIELDS if getattr(self, n) not in (None, False))
        return name, getattr(self, name)


STRUCTURED_FIELDS = ("json", "regex", "choice", "grammar", "json_object")


POOLING_TYPES = ("last", "mean", "cls", "classify")


@dataclass
class PoolingParams:
    """A request for a vector of its prompt instead of tokens (an embedding): the final
    hidden states pooled, as the model was trained to be read (``last``: the last
    token's, decoders such as Qwen3-Embedding; ``mean``: the average over the prompt;
    ``cls``: the first token's), cut to its first ``dimensions`` values (models
    trained for such truncation), and scaled to length 1 when ``normalize``. It runs
    its prompt through the same scheduler and batches as generation, and samples
    nothing.

    ``classify``: a model with a classification head (a cross-encoder reranker) reads
    its first token's row through the head: the vector is the head's scores, through
    sigmoid (one label) or softmax (several) when ``normalize``, as sentence-
    transformers' CrossEncoder gives them. ``second_segment``: where the prompt's
    second text starts (a (query, document) pair as the tokenizer joins them; an
    encoder's token types); the input processor sets it from a ``prompt_pair``."""

    pooling: str = "last"
    normalize: bool = True
    dimensions: int | None = None
    second_segment: int | None = None

    def __post_init__(self) -> None:
        if self.pooling not in POOLING_TYPES:
            raise InvalidParameterError("pooling", f"must be one of {', '.join(POOLING_TYPES)}")
        if self.dimensions is not None and (
            type(self.dimensions) is not int or self.dimensions < 1
        ):
            raise InvalidParameterError(
                "dimensions", f"must be an integer >= 1, got {self.dimensions!r}"
            )
        second = self.second_segment
        if second is not None and (type(second) is not int or second < 1):
            raise InvalidParameterError(
                "second_segment", f"must be a token index >= 1, got {second!r}"
            )


@dataclass
class ThinkingParams:
    """A thinking model's answer, which starts inside its thinking (the prompt opened
    it) and leaves it with ``end_token_ids`` (``</think>`` as the tokenizer writes it).

    ``budget``: how many thinking tokens it may write; at the budget the end is forced,
    a token at a time, and the answer follows (the engine enforces it: the runner's
    ThinkingGate). A structured-output constraint holds the answer only: it starts
    after the end."""

    end_token_ids: tuple[int, ...]
    budget: int | None = None

    def __post_init__(self) -> None:
        ids = self.end_token_ids
        if not ids or any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in ids):
            raise InvalidParameterError("thinking", "end_token_ids must be token ids (>= 0)")
        self.end_token_ids = tuple(ids)
        budget = self.budget
        valid = budget is None or (type(budget) is int and budget >= 0)
        if not valid:
            message = f"must be an integer >= 0, got {budget!r}"
            raise InvalidParameterError("thinking_budget", message)


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: until the context is full
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None  # top-k logprobs per generated token (plus the chosen one)
    # top-k logprobs per prompt token (plus the prompt's own; the first has none). Such a
    # request computes its whole prompt (it skips the prefix cache).
    prompt_logprobs: int | None = None
    # token id -> a value added to its logit before sampling (OpenAI's logit_bias;
    # -100 bans a token, +100 all but forces it). The logprobs stay the raw model's.
    logit_bias: dict[int, float] | None = None
    # Generation held to a JSON schema, regex, choice or grammar (tandem/engine/grammar.py).
    structured_outputs: StructuredOutputsParams | None = None
    # A thinking model's thinking: where it ends, and its budget (ThinkingParams).
    thinking: ThinkingParams | None = None
    # An embedding request: the prompt's vector instead of tokens (PoolingParams).
    pooling: PoolingParams | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    stop_strings: tuple[str, ...] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        def bad(param: str, message: str) -> InvalidParameterError:
            return InvalidParameterError(param, message)

        if not isinstance(self.n, int) or self.n < 1:
            raise bad("n", f"must be an integer >= 1, got {self.n!r}")
        # NaN passes every comparison below as False and Infinity poisons the logits:
        # every float setting must be a finite number first.
        for name in FLOAT_FIELDS:
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value):
                raise bad(name, f"must be a finite number, got {value!r}")
        if self.temperature < 0:
            raise bad("temperature", f"must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise bad("top_p", f"must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise bad("top_k", f"must be -1, 0 (off) or a positive integer, got {self.top_k!r}")
        if not 0 <= self.min_p <= 1:
            raise bad("min_p", f"must be in [0, 1], got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2 <= value <= 2:
                raise bad(name, f"must be in [-2, 2], got {value}")
        if self.repetition_penalty <= 0:
            raise bad("repetition_penalty", f"must be > 0, got {self.repetition_penalty}")
        if self.max_tokens is not None and (
            not isinstance(self.max_tokens, int) or self.max_tokens < 1
        ):
            raise bad("max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise bad("min_tokens", f"must be an integer >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"({self.min_tokens}) must not exceed max_tokens")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (
                not isinstance(value, int) or isinstance(value, bool)
                or not 0 <= value <= MAX_LOGPROBS
            ):  # fmt: skip
                raise bad(name, f"must be an integer in [0, {MAX_LOGPROBS}], got {value!r}")
        if self.seed is not None and not isinstance(self.seed, int):
            raise bad("seed", f"must be an integer, got {self.seed!r}")
        # A generator takes a 64-bit seed; sample i of n uses seed + i.
        if self.seed is not None and not SEED_MIN <= self.seed <= SEED_MAX - (self.n - 1):
            raise bad(
                "seed", f"must be in [{SEED_MIN}, {SEED_MAX - (self.n - 1)}] for n = {self.n}"
            )
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if any(not isinstance(s, str) or not s for s in stop):
            raise bad("stop", "must be non-empty strings")
        self.stop_strings = tuple(stop)
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids or []):
            raise bad("stop_token_ids", "must be non-negative integers")
        for token, bias in (self.logit_bias or {}).items():
            if isinstance(token, bool) or not isinstance(token, int) or token < 0:
                raise bad("logit_bias", f"keys must be token ids (integers >= 0), got {token!r}")
            valid = isinstance(bias, (int, float)) and not isinstance(bias, bool)
            if not valid or not math.isfinite(bias) or not -100 <= bias <= 100:
                raise bad("logit_bias", f"values must be numbers in [-100, 100], got {bias!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def for_child(self, index: int) -> SamplingParams:
        """The params of sample ``index`` of an n > 1 request: one sample each, and
        distinct seeds so that the samples differ but stay reproducible."""
        seed = None if self.seed is None else self.seed + index
        return dataclasses.replace(self, n=1, seed=seed)


FLOAT_FIELDS = (
    "temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
    "repetition_penalty",
)  # fmt: skip
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1  # what torch.Generator.manual_seed accepts

# generation_config.json keys that set a model's recommended sampling, and the
# SamplingParams field each one fills (the keys vLLM reads for the same purpose).
GENERATION_CONFIG_KEYS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}


def model_sampling_defaults(generation_config: dict) -> dict:
    """The sampling settings a model folder recommends, as SamplingParams fields.

    ``do_sample: false`` means greedy, as in transformers (vLLM ignores that key and
    keeps temperature 1.0; tandem follows the model's author)."""
    defaults = {
        field_name: generation_config[key]
        for key, field_name in GENERATION_CONFIG_KEYS.items()
        if generation_config.get(key) is not None
    }
    if generation_config.get("do_sample") is False:
        defaults["temperature"] = 0.0
    return defaults


def model_pooling_defaults(pooling_config: dict) -> PoolingParams:
    """How a model's embeddings are read when a request does not say: its folder's
    sentence-transformers settings, else the last token, normalised (decoder
    embedding models such as Qwen3-Embedding)."""
    return PoolingParams(
        **{k: v for k, v in pooling_config.items() if k in ("pooling", "normalize")}
    )
