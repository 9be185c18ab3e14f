"""``POST /v1/chat/completions``: messages through the chat template, ``n`` choices each parsed into
reasoning, content and tool calls, JSON or SSE out."""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response

from jaxdsa.engine import SamplingParams
from jaxdsa.serve import disagg
from jaxdsa.serve.context import ServingContext, State, authorized
from jaxdsa.serve.errors import ApiError, error_responses
from jaxdsa.serve.generation import Generation
from jaxdsa.serve.logprobs import LogprobsFormatter
from jaxdsa.serve.output import ReplyDelta, ReplyParser, parser_markers, reply_parser
from jaxdsa.serve.protocol import ChatCompletionRequest, NamedToolChoice
from jaxdsa.serve.respond import interleave, respond, sse, usage
from jaxdsa.serve.response_models import ChatCompletion, generation_responses
from jaxdsa.serve.sampling_params import check_prompt, sampling_params, text_output
from jaxdsa.text import choice_sampling

router = APIRouter(tags=["generation"], dependencies=[Depends(authorized)])


@dataclasses.dataclass
class _Choice:
    """One of a chat request's ``n`` choices: its engine request, reply parser and logprobs."""

    gen: Generation
    parser: ReplyParser
    formatter: LogprobsFormatter | None


@router.post(
    "/v1/chat/completions",
    response_class=JSONResponse,
    responses=generation_responses(ChatCompletion, "`chat.completion.chunk` events ending in `data: [DONE]`")
    | error_responses(400, 401, 404, 429, 503),
)
async def chat_completions(body: ChatCompletionRequest, request: Request, state: State) -> Response:
    ctx = state.context
    name, created = ctx.model_name(body.model), int(time.time())
    tools = body.tool_dicts()
    tool_parser = ctx.tool_parser if _tool_choice(body, ctx) == "auto" and tools is not None else None
    prompt = ctx.render_chat(body.template_messages(), tools, body.template_kwargs())
    ids = ctx.tokenizer.encode(prompt.text)
    check_prompt(ctx, ids, "messages")
    handoff = await disagg.handoff(ctx, body, 1)
    sp = handoff.sampling(sampling_params(ctx, body, len(ids), None))
    keep = parser_markers(ctx.reasoning_parser, tool_parser)
    request_id = f"chatcmpl-{uuid.uuid4().hex}"

    def choice(j: int, spj: SamplingParams) -> _Choice:
        parser = reply_parser(ctx.reasoning_parser, tool_parser, tools, prompt.thinking)
        formatter = LogprobsFormatter(ctx.tokenizer) if spj.logprobs is not None else None
        text = text_output(ctx, body, spj, keep)
        gen = Generation(
            ctx.generate, state.metrics, f"{request_id}-{j}", ids, spj, text, handoff.engine_kwargs()
        )
        return _Choice(gen, parser, formatter)

    choices = [choice(j, spj) for j, spj in enumerate(choice_sampling(sp, body.n))]
    gens = [c.gen for c in choices]

    def reply(replies: list[ReplyDelta]) -> Response:
        return JSONResponse(
            {
                "id": request_id,
                "object": "chat.completion",
                "created": created,
                "model": name,
                "choices": [_message(i, c, r) for i, (c, r) in enumerate(zip(choices, replies))],
                "usage": usage(gens, body.n),
                **disagg.response_params(ctx, gens),
            }
        )

    stream = lambda: _stream(choices, body, request_id, name, created)  # noqa: E731
    collect = lambda: asyncio.gather(*(_collect_reply(c.gen, c.parser) for c in choices))  # noqa: E731
    return await respond(request, body, gens, stream, collect, reply)


async def _stream(
    choices: list[_Choice], body: ChatCompletionRequest, request_id: str, name: str, created: int
) -> AsyncIterator[str]:
    def chunk(choice_list: list[dict[str, Any]], **extra: Any) -> str:
        with_usage = {"usage": None} if body.include_usage else {}
        return sse(
            {
                "id": request_id,
                "object": "chat.completion.chunk",
                "created": created,
                "model": name,
                "choices": choice_list,
                **with_usage,
                **extra,
            }
        )

    def delta_chunk(i: int, delta: dict[str, Any], finish_reason: str | None = None) -> str:
        # Each content chunk carries the logprobs of the tokens read since the previous one.
        c = choices[i]
        new = c.gen.take_logprobs() if c.formatter and "role" not in delta else []
        logprobs = c.formatter.chat(new) if new else None
        return chunk([{"index": i, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}])

    def reply_chunks(i: int, d: ReplyDelta) -> list[str]:
        out = []
        if d.reasoning:
            out.append(delta_chunk(i, {"reasoning_content": d.reasoning}))
        if d.content:
            out.append(delta_chunk(i, {"content": d.content}))
        if d.tool_calls:
            first = choices[i].parser.num_tool_calls - len(d.tool_calls)
            calls = [{"index": first + k, **c.to_openai()} for k, c in enumerate(d.tool_calls)]
            out.append(delta_chunk(i, {"tool_calls": calls}))
        return out

    for i in range(len(choices)):
        yield delta_chunk(i, {"role": "assistant", "content": ""})
    async for i, text in interleave([c.gen.deltas() for c in choices]):
        c = choices[i]
        for x in reply_chunks(i, c.parser.feed(text) if text is not None else c.parser.finish()):
            yield x
        if text is None:
            yield delta_chunk(i, {}, _finish_reason(c.gen, c.parser))
    if body.include_usage:
        yield chunk([], usage=usage([c.gen for c in choices], body.n))


def _message(index: int, c: _Choice, reply: ReplyDelta) -> dict[str, Any]:
    message = c.parser.message(reply)
    logprobs = c.formatter.chat(c.gen.take_logprobs()) if c.formatter else None
    return {
        "index": index,
        "message": message,
        "finish_reason": _finish_reason(c.gen, c.parser),
        "logprobs": logprobs,
    }


def _tool_choice(body: ChatCompletionRequest, ctx: ServingContext) -> str:
    """The effective tool_choice, "none" or "auto" (OpenAI's default with tools); 400 for choices that
    need guided decoding."""
    choice = body.tool_choice if body.tool_choice is not None else ("auto" if body.tools else "none")
    if choice == "required" or isinstance(choice, NamedToolChoice):
        raise ApiError(
            400,
            "tool_choice 'required' and named functions need guided decoding, which this server does not do; "
            "use 'auto'",
            param="tool_choice",
        )
    if choice == "auto" and body.tools and not (ctx.enable_auto_tool_choice and ctx.tool_parser):
        raise ApiError(
            400,
            '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set',
            param="tool_choice",
        )
    return choice


def _finish_reason(gen: Generation, parser: ReplyParser) -> str | None:
    return parser.finish_reason(gen.finish_reason)


async def _collect_reply(gen: Generation, parser: ReplyParser) -> ReplyDelta:
    reply = ReplyDelta()
    for d in [parser.feed(t) async for t in gen.deltas()] + [parser.finish()]:
        reply += d
    return reply
