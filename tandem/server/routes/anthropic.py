"""Anthropic's Messages API (/v1/messages, /v1/messages/count_tokens), answered by the
chat path; the translation both ways and the error shape are server/anthropic.py's."""

from __future__ import annotations

import functools

from fastapi import APIRouter, Depends, Request

from tandem.server import anthropic
from tandem.server.state import check_key, served

router = APIRouter(dependencies=[Depends(check_key)])


@router.post("/v1/messages", responses=anthropic.STREAMING)
async def messages(body: anthropic.MessagesRequest, request: Request):
    state = served(request)
    events = functools.partial(anthropic.message_events, model=state.model_name)
    answer = await state.chat(anthropic.to_chat(body), request, events)
    return anthropic.to_message(answer) if isinstance(answer, dict) else answer


@router.post("/v1/messages/count_tokens", responses=anthropic.ERRORS)
async def count_message_tokens(body: anthropic.CountTokensRequest, request: Request):
    state = served(request)
    translated = anthropic.to_chat(body)
    state.check_model(translated.model)
    tools = state.tool_calling(translated)
    return {"input_tokens": len(await state.chat_prompt(translated, tools))}
