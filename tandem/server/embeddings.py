"""Embeddings, scores and reranking: the routes a retrieval app calls first, in the
shapes OpenAI (``/v1/embeddings``), vLLM (``/v1/score``) and Jina / Cohere
(``/v1/rerank``) serve them. Each input is a prompt-only request (SamplingParams
.pooling) through the same engine and scheduler as generation. A score is, with a
cross-encoder (a model with a classification head: BERT / XLM-RoBERTa rerankers),
the head's relevance of the two texts read together as one prompt; with an embedding
model (a bi-encoder), the cosine similarity of the two texts' normalised embeddings.

    EmbeddingRequest  input: a string, strings, token ids, or lists of token ids;
                      encoding_format float or base64 (little-endian float32, as
                      OpenAI's SDK decodes it); dimensions (the first values, for
                      models trained to be cut); usage counts the prompt tokens
    ScoreRequest      text_1 against each text_2 (or pairwise, lists of one length)
    RerankRequest     query against documents, best first, top_n of them
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import struct
import time
import uuid
from typing import Any, Literal

from fastapi import Request
from pydantic import Field

from tandem.errors import InvalidParameterError, require_unicode
from tandem.outputs import RequestOutput, relevance, similarity
from tandem.sampling import RequestOutputKind, SamplingParams, model_pooling_defaults
from tandem.server.handlers import add_requests, engine_prompt, next_outputs, until_disconnect
from tandem.server.protocol import INT_LIMIT, TokenId, _Body


class EmbeddingRequest(_Body):
    model: str | None = None
    input: str | list[str] | list[TokenId] | list[list[TokenId]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1, le=INT_LIMIT)
    normalize: bool | None = None  # vLLM's: the model's own setting when unset
    user: str | None = None

    def inputs(self) -> list[str | list[int]]:
        value = self.input
        if isinstance(value, str) or (value and isinstance(value[0], int)):
            value = [value]
        if not value:
            raise InvalidParameterError("input", "is empty")
        for index, item in enumerate(value):
            if not item:
                raise InvalidParameterError(f"input[{index}]", "is empty")
            if isinstance(item, str):
                require_unicode(item, f"input[{index}]")
        return list(value)


class ScoreRequest(_Body):
    model: str | None = None
    text_1: str | list[str]
    text_2: str | list[str]


class RerankRequest(_Body):
    model: str | None = None
    query: str
    documents: list[str] = Field(min_length=1)
    top_n: int | None = Field(None, ge=1, le=INT_LIMIT)
    return_documents: bool = True


async def embed(
    state, texts: list[str | list[int] | dict], request: Request, field: str = "input",
    **pooling: Any,
):  # fmt: skip
    """Each input's RequestOutput (its ``pooled`` vector), in order; ``pooling``
    overrides the model's PoolingParams. An input is a text, token ids, or an engine
    prompt (a pair); more than the server's limit is a 400 naming ``field``. A client
    that goes away aborts them all."""
    limit = state.limits.max_inputs
    if len(texts) > limit:
        raise InvalidParameterError(field, f"holds {len(texts)} inputs; at most {limit}")
    defaults = model_pooling_defaults(state.engine.info.pooling_config)
    pooling = dataclasses.replace(defaults, **{k: v for k, v in pooling.items() if v is not None})
    params = SamplingParams(max_tokens=1, pooling=pooling,
                            output_kind=RequestOutputKind.FINAL_ONLY)  # fmt: skip
    prefix = f"embd-{uuid.uuid4().hex}"
    ids = [f"{prefix}-{i}" for i in range(len(texts))]
    outputs: asyncio.Queue = asyncio.Queue()
    prompts = [text if isinstance(text, dict) else engine_prompt(text, None) for text in texts]
    await add_requests(state.engine, ids, prompts, params, outputs)

    async def gathered() -> list[RequestOutput]:
        done: dict[str, RequestOutput] = {}
        async for item in next_outputs(state.engine, outputs, ids):
            if item.finished:
                if item.error is not None or item.pooled is None:
                    raise RuntimeError(f"an input could not be embedded: {item.error}")
                done[item.request_id] = item
        return [done[engine_id] for engine_id in ids]

    return await until_disconnect(request, gathered())


def _encoded(vector: list[float], encoding: str) -> list[float] | str:
    if encoding == "float":
        return vector
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()


def embeddings_response(model: str, outputs: list[RequestOutput], encoding: str) -> dict:
    tokens = sum(len(o.prompt_token_ids) for o in outputs)
    return {
        "object": "list", "model": model,
        "data": [{"object": "embedding", "index": i, "embedding": _encoded(o.pooled, encoding)}
                 for i, o in enumerate(outputs)],
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }  # fmt: skip


def score_pairs(body: ScoreRequest) -> list[tuple[str, str]]:
    """The (left, right) texts to score: text_1 against each text_2, or pairwise when
    both are lists of one length."""
    left = [body.text_1] if isinstance(body.text_1, str) else body.text_1
    right = [body.text_2] if isinstance(body.text_2, str) else body.text_2
    if not left or not right:
        raise InvalidParameterError("text_1" if not left else "text_2", "is empty")
    if len(left) != 1 and len(left) != len(right):
        raise InvalidParameterError("text_1", "holds one text, or as many as text_2")
    return [(left[0 if len(left) == 1 else i], text) for i, text in enumerate(right)]


async def pair_scores(state, pairs: list[tuple[str, str]], request: Request, field: str):
    """Each pair's score and the prompt tokens read: a cross-encoder reads each pair
    as one prompt; an embedding model embeds each distinct text once and compares.
    (A response instead when the client went away.) ``field``: what a 400 for too
    many pairs names."""
    limit = state.limits.max_inputs
    if len(pairs) > limit:  # (repeated texts too: each pair is scored)
        raise InvalidParameterError(field, f"holds {len(pairs)} texts to score; at most {limit}")
    if state.engine.info.num_labels:
        prompts = [{"prompt": left, "prompt_pair": right} for left, right in pairs]
        outputs = await embed(state, prompts, request, field, pooling="classify", normalize=True)
        if not isinstance(outputs, list):
            return outputs
        return [relevance(o.pooled) for o in outputs], _prompt_tokens(outputs)
    texts = list(dict.fromkeys(text for pair in pairs for text in pair))
    outputs = await embed(state, texts, request, field, normalize=True)
    if not isinstance(outputs, list):
        return outputs
    vector = {text: output.pooled for text, output in zip(texts, outputs, strict=True)}
    scores = [similarity(vector[left], vector[right]) for left, right in pairs]
    return scores, _prompt_tokens(outputs)


def _prompt_tokens(outputs: list[RequestOutput]) -> int:
    return sum(len(o.prompt_token_ids) for o in outputs)


def score_response(model: str, scores: list[float], tokens: int) -> dict:
    return {
        "id": f"score-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
        "model": model,
        "data": [{"index": i, "object": "score", "score": score} for i, score in enumerate(scores)],
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }  # fmt: skip


def rerank_response(model: str, body: RerankRequest, scores: list[float], tokens: int) -> dict:
    ranked = sorted(enumerate(scores), key=lambda pair: -pair[1])[: body.top_n]
    results = []
    for index, score in ranked:
        result: dict[str, Any] = {"index": index, "relevance_score": score}
        if body.return_documents:
            result["document"] = {"text": body.documents[index]}
        results.append(result)
    return {
        "id": f"rerank-{uuid.uuid4().hex}", "model": model, "results": results,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }  # fmt: skip
