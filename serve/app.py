"""The OpenAI-compatible HTTP API (FastAPI): models, completions, chat completions, health, metrics.

Endpoints: ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions`` (JSON or
SSE streams ending in ``data: [DONE]``), ``GET /health``, ``GET /metrics`` and vLLM's
``POST /tokenize`` / ``POST /detokenize`` (used by ``serve.bench``). The app never touches the model:
it talks to the engine only through ``ServingContext.generate`` and ``.stats``, so tests can serve
scripted outputs through the same code.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import anyio
from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from jaxdsa.engine import SamplingParams
from serve.chat_format import ChatFormat, ChatPrompt, ChatTemplateError
from serve.errors import ApiError, install_error_handlers
from serve.generation import ClientDisconnected, GenerateFn, Generation, unless_disconnected
from serve.logprobs import LogprobsFormatter
from serve.metrics import CONTENT_TYPE, Metrics
from serve.output import ReplyDelta, ReplyParser, TextOutput
from serve.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    NamedToolChoice,
    TokenizeRequest,
)
from serve.reasoning import REASONING_PARSERS, ReasoningSplitter
from serve.tokenizer import Tokenizer
from serve.tool_parsers import TOOL_PARSERS

T = TypeVar("T")

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's (and vLLM's) default for /v1/completions


@dataclasses.dataclass
class ServingContext:
    """Everything the HTTP layer needs about the model and the engine."""

    generate: GenerateFn  # AsyncEngine.generate
    stats: Callable[[], dict[str, float]]  # Engine.stats
    tokenizer: Tokenizer
    chat_format: ChatFormat | None
    model_names: list[str]
    max_model_len: int
    eos_token_ids: frozenset[int]
    model_path: str = ""
    reasoning_parser: str | None = None
    tool_parser: str | None = None
    enable_auto_tool_choice: bool = False
    default_sampling: dict[str, Any] = dataclasses.field(default_factory=dict)  # from generation_config.json
    api_key: str | None = None
    max_logprobs: int = 20  # the engine's limit on top logprobs per token
    vocab_size: int | None = None  # the model's, for logit_bias token ids


def _sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


_DONE = "data: [DONE]\n\n"


def create_app(ctx: ServingContext) -> FastAPI:
    app = FastAPI(title="jaxdsa", docs_url=None, redoc_url=None)
    install_error_handlers(app)
    metrics = Metrics(ctx.stats)
    started = int(time.time())

    async def authorized(request: Request) -> None:
        if ctx.api_key and request.headers.get("authorization") != f"Bearer {ctx.api_key}":
            raise ApiError(
                401, "invalid or missing API key (send 'Authorization: Bearer <key>')", code="invalid_api_key"
            )

    def model_name(requested: str | None) -> str:
        if requested is not None and requested not in ctx.model_names:
            raise ApiError(
                404, f"The model `{requested}` does not exist.", param="model", code="model_not_found"
            )
        return requested or ctx.model_names[0]

    def model_card(name: str) -> dict[str, Any]:
        return {
            "id": name,
            "object": "model",
            "created": started,
            "owned_by": "jaxdsa",
            "root": ctx.model_path,
            "parent": None,
            "max_model_len": ctx.max_model_len,
        }

    def sampling(
        body: ChatCompletionRequest | CompletionRequest,
        prompt_len: int,
        requested: int | None,
        default: int | None,
        param: str,
    ) -> SamplingParams:
        remaining = ctx.max_model_len - prompt_len
        if remaining < 1:
            raise ApiError(
                400,
                f"This model's maximum context length is {ctx.max_model_len} tokens; the prompt has {prompt_len}, leaving none to generate.",
                param=param,
                code="context_length_exceeded",
            )
        if requested is not None and requested > remaining:
            raise ApiError(
                400,
                f"This model's maximum context length is {ctx.max_model_len} tokens. However, you requested "
                f"{prompt_len + requested} tokens ({prompt_len} in the prompt, {requested} in the completion).",
                param="max_tokens",
                code="context_length_exceeded",
            )
        logprobs, logprobs_param = body.logprobs_request()
        if logprobs is not None and logprobs > ctx.max_logprobs:
            raise ApiError(
                400,
                f"{logprobs_param} {logprobs} is above this server's --max-logprobs {ctx.max_logprobs}",
                param=logprobs_param,
            )
        d = ctx.default_sampling
        top_k = body.top_k if body.top_k is not None else d.get("top_k", 0)
        max_tokens = requested or min(remaining, default or remaining)
        if body.min_tokens > max_tokens:
            raise ApiError(
                400, f"min_tokens {body.min_tokens} is above max_tokens {max_tokens}", param="min_tokens"
            )
        bias = body.logit_bias or {}
        if ctx.vocab_size is not None and any(t >= ctx.vocab_size for t in bias):
            raise ApiError(
                400,
                f"logit_bias token ids must be below the vocabulary size {ctx.vocab_size}",
                param="logit_bias",
            )
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=body.temperature if body.temperature is not None else d.get("temperature", 1.0),
            top_p=body.top_p if body.top_p is not None else d.get("top_p", 1.0),
            top_k=max(top_k, 0),
            seed=body.seed,
            stop_token_ids=tuple(body.stop_token_ids or ()),
            ignore_eos=body.ignore_eos,
            logprobs=logprobs,
            min_tokens=body.min_tokens,
            presence_penalty=body.presence_penalty,
            frequency_penalty=body.frequency_penalty,
            repetition_penalty=body.repetition_penalty,
            logit_bias=tuple(sorted(bias.items())),
        )

    def text_output(
        body: ChatCompletionRequest | CompletionRequest, sp: SamplingParams, keep: tuple[str, ...] = ()
    ) -> TextOutput:
        skip = ctx.tokenizer.skip_ids(skip_special_tokens=body.skip_special_tokens, keep=keep)
        hidden = sp.stop_ids(ctx.eos_token_ids)
        return TextOutput(
            ctx.tokenizer, skip_ids=skip, stop=body.stop, hidden_ids=hidden, min_tokens=sp.min_tokens
        )

    def generation(
        request_id: str, prompt_ids: list[int], sp: SamplingParams, text: TextOutput
    ) -> Generation:
        return Generation(ctx.generate, metrics, request_id, prompt_ids, sp, text)

    # -- plain endpoints --------------------------------------------------------------------------
    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models", dependencies=[Depends(authorized)])
    async def list_models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card(n) for n in ctx.model_names]}

    @app.get("/v1/models/{name:path}", dependencies=[Depends(authorized)])
    async def get_model(name: str) -> dict[str, Any]:
        return model_card(model_name(name))

    @app.post("/tokenize", dependencies=[Depends(authorized)])
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        model_name(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise ApiError(400, "give exactly one of prompt or messages", param="prompt")
        if body.messages is not None:
            messages = ChatCompletionRequest(messages=body.messages).template_messages()
            ids = ctx.tokenizer.encode(render_chat(messages, None, {}).text)
        else:
            ids = ctx.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        return {"count": len(ids), "max_model_len": ctx.max_model_len, "tokens": ids}

    @app.post("/detokenize", dependencies=[Depends(authorized)])
    async def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
        model_name(body.model)
        return {"prompt": ctx.tokenizer.decode(body.tokens, skip_special_tokens=False)}

    def render_chat(
        messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, kwargs: dict[str, Any]
    ) -> ChatPrompt:
        if ctx.chat_format is None:
            raise ApiError(400, "this model has no chat template; use /v1/completions", param="messages")
        try:
            return ctx.chat_format.render(messages, tools, kwargs)
        except ChatTemplateError as e:
            raise ApiError(400, str(e), param="messages") from e

    # -- completions ------------------------------------------------------------------------------
    @app.post("/v1/completions", dependencies=[Depends(authorized)])
    async def completions(body: CompletionRequest, request: Request) -> Response:
        name, created = model_name(body.model), int(time.time())
        request_id = f"cmpl-{uuid.uuid4().hex}"
        gens, echoes = [], []  # prompt-major: choice index = prompt index * n + j
        for prompt in body.prompts():
            ids = (
                ctx.tokenizer.encode(prompt, add_special_tokens=True)
                if isinstance(prompt, str)
                else list(prompt)
            )
            sp = sampling(body, len(ids), body.requested_max_tokens, COMPLETIONS_DEFAULT_MAX_TOKENS, "prompt")
            if body.echo:  # the prompt's logprobs come back too
                sp = dataclasses.replace(sp, prompt_logprobs=sp.logprobs)
            echo = (
                ""
                if not body.echo
                else prompt
                if isinstance(prompt, str)
                else ctx.tokenizer.decode(ids, skip_special_tokens=body.skip_special_tokens)
            )
            for spj in _choice_sampling(sp, body.n):
                gens.append(generation(f"{request_id}-{len(gens)}", ids, spj, text_output(body, spj)))
                echoes.append(echo)

        def reply(texts: list[str]) -> Response:
            choices = []
            for i, (g, echo, text) in enumerate(zip(gens, echoes, texts)):
                logprobs = _completion_logprobs(g, LogprobsFormatter(ctx.tokenizer), echo=body.echo)
                choices.append(
                    {"index": i, "text": echo + text, "finish_reason": g.finish_reason, "logprobs": logprobs}
                )
            usage = _usage(gens, body.n)
            return JSONResponse(
                {
                    "id": request_id,
                    "object": "text_completion",
                    "created": created,
                    "model": name,
                    "choices": choices,
                    "usage": usage,
                }
            )

        stream = lambda: _completion_stream(gens, echoes, body, request_id, name, created)  # noqa: E731
        return await _respond(request, body, gens, stream, lambda: _collect_all(gens), reply)

    async def _completion_stream(
        gens: list[Generation],
        echoes: list[str],
        body: CompletionRequest,
        request_id: str,
        name: str,
        created: int,
    ) -> AsyncIterator[str]:
        def chunk(choices: list[dict[str, Any]], **extra: Any) -> str:
            usage = {"usage": None} if body.include_usage else {}
            return _sse(
                {
                    "id": request_id,
                    "object": "text_completion",
                    "created": created,
                    "model": name,
                    "choices": choices,
                    **usage,
                    **extra,
                }
            )

        formatters = [LogprobsFormatter(ctx.tokenizer) for _ in gens]
        if body.echo:  # the prompts (and their logprobs) first
            for i, (g, echo) in enumerate(zip(gens, echoes)):
                yield chunk(
                    [
                        {
                            "index": i,
                            "text": echo,
                            "finish_reason": None,
                            "logprobs": _completion_logprobs(g, formatters[i], echo=True),
                        }
                    ]
                )
        async for i, text in _interleave([g.deltas() for g in gens]):
            g = gens[i]
            logprobs = _completion_logprobs(g, formatters[i])
            if text is None:
                yield chunk(
                    [{"index": i, "text": "", "finish_reason": g.finish_reason, "logprobs": logprobs}]
                )
            else:
                yield chunk([{"index": i, "text": text, "finish_reason": None, "logprobs": logprobs}])
        if body.include_usage:
            yield chunk([], usage=_usage(gens, body.n))

    # -- chat completions -------------------------------------------------------------------------
    @app.post("/v1/chat/completions", dependencies=[Depends(authorized)])
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        name, created = model_name(body.model), int(time.time())
        tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
        parse_tools = _tool_choice(body, ctx) == "auto" and tools is not None
        prompt = render_chat(body.template_messages(), tools, body.template_kwargs())
        ids = ctx.tokenizer.encode(prompt.text)
        sp = sampling(body, len(ids), body.requested_max_tokens, None, "messages")
        keep = (REASONING_PARSERS[ctx.reasoning_parser] if ctx.reasoning_parser else ()) + (
            TOOL_PARSERS[ctx.tool_parser].markers if parse_tools else ()
        )
        request_id = f"chatcmpl-{uuid.uuid4().hex}"

        def choice(j: int, spj: SamplingParams) -> _ChatChoice:
            parser = ReplyParser(
                ReasoningSplitter(prompt.thinking) if ctx.reasoning_parser else None,
                TOOL_PARSERS[ctx.tool_parser](tools) if parse_tools else None,
            )
            formatter = LogprobsFormatter(ctx.tokenizer) if spj.logprobs is not None else None
            return _ChatChoice(
                generation(f"{request_id}-{j}", ids, spj, text_output(body, spj, keep)), parser, formatter
            )

        choices = [choice(j, spj) for j, spj in enumerate(_choice_sampling(sp, body.n))]
        gens = [c.gen for c in choices]

        def reply(replies: list[ReplyDelta]) -> Response:
            out = [_chat_message(i, c, r) for i, (c, r) in enumerate(zip(choices, replies))]
            usage = _usage(gens, body.n)
            return JSONResponse(
                {
                    "id": request_id,
                    "object": "chat.completion",
                    "created": created,
                    "model": name,
                    "choices": out,
                    "usage": usage,
                }
            )

        stream = lambda: _chat_stream(choices, body, request_id, name, created)  # noqa: E731
        collect = lambda: asyncio.gather(*(_collect_reply(c.gen, c.parser) for c in choices))  # noqa: E731
        return await _respond(request, body, gens, stream, collect, reply)

    async def _chat_stream(
        choices: list[_ChatChoice], body: ChatCompletionRequest, request_id: str, name: str, created: int
    ) -> AsyncIterator[str]:
        def chunk(choice_list: list[dict[str, Any]], **extra: Any) -> str:
            usage = {"usage": None} if body.include_usage else {}
            return _sse(
                {
                    "id": request_id,
                    "object": "chat.completion.chunk",
                    "created": created,
                    "model": name,
                    "choices": choice_list,
                    **usage,
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
                out.append(
                    delta_chunk(
                        i,
                        {
                            "tool_calls": [
                                {"index": first + k, **c.to_openai()} for k, c in enumerate(d.tool_calls)
                            ]
                        },
                    )
                )
            return out

        for i in range(len(choices)):
            yield delta_chunk(i, {"role": "assistant", "content": ""})
        async for i, text in _interleave([c.gen.deltas() for c in choices]):
            c = choices[i]
            for x in reply_chunks(i, c.parser.feed(text) if text is not None else c.parser.finish()):
                yield x
            if text is None:
                yield delta_chunk(i, {}, _chat_finish_reason(c.gen, c.parser))
        if body.include_usage:
            yield chunk([], usage=_usage([c.gen for c in choices], body.n))

    return app


@dataclasses.dataclass
class _ChatChoice:
    """One of a chat request's ``n`` choices: its engine request, reply parser and logprobs."""

    gen: Generation
    parser: ReplyParser
    formatter: LogprobsFormatter | None


