"""``POST /v1/completions``: prompts (text or token ids) in, ``n`` choices each, JSON or SSE out."""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response

from jaxdsa.serve import disagg
from jaxdsa.serve.context import AppState, State, authorized
from jaxdsa.serve.errors import error_responses
from jaxdsa.serve.generation import Generation
from jaxdsa.serve.logprobs import LogprobsFormatter
from jaxdsa.serve.protocol import CompletionRequest
from jaxdsa.serve.respond import collect_texts, interleave, respond, sse, usage
from jaxdsa.serve.response_models import Completion, generation_responses
from jaxdsa.serve.sampling_params import check_prompt, sampling_params, text_output
from jaxdsa.text import choice_sampling

router = APIRouter(tags=["generation"], dependencies=[Depends(authorized)])

DEFAULT_MAX_TOKENS = 16  # OpenAI's (and vLLM's) default for /v1/completions


@router.post(
    "/v1/completions",
    response_class=JSONResponse,
    responses=generation_responses(Completion, "`text_completion` chunks ending in `data: [DONE]`")
    | error_responses(400, 401, 404, 429, 503),
)
async def completions(body: CompletionRequest, request: Request, state: State) -> Response:
    ctx = state.context
    name, created = ctx.model_name(body.model), int(time.time())
    request_id = f"cmpl-{uuid.uuid4().hex}"
    gens, echoes = [], []  # prompt-major: choice index = prompt index * n + j
    prompts = body.prompts()
    handoff = await disagg.handoff(ctx, body, len(prompts))
    for prompt in prompts:
        if isinstance(prompt, str):
            ids = ctx.tokenizer.encode(prompt, add_special_tokens=True)
        else:
            ids = list(prompt)
        check_prompt(ctx, ids, "prompt")
        sp = handoff.sampling(sampling_params(ctx, body, len(ids), DEFAULT_MAX_TOKENS))
        if body.echo:  # the prompt's logprobs come back too
            sp = dataclasses.replace(sp, prompt_logprobs=sp.logprobs)
        echo = ""
        if body.echo:
            echo = (
                prompt
                if isinstance(prompt, str)
                else ctx.tokenizer.decode(ids, skip_special_tokens=body.skip_special_tokens)
            )
        for spj in choice_sampling(sp, body.n):
            text = text_output(ctx, body, spj)
            rid = f"{request_id}-{len(gens)}"
            gens.append(Generation(ctx.generate, state.metrics, rid, ids, spj, text, handoff.engine_kwargs()))
            echoes.append(echo)

    def reply(texts: list[str]) -> Response:
        choices = []
        for i, (g, echo, text) in enumerate(zip(gens, echoes, texts)):
            logprobs = _logprobs(g, LogprobsFormatter(ctx.tokenizer), echo=body.echo)
            choices.append(
                {"index": i, "text": echo + text, "finish_reason": g.finish_reason, "logprobs": logprobs}
            )
        return JSONResponse(
            {
                "id": request_id,
                "object": "text_completion",
                "created": created,
                "model": name,
                "choices": choices,
                "usage": usage(gens, body.n),
                **disagg.response_params(ctx, gens),
            }
        )

    stream = lambda: _stream(state, gens, echoes, body, request_id, name, created)  # noqa: E731
    return await respond(request, body, gens, stream, lambda: collect_texts(gens), reply)


async def _stream(
    state: AppState,
    gens: list[Generation],
    echoes: list[str],
    body: CompletionRequest,
    request_id: str,
    name: str,
    created: int,
) -> AsyncIterator[str]:
    def chunk(choices: list[dict[str, Any]], **extra: Any) -> str:
        with_usage = {"usage": None} if body.include_usage else {}
        return sse(
            {
                "id": request_id,
                "object": "text_completion",
                "created": created,
                "model": name,
                "choices": choices,
                **with_usage,
                **extra,
            }
        )

    formatters = [LogprobsFormatter(state.context.tokenizer) for _ in gens]
    if body.echo:  # the prompts (and their logprobs) first
        for i, (g, echo) in enumerate(zip(gens, echoes)):
            logprobs = _logprobs(g, formatters[i], echo=True)
            yield chunk([{"index": i, "text": echo, "finish_reason": None, "logprobs": logprobs}])
    async for i, text in interleave([g.deltas() for g in gens]):
        g = gens[i]
        logprobs = _logprobs(g, formatters[i])
        if text is None:
            yield chunk([{"index": i, "text": "", "finish_reason": g.finish_reason, "logprobs": logprobs}])
        else:
            yield chunk([{"index": i, "text": text, "finish_reason": None, "logprobs": logprobs}])
    if body.include_usage:
        yield chunk([], usage=usage(gens, body.n))


def _logprobs(gen: Generation, formatter: LogprobsFormatter, *, echo: bool = False) -> dict[str, Any] | None:
    """The legacy logprobs of the tokens read since the last call, led by the prompt's with
    ``echo``; None when not asked for."""
    if gen.sampling.logprobs is None:
        return None
    return formatter.completion(
        [*(gen.prompt_logprobs if echo else ()), *gen.take_logprobs()], gen.prompt_ids
    )
