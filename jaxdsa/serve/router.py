"""``python -m serve.router``: the prefill-decode disaggregation router, vLLM's disaggregated proxy.

Clients talk to it as to one OpenAI-compatible server. Each completion is sent first to a prefill
instance (it computes the prompt's KV cache) and then to a decode instance (it takes that cache
over and generates), the two picked round-robin among the healthy instances of their role; the
servers agree on the cache through vLLM's ``kv_transfer_params`` (:mod:`jaxdsa.serve.router_proxy`).
``GET /health`` says whether both roles have a healthy instance, ``GET /metrics`` counts what went
through, ``GET /v1/models`` is a decode instance's.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import sys
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from jaxdsa.serve.cli import StartupError, bind
from jaxdsa.serve.errors import ApiError, install_error_handlers
from jaxdsa.serve.generation import ClientDisconnected, unless_disconnected
from jaxdsa.serve.metrics import CONTENT_TYPE
from jaxdsa.serve.router_metrics import RouterMetrics, Tracked, outcome
from jaxdsa.serve.router_pool import Pool, poll_forever
from jaxdsa.serve.router_proxy import Proxy, relay

HEALTH_INTERVAL_S = 5.0
TIMEOUT_S = 600.0


def create_router_app(
    prefill_urls: Sequence[str],
    decode_urls: Sequence[str],
    *,
    client: httpx.AsyncClient | None = None,
    health_interval: float | None = HEALTH_INTERVAL_S,
    timeout: float = TIMEOUT_S,
) -> FastAPI:
    """The router over these base URLs. ``client`` sends the upstream requests (tests pass one
    over a mock transport; the app closes only the client it made). Every instance's ``/health``
    is polled every ``health_interval`` seconds while the app runs (None: never; the instances
    then leave the rotation only by refusing a connection). ``timeout`` bounds each upstream
    request, in seconds."""
    pools = {"prefill": Pool("prefill", list(prefill_urls)), "decode": Pool("decode", list(decode_urls))}
    metrics = RouterMetrics()
    owned = client is None
    if client is None:
        # no connection cap: every stream relayed holds one; no proxies from the environment
        client = httpx.AsyncClient(limits=httpx.Limits(max_connections=None), trust_env=False)
    proxy = Proxy(client, pools, metrics, timeout)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        poller = None
        if health_interval is not None:
            poller = asyncio.create_task(poll_forever(client, list(pools.values()), health_interval))
        try:
            yield
        finally:
            if poller is not None:
                poller.cancel()
                await asyncio.gather(poller, return_exceptions=True)
            if owned:
                await client.aclose()

    app = FastAPI(title="jaxdsa prefill-decode router", lifespan=lifespan)
    app.state.pools, app.state.metrics, app.state.proxy = pools, metrics, proxy
    install_error_handlers(app)

    async def completion(request: Request) -> Response:
        async def work(track: Tracked, headers: dict[str, str]) -> Response:
            body = await _json_object(request)
            return await proxy.generate(request.url.path, body, headers, on_stream_end=track.done)

        return await _answer(request, metrics, work)

    for path in ("/v1/completions", "/v1/chat/completions"):
        app.add_api_route(path, completion, methods=["POST"])

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        async def work(_: Tracked, headers: dict[str, str]) -> Response:
            decode = pools["decode"].pick()
            return relay(await proxy.send("decode", decode, "GET", "/v1/models", headers))

        return await _answer(request, metrics, work)

    @app.get("/health")
    async def health() -> JSONResponse:
        state = {role: {i.url: i.healthy for i in pool.instances} for role, pool in pools.items()}
        if not all(any(up.values()) for up in state.values()):
            down = "; ".join(
                f"{role} {', '.join(pool.down())}" for role, pool in pools.items() if pool.down()
            )
            missing = " and ".join(role for role, up in state.items() if not any(up.values()))
            raise ApiError(503, f"no healthy {missing} instance (down: {down})", code=503)
        return JSONResponse({"status": "ok", "healthy": state})

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    return app


async def _answer(
    request: Request,
    metrics: RouterMetrics,
    work: Callable[[Tracked, dict[str, str]], Awaitable[Response]],
) -> Response:
    """Run one routed request, counted in /metrics, with the headers its upstream requests carry:
    ``X-Request-Id`` (the client's, or a new one; also on the answer) so that the prefill and
    decode logs of one request can be matched, and the client's ``Authorization`` for servers
    that check an API key. A client gone before the answer gets 499 and its upstream requests
    are closed."""
    track = metrics.track(request.url.path)
    request_id = request.headers.get("x-request-id") or str(uuid.uuid4())
    headers = {"X-Request-Id": request_id}
    if auth := request.headers.get("authorization"):
        headers["Authorization"] = auth
    try:
        await request.body()  # read before the disconnect watch starts, which must not take its chunks
        response = await unless_disconnected(request, work(track, headers))
    except ApiError as e:
        response = e.response()
    except ClientDisconnected:
        track.done("cancelled")
        return Response(status_code=499)
    except BaseException:
        track.done("error")
        raise
    if not isinstance(response, StreamingResponse):  # a stream reports its outcome when it ends
        track.done(outcome(response.status_code))
    response.headers["X-Request-Id"] = request_id
    return response


async def _json_object(request: Request) -> dict[str, Any]:
    try:
        body = await request.json()
    except ValueError as e:  # not JSON, or not UTF-8
        raise ApiError(400, f"invalid JSON body: {e}", code=400) from None
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object", code=400)
    return body


def _url(value: str) -> str:
    if not value.startswith(("http://", "https://")):
        raise argparse.ArgumentTypeError(f"{value!r} is not an http:// or https:// base URL")
    return value.rstrip("/")


def _seconds(value: str) -> float:
    try:
        number = float(value)
    except ValueError:
        number = 0.0
    if not 0 < number < float("inf"):
        raise argparse.ArgumentTypeError(f"{value!r} is not a positive number of seconds")
    return number


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m serve.router",
        allow_abbrev=False,
        description="Prefill-decode disaggregation router: one OpenAI-compatible endpoint in front of"
        " prefill and decode servers that exchange KV caches through vLLM's kv_transfer_params.",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on, 0 for any free one")
    p.add_argument("--prefill", nargs="+", type=_url, required=True, metavar="URL", help="prefill servers")
    p.add_argument("--decode", nargs="+", type=_url, required=True, metavar="URL", help="decode servers")
    p.add_argument(
        "--health-interval",
        type=_seconds,
        default=HEALTH_INTERVAL_S,
        help="seconds between polls of every server's /health (default: %(default)s)",
    )
    p.add_argument(
        "--timeout",
        type=_seconds,
        default=TIMEOUT_S,
        help="seconds an upstream request may take (between two chunks of a stream; default: %(default)s)",
    )
    return p


def main(argv: Sequence[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="jaxdsa router: %(message)s")
    try:
        sock = bind(args.host, args.port)
    except StartupError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    app = create_router_app(
        args.prefill, args.decode, health_interval=args.health_interval, timeout=args.timeout
    )
    host, port = sock.getsockname()[:2]
    shown = "localhost" if host in ("0.0.0.0", "::") else host
    roles = f"prefill {', '.join(args.prefill)} and decode {', '.join(args.decode)}"
    print(f"jaxdsa router: ready: serving {roles} at http://{shown}:{port}/v1", file=sys.stderr, flush=True)
    with contextlib.suppress(KeyboardInterrupt):  # uvicorn re-raises Ctrl-C after its graceful shutdown
        uvicorn.Server(uvicorn.Config(app, timeout_graceful_shutdown=5)).run(sockets=[sock])


if __name__ == "__main__":
    main()