def _choice_sampling(sp: SamplingParams, n: int) -> list[SamplingParams]:
    """The sampling of each of ``n`` choices: a seeded request's choice j uses seed + j, so the
    choices differ and each one is reproducible (unseeded ones get distinct derived seeds)."""
    return [sp if sp.seed is None else dataclasses.replace(sp, seed=sp.seed + j) for j in range(n)]


def _chat_message(index: int, c: _ChatChoice, reply: ReplyDelta) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": reply.content}
    reasoning = c.parser.reasoning
    if reasoning is not None:
        message["reasoning_content"] = reply.reasoning if reasoning.saw_reasoning else None
    if reply.tool_calls:
        message["tool_calls"] = [t.to_openai() for t in reply.tool_calls]
        message["content"] = reply.content or None
    logprobs = c.formatter.chat(c.gen.take_logprobs()) if c.formatter else None
    return {
        "index": index,
        "message": message,
        "finish_reason": _chat_finish_reason(c.gen, c.parser),
        "logprobs": logprobs,
    }


def _tool_choice(body: ChatCompletionRequest, ctx: ServingContext) -> str:
    """The effective tool_choice, "none" or "auto" (OpenAI's default with tools); 400 for choices that need guided decoding."""
    choice = body.tool_choice if body.tool_choice is not None else ("auto" if body.tools else "none")
    if choice == "required" or isinstance(choice, NamedToolChoice):
        raise ApiError(
            400,
            "tool_choice 'required' and named functions need guided decoding, which this server does not do; use 'auto'",
            param="tool_choice",
        )
    if choice == "auto" and body.tools and not (ctx.enable_auto_tool_choice and ctx.tool_parser):
        raise ApiError(
            400,
            '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set',
            param="tool_choice",
        )
    return choice


