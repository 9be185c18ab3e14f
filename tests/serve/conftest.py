"""Shared pieces of the serving tests: tiny checkpoints, a uvicorn server in a thread, a scripted engine."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import pathlib
import re
import socket
import subprocess
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator

import httpx
import pytest
import uvicorn
from fastapi import FastAPI

from jaxdsa.checkpoints.tiny.make import make_tiny
from jaxdsa.engine import (
    AsyncEngine,
    Engine,
    EngineDeadError,
    FinishReason,
    RequestOutput,
    SamplingParams,
    TokenLogprobs,
)
from jaxdsa.serve.cli import Server, bind, build, parse_args

ROOT = str(pathlib.Path(__file__).resolve().parents[2])


# One function tool (OpenAI's shape) for the chat-format and live tests.
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather for a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]

WAIT_S = 60.0  # the bound on every wait below: a condition that does not come fails the test


def wait_until(condition: Callable[[], bool], what: str, timeout: float = WAIT_S) -> None:
    """Poll ``condition`` until it holds; fail naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


async def until(condition: Callable[[], bool], what: str, timeout: float = WAIT_S) -> None:
    """:func:`wait_until` for coroutines."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)


def wait_ready(proc: subprocess.Popen, log: os.PathLike, timeout: float = 600) -> str:
    """The URL of a ``python -m serve --port 0`` subprocess once it answers /health: the port is the
    one its "ready:" line names (the server binds port 0 itself, so no other process can take it
    between a test choosing a port and the server binding it)."""
    log = pathlib.Path(log)
    deadline = time.monotonic() + timeout
    url = None
    while True:
        assert proc.poll() is None, log.read_text()
        if url is None and (ready := re.search(r"ready: serving .* at (http://[\d.:]+)/v1", log.read_text())):
            url = ready.group(1)
        if url is not None:
            try:
                if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                    return url
            except httpx.TransportError:
                pass
        assert time.monotonic() < deadline, "server did not become healthy:\n" + log.read_text()
        time.sleep(0.5)


@pytest.fixture(scope="session")
def glm_dir(tmp_path_factory) -> str:
    return make_tiny("glm_moe_dsa", tmp_path_factory.mktemp("serve-glm5"), seed=0)


@pytest.fixture(scope="session")
def dsv32_dir(tmp_path_factory) -> str:
    return make_tiny("deepseek_v32", tmp_path_factory.mktemp("serve-dsv32"), seed=0)


@pytest.fixture(scope="session")
def dsv4_dir(tmp_path_factory) -> str:
    """A tiny DeepSeek-V4, 1024 positions long so that a prompt with V4's tools block fits."""
    overrides = {"max_position_embeddings": 1024}
    return make_tiny("deepseek_v4", tmp_path_factory.mktemp("serve-dsv4"), seed=0, overrides=overrides)


@contextlib.contextmanager
def serving(app: FastAPI, sock: socket.socket | None = None) -> Iterator[str]:
    """Serve ``app`` from a background thread on ``sock`` (bound to 127.0.0.1, not listening yet;
    default: a free port); yields the base URL."""
    sock = sock or bind("127.0.0.1", 0)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    wait_until(lambda: server.started or not thread.is_alive(), "uvicorn to start")
    assert server.started, "uvicorn did not start"
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)


def scripted_logprobs(i: int, token: int, n: int) -> TokenLogprobs:
    """The i-th scripted token's logprobs: distinct values, the token itself the most likely."""
    lp = -0.25 * (i + 1)
    return TokenLogprobs(token, lp, tuple((token + k, lp - k) for k in range(n)))


