"""The prefill-decode router (``python -m serve.router``) in front of fake prefill and decode servers
that keep what they were sent: the two requests it makes of each completion, the relay of the
decode's answer (JSON or events), upstream failures, health, metrics and the command line."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client.parser import text_string_to_metric_families

from jaxdsa.serve.cli import bind
from jaxdsa.serve.router import build_parser, create_router_app
from jaxdsa.serve.router_pool import poll_health
from tests.serve.conftest import ROOT, serving, wait_ready, wait_until

COMPLETION = {"model": "fake", "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}
CHAT = {"model": "fake", "messages": [{"role": "user", "content": "Hi"}], "max_completion_tokens": 8}
BODIES = {"/v1/completions": COMPLETION, "/v1/chat/completions": CHAT}


def kv_params(name: str) -> dict[str, Any]:
    """What a vLLM prefill (NIXL connector) answers: where its cache is, plus what it moved."""
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": name,
        "remote_block_ids": [0, 1],
        "remote_host": "127.0.0.1",
        "remote_port": 5600,
        "transfer_bytes": 4096,
        "transfer_seconds": 0.25,
    }


class Upstream:
    """A fake server of one role: completions (JSON, or events when streamed), /health and
    /v1/models; ``received`` keeps each completion request as (path, headers, body)."""

    def __init__(self, name: str, prefill: bool):
        self.name, self.prefill = name, prefill
        self.url = ""  # where it is served
        self.app = self._app()
        self.reset()

    def reset(self) -> None:
        self.received: list[tuple[str, dict[str, str], dict[str, Any]]] = []
        self.kv = kv_params(self.name) if self.prefill else None  # its answers' kv_transfer_params
        self.health_status = 200
        self.error: tuple[int, dict[str, Any]] | None = None  # answer every completion with this
        self.hold = False  # answers (a stream: after its first event) only once the client has left
        self.left = threading.Event()  # a held stream's client left

    def events(self) -> list[str]:
        chunks = [{"id": self.name, "choices": [{"index": 0, "text": t}]} for t in ("Hello", " world")]
        return [f"data: {json.dumps(c)}\n\n" for c in chunks] + ["data: [DONE]\n\n"]

    def reply(self, path: str) -> dict[str, Any]:
        text = f"from {self.name}"
        if path == "/v1/chat/completions":
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}
        else:
            choice = {"index": 0, "text": text, "finish_reason": "length", "logprobs": None}
        return {
            "id": f"cmpl-{self.name}",
            "object": "chat.completion" if path == "/v1/chat/completions" else "text_completion",
            "created": 0,
            "model": "fake",
            "choices": [choice],
            "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6},
            "kv_transfer_params": self.kv,
        }

    def _app(self) -> FastAPI:
        app = FastAPI()

        async def complete(request: Request) -> Response:
            body = await request.json()
            self.received.append((request.url.path, dict(request.headers), body))
            if self.error is not None:
                return JSONResponse(self.error[1], status_code=self.error[0])
            if body.get("stream"):
                return StreamingResponse(self._stream(request), media_type="text/event-stream")
            if self.hold:
                await self._until_the_client_leaves(request)
            return JSONResponse(self.reply(request.url.path))

        for path in BODIES:
            app.add_api_route(path, complete, methods=["POST"])
        app.add_api_route("/health", lambda: Response(status_code=self.health_status))
        app.add_api_route(
            "/v1/models", lambda: {"object": "list", "data": [{"id": "fake", "object": "model"}]}
        )
        return app

    async def _stream(self, request: Request):
        events = self.events()
        yield events[0]
        if self.hold:
            await self._until_the_client_leaves(request)
        for event in events[1:]:
            yield event

    async def _until_the_client_leaves(self, request: Request) -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass
        self.left.set()


@pytest.fixture(scope="module")
def fleet() -> Iterator[dict[str, Upstream]]:
    """Two prefill and two decode fakes, p0 p1 d0 d1, served for the module (``.url``)."""
    ups = {name: Upstream(name, prefill=name.startswith("p")) for name in ("p0", "p1", "d0", "d1")}
    with contextlib.ExitStack() as stack:
        for up in ups.values():
            up.url = stack.enter_context(serving(up.app))
        yield ups


@pytest.fixture(autouse=True)
def _fresh(request):
    if "fleet" in request.fixturenames:
        for up in request.getfixturevalue("fleet").values():
            up.reset()


@contextlib.contextmanager
def routing(prefill: list[str], decode: list[str], **kwargs) -> Iterator[tuple[FastAPI, str]]:
    """A router over these URLs on a free port, without its background health polls."""
    app = create_router_app(prefill, decode, health_interval=None, **kwargs)
    with serving(app) as url:
        yield app, url


def post(url: str, path: str, body: Any, **kwargs) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=30, **kwargs)


def poll(app: FastAPI) -> None:
    """One round of the health polls the router runs every --health-interval."""

    async def once() -> None:
        async with httpx.AsyncClient() as client:
            await poll_health(client, list(app.state.pools.values()))

    asyncio.run(once())


def metric(url: str, name: str, **labels: str) -> float:
    """A sample of the router's /metrics, as Prometheus reads it."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and sample.labels == labels:
                return sample.value
    raise KeyError(f"{name} {labels} not in /metrics:\n{text}")