def _chat_finish_reason(gen: Generation, parser: ReplyParser) -> str | None:
    return "tool_calls" if parser.num_tool_calls and gen.finish_reason == "stop" else gen.finish_reason


def _completion_logprobs(
    gen: Generation, formatter: LogprobsFormatter, *, echo: bool = False
) -> dict[str, Any] | None:
    """The legacy logprobs of the tokens read since the last call, led by the prompt's with
    ``echo``; None when not asked for."""
    if gen.sampling.logprobs is None:
        return None
    return formatter.completion(
        [*(gen.prompt_logprobs if echo else ()), *gen.take_logprobs()], gen.prompt_ids
    )


def _usage(gens: list[Generation], n: int) -> dict[str, int]:
    """Token counts of a response whose choices come ``n`` per prompt: each prompt counts once."""
    prompt = sum(len(g.prompt_ids) for g in gens[::n])
    completion = sum(g.num_output_tokens for g in gens)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


async def _respond(
    request: Request,
    body: ChatCompletionRequest | CompletionRequest,
    gens: list[Generation],
    stream: Callable[[], AsyncIterator[str]],
    collect: Callable[[], Awaitable[T]],
    reply: Callable[[T], Response],
) -> Response:
    """Start every choice, then either stream its events (the stream owns the generations from
    then on) or collect the results and build the reply; the generations are closed either way,
    and a client gone before the answer gets 499."""
    try:
        await unless_disconnected(request, _start_all(gens))
        if body.stream:
            return _sse_response(_sse_events(gens, stream()))
        collected = await unless_disconnected(request, collect())
    except ClientDisconnected:
        return Response(status_code=499)
    finally:
        if not body.stream:
            for g in gens:
                await g.close()
    return reply(collected)


