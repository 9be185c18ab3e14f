"""Answering a generation request: start every choice, then stream server-sent events or collect the
results and reply; the engine requests are released however it ends (also when the client leaves).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import anyio
from fastapi import Request
from fastapi.responses import Response

from jaxdsa.serve.errors import ApiError
from jaxdsa.serve.event_stream import event_stream
from jaxdsa.serve.generation import ClientDisconnected, Generation, unless_disconnected
from jaxdsa.serve.protocol import ChatCompletionRequest, CompletionRequest

T = TypeVar("T")
DONE = "data: [DONE]\n\n"


def sse(obj: dict[str, Any]) -> str:
    """One server-sent event carrying ``obj`` as JSON."""
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def usage(gens: list[Generation], n: int) -> dict[str, int]:
    """Token counts of a response whose choices come ``n`` per prompt: each prompt counts once."""
    prompt = sum(len(g.prompt_ids) for g in gens[::n])
    completion = sum(g.num_output_tokens for g in gens)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


async def respond(
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
            return event_stream(_sse_events(gens, stream()))
        collected = await unless_disconnected(request, collect())
    except ClientDisconnected:
        return Response(status_code=499)
    finally:
        if not body.stream:
            for g in gens:
                await g.close()
    return reply(collected)


async def collect_texts(gens: list[Generation]) -> list[str]:
    """Each generation's whole text."""

    async def text(g: Generation) -> str:
        return "".join([d async for d in g.deltas()])

    return list(await asyncio.gather(*(text(g) for g in gens)))


async def interleave(streams: list[AsyncIterator[str]]) -> AsyncIterator[tuple[int, str | None]]:
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
    yield DONE


async def _start_all(gens: list[Generation]) -> None:
    """Start every choice; if one fails, the others are released and the error is raised."""
    try:
        for g in gens:
            await g.start()
    except BaseException:
        for g in gens:
            await g.close()
        raise