def refused() -> tuple[Any, str]:
    """A bound socket that does not listen (connections to it are refused) and its URL."""
    sock = bind("127.0.0.1", 0)
    return sock, f"http://127.0.0.1:{sock.getsockname()[1]}"


def assert_openai_error(r: httpx.Response, status: int, *words: str) -> None:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == status
    assert all(w in error["message"] for w in words), error


@pytest.mark.parametrize("path", list(BODIES))
def test_prefill_then_decode_with_its_kv_transfer_params(fleet, path):
    p0, d0 = fleet["p0"], fleet["d0"]
    body = BODIES[path] | {"stream_options": None}
    with routing([p0.url], [d0.url]) as (_, url):
        r = post(url, path, body, headers={"X-Request-Id": "req-7", "Authorization": "Bearer key"})
    assert r.status_code == 200 and r.json() == d0.reply(path)
    assert r.headers["x-request-id"] == "req-7"

    [(prefill_path, prefill_headers, prefill_body)] = p0.received
    [(decode_path, decode_headers, decode_body)] = d0.received
    assert prefill_path == decode_path == path
    expected = body | {"max_tokens": 1, "stream": False}
    if "max_completion_tokens" in body:
        expected["max_completion_tokens"] = 1
    del expected["stream_options"]
    assert prefill_body == expected | {
        "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False}
    }
    assert decode_body == body | {"kv_transfer_params": kv_params("p0")}
    for headers in (prefill_headers, decode_headers):
        assert headers["x-request-id"] == "req-7" and headers["authorization"] == "Bearer key"


def test_request_id_is_made_when_the_client_sends_none(fleet):
    p0, d0 = fleet["p0"], fleet["d0"]
    with routing([p0.url], [d0.url]) as (_, url):
        r = post(url, "/v1/completions", COMPLETION)
    made = r.headers["x-request-id"]
    assert made and p0.received[0][1]["x-request-id"] == d0.received[0][1]["x-request-id"] == made


@pytest.mark.parametrize("path", list(BODIES))
def test_streams_are_relayed_intact(fleet, path):
    p0, d0 = fleet["p0"], fleet["d0"]
    body = BODIES[path] | {"stream": True, "stream_options": {"include_usage": True}}
    with routing([p0.url], [d0.url]) as (_, url):
        r = post(url, path, body)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    assert r.text == "".join(d0.events()) and r.text.endswith("data: [DONE]\n\n")
    assert p0.received[0][2]["stream"] is False and "stream_options" not in p0.received[0][2]
    assert d0.received[0][2] == body | {"kv_transfer_params": kv_params("p0")}


