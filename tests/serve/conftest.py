"""Shared pieces of the serving tests: tiny checkpoints, a uvicorn server in a thread, a scripted engine."""

from __future__ import annotations

import asyncio
import contextlib
import os
import pathlib
import subprocess
import threading
import time
from collections.abc import AsyncIterator, Iterator

import httpx
import pytest
import uvicorn
from fastapi import FastAPI

from checkpoints.make_tiny import make_tiny
from jaxdsa.engine import EngineDeadError, FinishReason, RequestOutput, SamplingParams, TokenLogprobs
from serve.cli import bind

ROOT = str(pathlib.Path(__file__).resolve().parents[2])


def free_port() -> int:
    sock = bind("127.0.0.1", 0)
    port = sock.getsockname()[1]
    sock.close()
    return port


def wait_healthy(proc: subprocess.Popen, port: int, log: os.PathLike, timeout: float = 600) -> str:
    """Poll /health of a ``python -m serve`` subprocess; its log in the failure message."""
    deadline = time.monotonic() + timeout
    while True:
        assert proc.poll() is None, pathlib.Path(log).read_text()
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return f"http://127.0.0.1:{port}"
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, "server did not become healthy:\n" + pathlib.Path(log).read_text()
        time.sleep(0.5)


@pytest.fixture(scope="session")
def glm_dir(tmp_path_factory) -> str:
    return make_tiny("glm_moe_dsa", tmp_path_factory.mktemp("serve-glm5"), seed=0)


@pytest.fixture(scope="session")
def dsv32_dir(tmp_path_factory) -> str:
    return make_tiny("deepseek_v32", tmp_path_factory.mktemp("serve-dsv32"), seed=0)


@contextlib.contextmanager
def serving(app: FastAPI) -> Iterator[str]:
    """Serve ``app`` on a free 127.0.0.1 port from a background thread; yields the base URL."""
    sock = bind("127.0.0.1", 0)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.01)
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
    """Stands in for AsyncEngine: replies with the next scripted token ids, one token per step.

    Lets tests force exactly what the "model" says (tool calls, reasoning) and see the prompts the
    server rendered. A script entry of ``EngineDeadError`` fails the request after its first token.
    Requests that ask for logprobs or prompt logprobs get :func:`scripted_logprobs`.
    """

    def __init__(self, max_model_len: int = 256, token_delay: float = 0.0):
        self.token_delay = token_delay
        self.scripts: list[list[int] | type[EngineDeadError]] = []
        self.prompts: list[list[int]] = []
        self.sampling: list[SamplingParams] = []
        self.max_model_len = max_model_len
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
            for i, token in enumerate(ids):
                await asyncio.sleep(self.token_delay)
                last = i == len(ids) - 1
                reason = (
                    (
                        FinishReason.STOP
                        if len(ids) < sampling.max_tokens or token in sampling.stop_token_ids
                        else FinishReason.LENGTH
                    )
                    if last
                    else None
                )
                logprobs = (
                    None if sampling.logprobs is None else [scripted_logprobs(i, token, sampling.logprobs)]
                )
                n = sampling.prompt_logprobs
                prompt_logprobs = (
                    None
                    if i or n is None
                    else [None] + [scripted_logprobs(p, prompt[p], n) for p in range(1, len(prompt))]
                )
                yield RequestOutput(
                    request_id,
                    [token],
                    last,
                    reason,
                    len(prompt),
                    i + 1,
                    logprobs=logprobs,
                    prompt_logprobs=prompt_logprobs,
                )
        finally:
            self.active -= 1
            self._running.discard(request_id)

    def stats(self) -> dict[str, float]:
        return {
            "running": self.active, "waiting": 0, "generated_tokens": 0, "cache_pages_used": 0, "cache_pages_total": 1, "cache_usage": 0.0,
            "prefix_cache_queries": 0, "prefix_cache_hits": 0,
        }  # fmt: skip
