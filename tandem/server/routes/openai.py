"""OpenAI's API: /v1/models, /v1/completions, /v1/chat/completions, and vLLM's
/tokenize and /detokenize. Answers and stream chunks have OpenAI's shapes
(server/responses.py)."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Depends, Request

from tandem.errors import InvalidParameterError, require_unicode
from tandem.server.handlers import engine_prompt
from tandem.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    render_conversation,
)
from tandem.server.state import ERRORS, STREAMING, check_key, served

router = APIRouter(dependencies=[Depends(check_key)])


@router.get("/v1/models", responses=ERRORS)
async def models(request: Request):
    return {"object": "list", "data": [served(request).card]}


@router.get("/v1/models/{model:path}", responses=ERRORS)
async def model(model: str, request: Request):
    """One model's card (the SDK's ``models.retrieve``); 404 for another name."""
    served(request).check_model(model)
    return served(request).card


@router.post("/tokenize", responses=ERRORS)
async def tokenize(body: TokenizeRequest, request: Request):
    """Token ids of a prompt, or of a conversation exactly as chat completions
    renders it (content parts joined)."""
    state = served(request)
    state.check_model(body.model)
    if (body.prompt is None) == (body.messages is None):
        raise InvalidParameterError("prompt", "give exactly one of prompt and messages")
    if body.messages is not None:
        conversation = render_conversation(body.messages)
        encoder = state.need_tokenizer("messages")
        tokens = await asyncio.to_thread(
            encoder.encode_chat,
            conversation,
            add_generation_prompt=body.add_generation_prompt,
            continue_final_message=body.continue_final_message,
        )
    else:
        require_unicode(body.prompt, "prompt")
        encoder = state.need_tokenizer("prompt")
        tokens = await asyncio.to_thread(encoder.encode, body.prompt, body.add_special_tokens)
    return {"count": len(tokens), "max_model_len": state.max_model_len, "tokens": tokens}


@router.post("/detokenize", responses=ERRORS)
async def detokenize(body: DetokenizeRequest, request: Request):
    state = served(request)
    state.check_model(body.model)
    vocab = state.engine.info.vocab_size
    if any(t < 0 or t >= vocab for t in body.tokens):
        raise InvalidParameterError("tokens", f"token ids must be in [0, {vocab})")
    return {"prompt": state.need_tokenizer("tokens").decode(body.tokens)}


@router.post("/v1/completions", responses=STREAMING)
async def completions(body: CompletionRequest, request: Request):
    state = served(request)
    state.check_model(body.model)
    prompts = body.prompts()
    state.limits.check(body, len(prompts))
    params = body.sampling_params(state.defaults)
    return await state.handler.serve(
        request,
        "cmpl",
        [engine_prompt(prompt, body.cache_salt) for prompt in prompts],
        params,
        body.stream,
        body.include_usage_in_stream,
        chat=False,
        kv_transfer_params=body.kv_transfer_params,
        continuous_usage=body.continuous_usage_in_stream,
        echo=body.echo,
        drop_generated=body.echo and body.max_tokens == 0,
    )


@router.post("/v1/chat/completions", responses=STREAMING)
async def chat_completions(body: ChatCompletionRequest, request: Request):
    return await served(request).chat(body, request)