def test_a_stream_is_relayed_as_it_comes_and_closed_when_the_client_leaves(fleet):
    """The decode holds its stream after the first event: the client gets that event before the
    stream ends, and leaving closes the decode's stream (which ends its request there)."""
    p0, d0 = fleet["p0"], fleet["d0"]
    d0.hold = True
    with routing([p0.url], [d0.url]) as (app, url):
        with httpx.stream(
            "POST", f"{url}/v1/completions", json=COMPLETION | {"stream": True}, timeout=30
        ) as r:
            received = b""
            for chunk in r.iter_raw():
                received += chunk
                if received.endswith(b"\n\n"):
                    break
            assert received.decode() == d0.events()[0]
        wait_until(d0.left.is_set, "the decode's stream to be closed")
        registry = app.state.metrics.registry
        labels = {"route": "/v1/completions", "outcome": "cancelled"}
        wait_until(lambda: registry.get_sample_value("jaxdsa_router_requests_total", labels) == 1, "count")
        assert registry.get_sample_value("jaxdsa_router_requests_in_flight") == 0


def test_a_client_leaving_before_the_answer_closes_the_upstream_request(fleet):
    p0, d0 = fleet["p0"], fleet["d0"]
    d0.hold = True
    with routing([p0.url], [d0.url]) as (app, url):
        body = json.dumps(COMPLETION).encode()
        head = "POST /v1/completions HTTP/1.1\r\nHost: router\r\nContent-Type: application/json\r\n"
        with socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1]))) as client:
            client.sendall(f"{head}Content-Length: {len(body)}\r\n\r\n".encode() + body)
            wait_until(lambda: d0.received, "the decode request")
        wait_until(d0.left.is_set, "the decode request to be closed")
        registry = app.state.metrics.registry
        labels = {"route": "/v1/completions", "outcome": "cancelled"}
        wait_until(lambda: registry.get_sample_value("jaxdsa_router_requests_total", labels) == 1, "count")
        assert registry.get_sample_value("jaxdsa_router_requests_in_flight") == 0


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_upstream_4xx_is_relayed_unchanged(fleet, role):
    p0, d0 = fleet["p0"], fleet["d0"]
    error = {
        "error": {"message": "The model `x` does not exist.", "type": "not_found_error", "param": "model"}
    }
    (p0 if role == "prefill" else d0).error = (404, error)
    with routing([p0.url], [d0.url]) as (_, url):
        r = post(url, "/v1/chat/completions", CHAT | {"model": "x", "stream": True})
    assert r.status_code == 404 and r.json() == error
    assert len(d0.received) == (role == "decode")


def test_prefill_without_kv_transfer_params_is_502(fleet):
    p0, d0 = fleet["p0"], fleet["d0"]
    p0.kv = None
    with routing([p0.url], [d0.url]) as (_, url):
        assert_openai_error(post(url, "/v1/completions", COMPLETION), 502, "kv_transfer_params", p0.url)
        assert metric(url, "jaxdsa_router_upstream_failures_total", role="prefill") == 1
    assert d0.received == []


def test_n_above_1_and_bad_json_are_400(fleet):
    p0, d0 = fleet["p0"], fleet["d0"]
    with routing([p0.url], [d0.url]) as (_, url):
        assert_openai_error(post(url, "/v1/completions", COMPLETION | {"n": 2}), 400, "n")
        r = httpx.post(f"{url}/v1/completions", content=b"{not json", timeout=30)
        assert_openai_error(r, 400, "invalid JSON")
        assert_openai_error(post(url, "/v1/completions", [COMPLETION]), 400, "JSON object")
    assert p0.received == d0.received == []


def test_round_robin_over_each_role(fleet):
    ups = [fleet[name] for name in ("p0", "p1", "d0", "d1")]
    with routing([ups[0].url, ups[1].url], [ups[2].url, ups[3].url]) as (_, url):
        replies = [post(url, "/v1/completions", COMPLETION).json()["choices"][0]["text"] for _ in range(4)]
    assert replies == ["from d0", "from d1"] * 2
    assert [len(up.received) for up in ups] == [2, 2, 2, 2]


