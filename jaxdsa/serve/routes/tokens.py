"""vLLM's ``POST /tokenize`` (a prompt, or chat messages through the chat template) and
``POST /detokenize`` (token ids, each within the vocabulary, back to text)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends

from jaxdsa.serve.context import State, authorized
from jaxdsa.serve.errors import ApiError, error_responses
from jaxdsa.serve.protocol import DetokenizeRequest, TokenizeRequest, template_messages
from jaxdsa.serve.response_models import Detokenized, Tokenized
from jaxdsa.serve.sampling_params import check_token_ids

router = APIRouter(tags=["tokens"], dependencies=[Depends(authorized)])


@router.post("/tokenize", response_model=Tokenized, responses=error_responses(400, 401, 404))
async def tokenize(body: TokenizeRequest, state: State) -> dict[str, Any]:
    ctx = state.context
    ctx.model_name(body.model)
    if (body.prompt is None) == (body.messages is None):
        raise ApiError(400, "give exactly one of prompt or messages", param="prompt")
    if body.messages is not None:
        ids = ctx.tokenizer.encode(ctx.render_chat(template_messages(body.messages), None, {}).text)
    else:
        ids = ctx.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
    return {"count": len(ids), "max_model_len": ctx.max_model_len, "tokens": ids}


@router.post("/detokenize", response_model=Detokenized, responses=error_responses(400, 401, 404))
async def detokenize(body: DetokenizeRequest, state: State) -> dict[str, Any]:
    ctx = state.context
    ctx.model_name(body.model)
    check_token_ids(body.tokens, ctx.vocabulary, "tokens")
    return {"prompt": ctx.tokenizer.decode(body.tokens, skip_special_tokens=False)}
