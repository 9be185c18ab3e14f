"""1P1D as deployed: a prefill server, a decode server and the router, three real processes on
loopback. The official ``openai`` client through the router gets one server's text (completions and
streamed chat, eight requests at once as one by one); a prefill server killed after it answered
fails only the request whose cache it held (503 from the decode server, which goes on serving),
and the router then answers 503 itself."""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator

import httpx
import openai
import pytest

from tests.serve.conftest import ROOT, wait_ready
from tests.serve.test_disagg import ARGS, BODIES, DECODE, PREFILL, post, running, text_of

pytestmark = pytest.mark.slow  # disaggregation across processes; in one: tests/serve/test_disagg.py

PROMPTS = [f"Request {i}: the cache of this prompt moves between two servers" for i in range(8)]


@contextlib.contextmanager
def process(argv: list[str], log_path) -> Iterator[tuple[str, subprocess.Popen]]:
    """A server (or router) process on a free port: its URL once healthy; interrupted on exit."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", JAX_PLATFORMS="cpu")
    with (
        open(log_path, "w+") as log,
        subprocess.Popen(argv, cwd=ROOT, env=env, stdout=log, stderr=log) as proc,
    ):
        try:
            yield wait_ready(proc, log_path), proc
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
                try:
                    proc.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    proc.kill()


def server(model_dir: str, config: str) -> list[str]:
    return [sys.executable, "-m", "serve", model_dir, *ARGS, "--port", "0", "--kv-transfer-config", config]


@pytest.fixture(scope="module")
def expected(glm_dir) -> dict[str, str]:
    with running(glm_dir) as (alone, _):
        chat = text_of(post(alone, "chat/completions", BODIES["chat/completions"]))
        return {"chat": chat} | {
            p: text_of(post(alone, "completions", {**BODIES["completions"], "prompt": p})) for p in PROMPTS
        }


def test_one_prefill_one_decode_behind_the_router(glm_dir, expected, tmp_path):
    with (
        process(server(glm_dir, PREFILL), tmp_path / "prefill.log") as (prefill, _),
        process(server(glm_dir, DECODE), tmp_path / "decode.log") as (decode, _),
        process(
            [sys.executable, "-m", "serve.router", "--port", "0", "--prefill", prefill, "--decode", decode],
            tmp_path / "router.log",
        ) as (router, _),
    ):
        client = openai.OpenAI(base_url=f"{router}/v1", api_key="x", max_retries=0)
        body = BODIES["completions"]
        ask = lambda p: (
            client.completions.create(  # noqa: E731
                model="tiny",
                prompt=p,
                max_tokens=body["max_tokens"],
                temperature=0.0,
                extra_body={"ignore_eos": True},
            )
            .choices[0]
            .text
        )
        assert [ask(p) for p in PROMPTS[:2]] == [expected[p] for p in PROMPTS[:2]]
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            assert list(pool.map(ask, PROMPTS)) == [expected[p] for p in PROMPTS]
        chat = BODIES["chat/completions"]
        stream = client.chat.completions.create(
            model="tiny",
            messages=chat["messages"],
            max_tokens=chat["max_tokens"],
            temperature=0.0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == expected["chat"]
        assert "jaxdsa:kv_transfer_received_total 11.0" in httpx.get(f"{decode}/metrics").text


def test_a_dead_prefill_server_fails_only_its_requests(glm_dir, expected, tmp_path):
    body = BODIES["completions"] | {"prompt": PROMPTS[0]}
    with (
        process(server(glm_dir, PREFILL), tmp_path / "prefill.log") as (prefill, prefill_proc),
        process(server(glm_dir, DECODE), tmp_path / "decode.log") as (decode, _),
        process(
            [
                sys.executable,
                "-m",
                "serve.router",
                "--port",
                "0",
                "--prefill",
                prefill,
                "--decode",
                decode,
                "--health-interval",
                "0.2",
            ],
            tmp_path / "router.log",
        ) as (router, _),
    ):
        first = post(
            prefill, "completions", body | {"max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
        )
        params = first.json()["kv_transfer_params"]
        prefill_proc.kill()
        prefill_proc.wait(timeout=30)
        orphan = post(decode, "completions", body | {"kv_transfer_params": params})
        assert orphan.status_code == 503, orphan.text
        assert "prefill server" in orphan.json()["error"]["message"]
        assert text_of(post(decode, "completions", body)) == expected[PROMPTS[0]]  # served on its own
        assert "jaxdsa:kv_transfer_failed_total 1.0" in httpx.get(f"{decode}/metrics").text
        through_router = post(router, "completions", body)
        assert through_router.status_code == 503
