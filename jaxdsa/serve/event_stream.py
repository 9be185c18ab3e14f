"""Server-sent event responses that end the moment the client leaves (the server's streams and the
prefill-decode router's relayed streams)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import anyio
from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send


class EventStream(StreamingResponse):
    """Server-sent events that stop as soon as the client leaves. Under ASGI 2.4 (uvicorn's)
    Starlette notices a disconnect only when a write fails, so a stream waiting for its next
    event would hold what feeds it (engine requests, an upstream connection) until that event
    came; here a listener ends the stream the moment the disconnect arrives, as Starlette does
    for older ASGI servers. The body is closed at the end, so its cleanup (a ``finally`` in the
    generator) runs then and not whenever the abandoned generator is collected."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as task_group:

                async def stream() -> None:
                    with contextlib.suppress(OSError):  # the client left while a chunk was written
                        await self.stream_response(send)
                    task_group.cancel_scope.cancel()

                task_group.start_soon(stream)
                await self.listen_for_disconnect(receive)
                task_group.cancel_scope.cancel()
        finally:
            if aclose := getattr(self.body_iterator, "aclose", None):
                await aclose()


def event_stream(body: AsyncIterator[str] | AsyncIterator[bytes]) -> StreamingResponse:
    """``body``'s events as ``text/event-stream``, unbuffered by proxies on the way."""
    return EventStream(
        body, media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    )
