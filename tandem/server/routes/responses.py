"""OpenAI's Responses API (/v1/responses), stateless, answered by the chat path; the
translation both ways is server/responses_api.py's."""

from __future__ import annotations

import functools

from fastapi import APIRouter, Depends, Request

from tandem.server import responses_api
from tandem.server.state import STREAMING, check_key, served

router = APIRouter(dependencies=[Depends(check_key)])


@router.post("/v1/responses", responses=STREAMING)
async def responses(body: responses_api.ResponsesRequest, request: Request):
    state = served(request)
    shape = responses_api.ResponseShape(body, state.model_name)
    events = functools.partial(responses_api.response_events, shape=shape)
    answer = await state.chat(responses_api.to_chat(body), request, events)
    return responses_api.to_response(answer, shape) if isinstance(answer, dict) else answer
