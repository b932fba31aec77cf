"""Embeddings, scores and reranking (/v1/embeddings, /v1/score, /v1/rerank and
/rerank): server/embeddings.py has the shapes and the run."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request

from tandem.server import embeddings
from tandem.server.state import ERRORS, check_key, served

router = APIRouter(dependencies=[Depends(check_key)])


@router.post("/v1/embeddings", responses=ERRORS)
async def create_embeddings(body: embeddings.EmbeddingRequest, request: Request):
    state = served(request)
    state.check_model(body.model)
    outputs = await embeddings.embed(
        state, body.inputs(), request, dimensions=body.dimensions, normalize=body.normalize
    )
    if not isinstance(outputs, list):  # the client went away
        return outputs
    return embeddings.embeddings_response(state.model_name, outputs, body.encoding_format)


@router.post("/v1/score", responses=ERRORS)
async def score(body: embeddings.ScoreRequest, request: Request):
    state = served(request)
    state.check_model(body.model)
    scored = await embeddings.pair_scores(state, embeddings.score_pairs(body), request, "text_2")
    if not isinstance(scored, tuple):  # the client went away
        return scored
    return embeddings.score_response(state.model_name, *scored)


@router.post("/v1/rerank", responses=ERRORS)
@router.post("/rerank", responses=ERRORS, include_in_schema=False)
async def rerank(body: embeddings.RerankRequest, request: Request):
    state = served(request)
    state.check_model(body.model)
    pairs = [(body.query, document) for document in body.documents]
    scored = await embeddings.pair_scores(state, pairs, request, "documents")
    if not isinstance(scored, tuple):
        return scored
    return embeddings.rerank_response(state.model_name, body, *scored)