class ScriptedEngine:
    """Stands in for AsyncEngine: replies with the next scripted token ids, one token per step (or, with
    ``chunks``, that many per step in turn, as speculative decoding emits them).

    Lets tests force exactly what the "model" says (tool calls, reasoning) and see the prompts the
    server rendered. A script entry of ``EngineDeadError`` fails the request after its first token.
    Requests that ask for logprobs or prompt logprobs get :func:`scripted_logprobs`. With
    ``hold_after`` each request stops after that many tokens until it is closed, so a test can act
    on a request that is surely still running (no race against its speed).
    """

    def __init__(self, max_model_len: int = 256, hold_after: int | None = None):
        self.hold_after = hold_after
        self.scripts: list[list[int] | type[EngineDeadError]] = []
        self.prompts: list[list[int]] = []
        self.sampling: list[SamplingParams] = []
        self.max_model_len = max_model_len
        self.chunks: tuple[int, ...] = (1,)
        self.active = 0
        self._running: set[str] = set()

    async def generate(
        self, request_id: str, prompt: list[int], sampling: SamplingParams
    ) -> AsyncIterator[RequestOutput]:
        if request_id in self._running:
            raise ValueError(f"duplicate request id {request_id!r}")  # as the real engine does
        self.prompts.append(list(prompt))
        self.sampling.append(sampling)
        script = self.scripts.pop(0)
        self.active += 1
        self._running.add(request_id)
        try:
            if script is EngineDeadError:
                yield RequestOutput(request_id, [65], False, None, len(prompt), 1)
                raise EngineDeadError("scripted failure")
            ids = script[: sampling.max_tokens]
            i, sizes = 0, itertools.cycle(self.chunks)
            while i < len(ids):
                if i == self.hold_after:
                    await asyncio.Event().wait()  # never set: held until the request is closed
                new = ids[i : i + next(sizes)]
                last = i + len(new) == len(ids)
                reason = (
                    (
                        FinishReason.STOP
                        if len(ids) < sampling.max_tokens or new[-1] in sampling.stop_token_ids
                        else FinishReason.LENGTH
                    )
                    if last
                    else None
                )
                logprobs = (
                    None
                    if sampling.logprobs is None
                    else [scripted_logprobs(i + j, t, sampling.logprobs) for j, t in enumerate(new)]
                )
                n = sampling.prompt_logprobs
                prompt_logprobs = (
                    None
                    if i or n is None
                    else [None] + [scripted_logprobs(p, prompt[p], n) for p in range(1, len(prompt))]
                )
                i += len(new)
                yield RequestOutput(
                    request_id,
                    new,
                    last,
                    reason,
                    len(prompt),
                    i,
                    logprobs=logprobs,
                    prompt_logprobs=prompt_logprobs,
                )
        finally:
            self.active -= 1
            self._running.discard(request_id)

    def stats(self) -> dict[str, float]:
        counters = ("waiting", "generated_tokens", "cache_pages_used", "prefix_cache_queries")
        counters += ("prefix_cache_hits", "preemptions", "failed_steps")
        return {"running": self.active, "cache_pages_total": 1, "cache_usage": 0.0} | dict.fromkeys(
            counters, 0
        )


class EngineControl:
    """A test's handles on a live server's engine thread, so tests decide how far generation gets
    instead of racing it: ``hold_when(predicate)`` holds the thread before each step while
    ``predicate(engine)`` is true (it is evaluated on the engine thread, which owns that state), and
    ``wait_for_aborts`` returns once the server has sent that many aborts to the engine."""

    def __init__(self, aengine: AsyncEngine, monkeypatch: pytest.MonkeyPatch):
        self._condition = threading.Condition()
        self._hold: Callable[[Engine], bool] | None = None
        self.aborted: list[str] = []
        engine, step, abort = aengine.engine, aengine.engine.step, aengine.abort

        def held_step():
            with self._condition:
                self._condition.wait_for(lambda: self._hold is None or not self._hold(engine), WAIT_S)
            return step()

        def counted_abort(request_id: str) -> None:
            abort(request_id)
            with self._condition:
                self.aborted.append(request_id)
                self._condition.notify_all()

        monkeypatch.setattr(engine, "step", held_step)
        monkeypatch.setattr(aengine, "abort", counted_abort)

    def hold_when(self, predicate: Callable[[Engine], bool]) -> None:
        with self._condition:
            self._hold = predicate
            self._condition.notify_all()

    def release(self) -> None:
        self.hold_when(None)

    def wait_for_aborts(self, n: int) -> None:
        with self._condition:
            assert self._condition.wait_for(lambda: len(self.aborted) >= n, WAIT_S), (
                f"{len(self.aborted)} of {n} aborts arrived"
            )


# A real engine small enough that generated and soak requests stay cheap: 32-token contexts, 16
# slots over 12 pages of 8 tokens (a quarter of what 16 full contexts need, so requests wait and
# get preempted), steps of at most 32 tokens. The soak and the schema tests share it (and so its
# compiled step shapes).
SMALL_SERVER_ARGS = [
    "--served-model-name", "small", "--host", "127.0.0.1", "--dtype", "float32", "--max-model-len", "32",
    "--max-num-seqs", "16", "--max-num-batched-tokens", "32", "--page-size", "8", "--num-pages", "12",
    "--max-queue-len", "256", "--no-warmup",
]  # fmt: skip


@pytest.fixture(scope="session")
def small_server(glm_dir) -> Iterator[tuple[str, Server]]:
    """(base URL, server) of the small real-engine server on 127.0.0.1."""
    server = build(parse_args([glm_dir, *SMALL_SERVER_ARGS]))
    with serving(server.app) as url:
        yield url, server
    server.engine.shutdown()