async def _sse_events(gens: list[Generation], events: AsyncIterator[str]) -> AsyncIterator[str]:
    """A stream's events, then ``[DONE]``; an engine failure mid-stream becomes an error event,
    and the generations are closed however the stream ends (also when the client leaves)."""
    try:
        async for event in events:
            yield event
    except ApiError as e:
        yield e.sse()
    finally:
        for g in gens:
            await g.close()
    yield _DONE


def _sse_response(body: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(
        body, media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    )


async def _start_all(gens: list[Generation]) -> None:
    """Start every choice; if one fails, the others are released and the error is raised."""
    try:
        for g in gens:
            await g.start()
    except BaseException:
        for g in gens:
            await g.close()
        raise


async def _collect_all(gens: list[Generation]) -> list[str]:
    async def text(g: Generation) -> str:
        return "".join([d async for d in g.deltas()])

    return list(await asyncio.gather(*(text(g) for g in gens)))


async def _collect_reply(gen: Generation, parser: ReplyParser) -> ReplyDelta:
    reply = ReplyDelta()
    for d in [parser.feed(t) async for t in gen.deltas()] + [parser.finish()]:
        reply.reasoning += d.reasoning
        reply.content += d.content
        reply.tool_calls += d.tool_calls
    return reply


async def _interleave(streams: list[AsyncIterator[str]]) -> AsyncIterator[tuple[int, str | None]]:
    """Items of several streams as they come, as (stream index, item); (index, None) when one ends."""
    pending = {asyncio.ensure_future(anext(s)): i for i, s in enumerate(streams)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                i = pending.pop(task)
                try:
                    item = task.result()
                except StopAsyncIteration:
                    yield i, None
                    continue
                pending[asyncio.ensure_future(anext(streams[i]))] = i
                yield i, item
    finally:
        # Wait for the cancelled reads to unwind (shielded: a disconnect cancels this scope too), so
        # no engine stream is still running when the caller closes it.
        with anyio.CancelScope(shield=True):
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
