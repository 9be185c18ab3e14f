"""One disaggregated request, as vLLM's disaggregated proxy runs it: the prefill instance computes
the prompt's KV cache (the request cut to one token, marked ``do_remote_decode``) and answers with
``kv_transfer_params`` saying where that cache is; the decode instance gets the client's request
with those ``kv_transfer_params``, pulls the cache and generates; its answer goes back to the client
as it comes (JSON, or server-sent events relayed chunk by chunk).

An upstream's own 4xx (a bad request, an unknown model) reaches the client unchanged: the servers
check requests as the client expects. What the router cannot get an answer to is a 503, and an
instance that refuses a connection leaves the rotation (:mod:`jaxdsa.serve.router_pool`).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import anyio
import httpx
from fastapi.responses import Response

from jaxdsa.serve.errors import ApiError
from jaxdsa.serve.event_stream import event_stream
from jaxdsa.serve.router_metrics import RouterMetrics
from jaxdsa.serve.router_pool import Instance, Pool

# What vLLM's proxy sends the prefill: compute the cache and keep it for a remote decode.
REMOTE_DECODE = {"do_remote_decode": True, "do_remote_prefill": False}
CONNECT_TIMEOUT_S = 10.0  # a host that does not answer in this long fails over without waiting --timeout


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The request the prefill instance gets: one token, not streamed, its cache kept for the decode."""
    out = {**body, "max_tokens": 1, "stream": False, "kv_transfer_params": REMOTE_DECODE}
    if "max_completion_tokens" in body:
        out["max_completion_tokens"] = 1
    out.pop("stream_options", None)  # only meaningful with stream; vLLM refuses it without
    return out


def relay(upstream: httpx.Response) -> Response:
    """An upstream's answer as it came: status, body and content type."""
    return Response(
        upstream.content, status_code=upstream.status_code, media_type=upstream.headers.get("content-type")
    )


class Proxy:
    """Sends requests to the instances of ``pools`` (``prefill``, ``decode``) through ``client``."""

    def __init__(
        self, client: httpx.AsyncClient, pools: dict[str, Pool], metrics: RouterMetrics, timeout: float
    ):
        self.client, self.pools, self.metrics = client, pools, metrics
        self.timeout = httpx.Timeout(timeout, connect=min(timeout, CONNECT_TIMEOUT_S))

    async def send(
        self,
        role: str,
        instance: Instance,
        method: str,
        path: str,
        headers: dict[str, str],
        body: dict[str, Any] | None = None,
        stream: bool = False,
    ) -> httpx.Response:
        """One upstream request, read whole unless it is the event stream asked for (``stream``). A
        transport failure is a 503, and a refused connection also takes the instance out of the
        rotation; a 5xx answer counts as a failure of ``role``."""
        request = self.client.build_request(
            method, f"{instance.url}{path}", json=body, headers=headers, timeout=self.timeout
        )
        try:
            response = await self.client.send(request, stream=stream)
            if stream and not _is_event_stream(response):  # an error, or JSON: relayed whole
                await response.aread()
        except httpx.TransportError as e:
            self.metrics.upstream_failures.labels(role).inc()
            why = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
            if isinstance(e, httpx.ConnectError | httpx.ConnectTimeout):
                self.pools[role].mark(instance, False, why)
            raise ApiError(503, f"{role} instance {instance.url} failed: {why}", code=503) from e
        if response.status_code >= 500:
            self.metrics.upstream_failures.labels(role).inc()
        return response

    async def generate(
        self, path: str, body: dict[str, Any], headers: dict[str, str], on_stream_end: Callable[[str], None]
    ) -> Response:
        """Prefill, then decode; the decode's answer as the client's. A relayed stream calls
        ``on_stream_end`` with its outcome once it is over."""
        if body.get("n") not in (None, 1):
            raise ApiError(400, "n: the router takes one choice per request (n = 1)", param="n", code=400)
        prefill, decode = self.pools["prefill"].pick(), self.pools["decode"].pick()
        started = time.perf_counter()
        answer = await self.send("prefill", prefill, "POST", path, headers, prefill_body(body))
        self.metrics.prefill_latency.observe(time.perf_counter() - started)
        if not answer.is_success:
            return relay(answer)
        kv_transfer_params = self._kv_transfer_params(prefill, answer)
        self.metrics.observe_transfer(kv_transfer_params)

        body = {**body, "kv_transfer_params": kv_transfer_params}
        stream = bool(body.get("stream"))
        answer = await self.send("decode", decode, "POST", path, headers, body, stream=stream)
        if stream and _is_event_stream(answer):
            return event_stream(_Relay(answer, decode, self.metrics, on_stream_end))
        return relay(answer)

    def _kv_transfer_params(self, prefill: Instance, answer: httpx.Response) -> dict[str, Any]:
        try:
            data = answer.json()
        except ValueError:
            data = None
        params = data.get("kv_transfer_params") if isinstance(data, dict) else None
        if not isinstance(params, dict):
            self.metrics.upstream_failures.labels("prefill").inc()
            raise ApiError(
                502,
                f"prefill instance {prefill.url} answered without kv_transfer_params: is it started with"
                " --kv-transfer-config as a KV producer?",
                code=502,
            )
        return params


def _is_event_stream(answer: httpx.Response) -> bool:
    """A 200 carrying server-sent events: anything else (an error, JSON) is relayed whole."""
    return answer.status_code == 200 and answer.headers.get("content-type", "").startswith(
        "text/event-stream"
    )


class _Relay:
    """The decode's events, passed on chunk by chunk as they arrive. Closing it (the stream ended,
    broke, or the client left, started or not) releases the upstream connection, which ends the
    decode's request there, and reports the outcome."""

    def __init__(
        self,
        upstream: httpx.Response,
        instance: Instance,
        metrics: RouterMetrics,
        on_end: Callable[[str], None],
    ):
        self.upstream, self.instance, self.metrics, self.on_end = upstream, instance, metrics, on_end
        self.outcome = "cancelled"  # until the stream ends or breaks

    async def __aiter__(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self.upstream.aiter_bytes():
                yield chunk
            self.outcome = "ok"
        except httpx.HTTPError as e:
            self.metrics.upstream_failures.labels("decode").inc()
            self.outcome = "error"
            message = f"decode instance {self.instance.url} broke the stream: {type(e).__name__}: {e}"
            yield ApiError(502, message, code=502).sse().encode()

    async def aclose(self) -> None:
        with anyio.CancelScope(shield=True):  # also when the stream's scope is being cancelled
            await self.upstream.aclose()
        self.on_end(self.outcome)