def test_a_refused_instance_is_503_then_skipped_until_a_poll_finds_it_back(fleet):
    p1, d0 = fleet["p1"], fleet["d0"]
    dead, dead_url = refused()
    with routing([dead_url, p1.url], [d0.url]) as (app, url):
        assert_openai_error(post(url, "/v1/completions", COMPLETION), 503, "prefill", dead_url)
        assert [i.healthy for i in app.state.pools["prefill"].instances] == [False, True]
        assert [post(url, "/v1/completions", COMPLETION).status_code for _ in range(3)] == [200] * 3
        assert len(p1.received) == 3
        health = httpx.get(f"{url}/health", timeout=30)
        assert health.status_code == 200 and health.json()["healthy"]["prefill"] == {
            dead_url: False,
            p1.url: True,
        }
        assert metric(url, "jaxdsa_router_upstream_failures_total", role="prefill") == 1

        back = Upstream("back", prefill=True)
        with serving(back.app, dead):  # the same address, listening now
            poll(app)
            assert [post(url, "/v1/completions", COMPLETION).status_code for _ in range(2)] == [200] * 2
    assert len(back.received) == 1 and len(p1.received) == 4


def test_health_follows_the_polls(fleet):
    p0, d0, d1 = fleet["p0"], fleet["d0"], fleet["d1"]
    with routing([p0.url], [d0.url, d1.url]) as (app, url):
        assert httpx.get(f"{url}/health", timeout=30).status_code == 200
        d0.health_status = d1.health_status = 503
        poll(app)
        assert_openai_error(httpx.get(f"{url}/health", timeout=30), 503, "decode", d0.url, d1.url)
        assert_openai_error(post(url, "/v1/completions", COMPLETION), 503, "no healthy decode instance")
        assert p0.received == []  # nothing is prefilled for a decode that cannot be had
        d1.health_status = 200
        poll(app)
        assert httpx.get(f"{url}/health", timeout=30).status_code == 200
        assert post(url, "/v1/completions", COMPLETION).json()["choices"][0]["text"] == "from d1"


def test_models_come_from_a_decode_instance(fleet):
    with routing([fleet["p0"].url], [fleet["d0"].url]) as (_, url):
        r = httpx.get(f"{url}/v1/models", timeout=30)
    assert r.status_code == 200 and r.json()["data"][0]["id"] == "fake"


def test_metrics_count_requests_failures_and_transfers(fleet):
    p0, d0 = fleet["p0"], fleet["d0"]
    with routing([p0.url], [d0.url]) as (_, url):
        for name in ("jaxdsa_router_kv_transfer_bytes_total", "jaxdsa_router_kv_transfer_seconds_total"):
            assert metric(url, name) == 0  # there before any transfer
        assert metric(url, "jaxdsa_router_upstream_failures_total", role="decode") == 0
        assert post(url, "/v1/completions", COMPLETION).status_code == 200
        assert post(url, "/v1/chat/completions", CHAT | {"stream": True}).status_code == 200
        d0.error = (500, {"error": {"message": "boom"}})
        assert post(url, "/v1/completions", COMPLETION).status_code == 500

        requests = "jaxdsa_router_requests_total"
        assert metric(url, requests, route="/v1/completions", outcome="ok") == 1
        assert metric(url, requests, route="/v1/chat/completions", outcome="ok") == 1
        assert metric(url, requests, route="/v1/completions", outcome="error") == 1
        assert metric(url, "jaxdsa_router_upstream_failures_total", role="decode") == 1
        assert metric(url, "jaxdsa_router_requests_in_flight") == 0
        assert metric(url, "jaxdsa_router_prefill_latency_seconds_count") == 3
        assert metric(url, "jaxdsa_router_kv_transfer_bytes_total") == 3 * 4096
        assert metric(url, "jaxdsa_router_kv_transfer_seconds_total") == 3 * 0.25


