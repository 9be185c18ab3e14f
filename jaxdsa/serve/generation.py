"""One engine request seen from the HTTP side: start it, read text deltas, always release it.

``start()`` waits for the first token so that everything that can go wrong before a response
begins (bad request, queue full, engine failure) becomes the right HTTP status rather than an
error inside a 200 stream. Closing the generation (normal end, stop string, disconnect,
cancellation) closes the engine's iterator, which aborts the request and frees its slot and pages.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

from fastapi import Request

from jaxdsa.engine import EngineDeadError, QueueFullError, RequestOutput, SamplingParams, TokenLogprobs
from jaxdsa.serve.errors import ApiError
from jaxdsa.serve.metrics import Metrics
from jaxdsa.serve.output import TextOutput

GenerateFn = Callable[..., AsyncIterator[RequestOutput]]  # (request id, prompt ids, sampling, **handoff)
T = TypeVar("T")


def engine_error(e: Exception) -> ApiError:
    if isinstance(e, QueueFullError):
        return ApiError(429, f"server overloaded: {e}", code="queue_full")
    if isinstance(e, EngineDeadError):
        return ApiError(503, f"engine failure: {e}", code="engine_error")
    return ApiError(400, str(e), code="invalid_request")


@dataclasses.dataclass
class Generation:
    generate: GenerateFn
    metrics: Metrics
    request_id: str
    prompt_ids: list[int]
    sampling: SamplingParams
    text: TextOutput
    handoff: dict = dataclasses.field(default_factory=dict)  # engine arguments (jaxdsa.serve.disagg)
    arrival: float = dataclasses.field(default_factory=time.monotonic)
    cache_image: object = None  # an exported request's cache, from its last output
    finish_reason: str | None = None
    num_output_tokens: int = 0
    _stream: AsyncIterator[RequestOutput] | None = dataclasses.field(default=None, init=False, repr=False)
    _first: RequestOutput | None = dataclasses.field(default=None, init=False, repr=False)
    _logprobs: list[TokenLogprobs] = dataclasses.field(default_factory=list, init=False, repr=False)
    prompt_logprobs: list[TokenLogprobs | None] | None = dataclasses.field(
        default=None, init=False
    )  # when asked

    async def start(self) -> None:
        self._stream = self.generate(self.request_id, self.prompt_ids, self.sampling, **self.handoff)
        try:
            self._first = await anext(self._stream)
        except (ValueError, QueueFullError, EngineDeadError) as e:
            raise engine_error(e) from e
        self.prompt_logprobs = self._first.prompt_logprobs
        self.metrics.prompt_tokens.inc(len(self.prompt_ids))
        self.metrics.time_to_first_token.observe(time.monotonic() - self.arrival)

    async def deltas(self) -> AsyncIterator[str]:
        """Non-empty text deltas; ``finish_reason`` is set when this ends."""
        out = self._first
        try:
            while True:
                self._logprobs += out.logprobs or ()
                delta = self.text.push(out)
                self.num_output_tokens = out.num_output_tokens
                self.cache_image = out.cache_image
                self.finish_reason = self.text.finish_reason(out)
                if delta:
                    yield delta
                if self.finish_reason is not None:
                    break
                try:
                    out = await anext(self._stream)
                except EngineDeadError as e:
                    raise engine_error(e) from e
        finally:
            await self.close()
        self.metrics.e2e_latency.observe(time.monotonic() - self.arrival)
        self.metrics.requests.labels(self.finish_reason).inc()

    def take_logprobs(self) -> list[TokenLogprobs]:
        """Logprobs of the tokens read since the last call (empty unless the request asked)."""
        taken, self._logprobs = self._logprobs, []
        return taken

    async def close(self) -> None:
        """Abort the request if it is still running (idempotent)."""
        if self._stream is not None:
            await self._stream.aclose()


class ClientDisconnected(Exception):
    """The client went away before the response was ready."""


async def unless_disconnected(request: Request, work: Awaitable[T], poll_s: float = 0.1) -> T:
    """Run ``work``; cancel it (which aborts its engine requests) if the client disconnects."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=poll_s)
            if done:
                return task.result()
            if await request.is_disconnected():
                raise ClientDisconnected
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