class _BrokenStream(httpx.AsyncByteStream):
    async def __aiter__(self):
        yield b'data: {"id": "d"}\n\n'
        raise httpx.ReadError("connection reset")


async def _mock_upstreams(request: httpx.Request) -> httpx.Response:
    """Prefill answers; the decode times out, or breaks its stream after one event."""
    if request.url.host == "prefill":
        return httpx.Response(200, json={"kv_transfer_params": kv_params("prefill")})
    if json.loads(request.content).get("stream"):
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, stream=_BrokenStream())
    raise httpx.ReadTimeout("timed out", request=request)


def test_a_timeout_is_503_and_a_broken_stream_an_error_event():
    client = httpx.AsyncClient(transport=httpx.MockTransport(_mock_upstreams))
    with routing(["http://prefill"], ["http://decode"], client=client) as (app, url):
        assert_openai_error(post(url, "/v1/completions", COMPLETION), 503, "http://decode", "ReadTimeout")
        assert app.state.pools["decode"].instances[0].healthy  # slow is not down
        r = post(url, "/v1/completions", COMPLETION | {"stream": True})
        head, event = r.text.split("\n\n", 1)
        assert r.status_code == 200 and head == 'data: {"id": "d"}'
        error = json.loads(event.removeprefix("data: "))["error"]
        assert error["code"] == 502 and "ReadError" in error["message"]
        assert metric(url, "jaxdsa_router_upstream_failures_total", role="decode") == 2
        assert metric(url, "jaxdsa_router_requests_total", route="/v1/completions", outcome="error") == 2


@pytest.mark.parametrize(
    "argv",
    [
        ["--prefill", "http://a:1"],
        ["--decode", "http://b:1"],
        ["--prefill", "--decode", "http://b:1"],
        ["--prefill", "a:1", "--decode", "http://b:1"],
        ["--prefill", "http://a:1", "--decode", "http://b:1", "--health-interval", "0"],
        ["--prefill", "http://a:1", "--decode", "http://b:1", "--timeout", "soon"],
    ],
)
def test_bad_command_lines_are_refused(argv, capsys):
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(argv)
    assert info.value.code == 2 and "error:" in capsys.readouterr().err


def test_command_line_defaults():
    args = build_parser().parse_args(["--prefill", "http://a:1/", "http://b:1", "--decode", "http://c:1"])
    assert (args.host, args.port, args.health_interval, args.timeout) == ("127.0.0.1", 8000, 5.0, 600.0)
    assert (args.prefill, args.decode) == (["http://a:1", "http://b:1"], ["http://c:1"])


def test_python_m_serve_router_serves_the_openai_client(fleet, tmp_path):
    """The real command line on a free port, one prefill refusing connections: the router's own
    health polls take it out, and the official client's request goes through p0 and d0."""
    p0, d0 = fleet["p0"], fleet["d0"]
    dead, dead_url = refused()
    argv = [sys.executable, "-m", "serve.router", "--port", "0", "--health-interval", "0.1"]
    argv += ["--prefill", dead_url, p0.url, "--decode", d0.url]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    log_path = tmp_path / "router.log"
    with (
        dead,
        open(log_path, "w+") as log,
        subprocess.Popen(argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT) as proc,
    ):
        try:
            url = wait_ready(proc, log_path, timeout=60)
            healthy = lambda: httpx.get(f"{url}/health", timeout=30).json()["healthy"]["prefill"]
            wait_until(
                lambda: healthy() == {dead_url: False, p0.url: True}, "a poll to find the dead prefill"
            )
            client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
            reply = client.completions.create(model="fake", prompt="Hi", max_tokens=4)
            assert reply.choices[0].text == "from d0"
        finally:
            proc.send_signal(signal.SIGINT)
            code = proc.wait(timeout=30)
    assert code == 0, log_path.read_text()
    assert p0.received[0][2]["max_tokens"] == 1 and p0.received[0][1]["authorization"] == "Bearer x"
    assert d0.received[0][2]["kv_transfer_params"] == kv_params("p0")
