"""Disaggregated serving over HTTP on loopback, the cache moved by NIXL: a prefill server answers a
``do_remote_decode`` request with ``kv_transfer_params``, a decode server given them reads the
request's cache and decodes the text one co-located server gives (greedy, float32) for GLM-5,
DeepSeek-V3.2 and DeepSeek-V4 (prompts past V4's window), completions and chat, streaming or not
(different parallelism on the two sides: tests/sharding/test_disagg_serve.py); and what cannot work
is a clean 4xx / 5xx: a server without --kv-transfer-config, a role that does not match, params that
describe no cache, a lease that ran out, a prompt other than the one prefilled."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator

import httpx
import pytest

from jaxdsa.serve.cli import Server, build, parse_args
from tests.serve.conftest import serving

# Left out of the default run (tests/conftest.py; pytest -m slow runs them): V3.2 and V4 over HTTP: the
# default run hands them over engine to engine (tests/engine/test_handoff.py) and GLM-5 over HTTP.
SLOW_CASES = (
    "test_decode_server_continues_as_one_server_would[dsv4]",
    "test_decode_server_continues_as_one_server_would[dsv32]",
)

ARGS = [
    "--served-model-name", "tiny", "--host", "127.0.0.1", "--dtype", "float32", "--max-model-len", "256",
    "--max-num-seqs", "4", "--page-size", "8", "--no-warmup",
]  # fmt: skip
PREFILL = '{"kv_connector": "NixlConnector", "kv_role": "kv_producer", "engine_id": "p0"}'
DECODE = '{"kv_connector": "NixlConnector", "kv_role": "kv_consumer", "engine_id": "d0"}'
PROMPT = "Disaggregated serving moves each request's cache from the prefill server to the decoder"


@contextlib.contextmanager
def running(model_dir: str, *flags: str) -> Iterator[tuple[str, Server]]:
    server = build(parse_args([model_dir, *ARGS, *flags]))
    try:
        with serving(server.app) as url:
            yield url, server
    finally:
        server.engine.shutdown()
        if server.context.kv is not None:
            server.context.kv.close()


def post(url: str, route: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}/v1/{route}", json=body, timeout=120)


def handed_over(prefill: str, decode: str, route: str, body: dict) -> httpx.Response:
    """The router's two requests: one token on the prefill server, the rest on the decode server."""
    first = post(
        prefill,
        route,
        body | {"max_tokens": 1, "stream": False, "kv_transfer_params": {"do_remote_decode": True}},
    )
    assert first.status_code == 200, first.text
    params = first.json()["kv_transfer_params"]
    assert params["do_remote_prefill"] and params["transfer_bytes"] > 0
    return post(decode, route, body | {"kv_transfer_params": params})


BODIES = {
    "completions": {"prompt": PROMPT, "max_tokens": 12, "temperature": 0.0, "ignore_eos": True},
    "chat/completions": {
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": 12,
        "temperature": 0.0,
        "ignore_eos": True,
    },
}


def text_of(reply: httpx.Response) -> str:
    assert reply.status_code == 200, reply.text
    choice = reply.json()["choices"][0]
    return choice["text"] if "text" in choice else choice["message"]["content"] or ""


@pytest.mark.parametrize("family", ["glm", "dsv32", "dsv4"])
def test_decode_server_continues_as_one_server_would(family, request):
    model_dir = request.getfixturevalue(f"{family}_dir")
    with running(model_dir) as (alone, _):
        expected = {route: text_of(post(alone, route, body)) for route, body in BODIES.items()}
    with running(model_dir, "--kv-transfer-config", PREFILL) as (prefill, p):
        with running(model_dir, "--kv-transfer-config", DECODE) as (decode, d):
            for route, body in BODIES.items():
                assert text_of(handed_over(prefill, decode, route, body)) == expected[route], route
            metrics = httpx.get(f"{decode}/metrics").text
            assert "jaxdsa:kv_transfer_received_total 2.0" in metrics
            deadline = time.monotonic() + 30  # the prefill side frees each image on the reader's notice
            while p.context.kv.stats.offered != 2 or p.context.kv._offers:
                assert time.monotonic() < deadline, "the prefill server kept its images"
                time.sleep(0.05)


def streamed_handover(glm_dir: str, decode_flags: list[str]) -> None:
    """A streamed decode after a prefill on another server (``decode_flags``: its parallelism)
    gives one server's text."""
    body = BODIES["completions"]
    with running(glm_dir) as (alone, _):
        expected = text_of(post(alone, "completions", body))
    with running(glm_dir, "--kv-transfer-config", PREFILL) as (prefill, _):
        with running(glm_dir, "--kv-transfer-config", DECODE, *decode_flags) as (decode, _):
            first = post(
                prefill,
                "completions",
                body | {"max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}},
            )
            params = first.json()["kv_transfer_params"]
            with httpx.stream(
                "POST",
                f"{decode}/v1/completions",
                json=body | {"stream": True, "kv_transfer_params": params},
                timeout=120,
            ) as r:
                events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
            assert events[-1] == "[DONE]"
            assert "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1]) == expected


def test_streamed_decode(glm_dir):
    streamed_handover(glm_dir, [])


def test_what_cannot_work_is_a_clean_error(glm_dir):
    body = BODIES["completions"]
    with running(glm_dir) as (plain, _):
        reply = post(plain, "completions", body | {"kv_transfer_params": {"do_remote_decode": True}})
        assert reply.status_code == 400 and "--kv-transfer-config" in reply.json()["error"]["message"]
    with running(glm_dir, "--kv-transfer-config", PREFILL) as (prefill, p):
        with running(glm_dir, "--kv-transfer-config", DECODE) as (decode, _):
            wrong_role = post(
                decode, "completions", body | {"kv_transfer_params": {"do_remote_decode": True}}
            )
            assert wrong_role.status_code == 400 and "kv_consumer" in wrong_role.text
            streamed = post(
                prefill,
                "completions",
                body | {"stream": True, "kv_transfer_params": {"do_remote_decode": True}},
            )
            assert streamed.status_code == 400
            nonsense = post(decode, "completions", body | {"kv_transfer_params": {"do_remote_prefill": True}})
            assert nonsense.status_code == 400 and nonsense.json()["error"]["param"] == "kv_transfer_params"
            first = post(
                prefill,
                "completions",
                body | {"max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}},
            )
            params = first.json()["kv_transfer_params"]
            expired = post(
                decode,
                "completions",
                body | {"kv_transfer_params": params | {"lease_expires": time.time() - 1}},
            )
            assert expired.status_code == 503 and "lease" in expired.json()["error"]["message"]
            other_prompt = post(
                decode, "completions", body | {"prompt": PROMPT + " and more", "kv_transfer_params": params}
            )
            assert other_prompt.status_code == 400 and "tokens" in other_prompt.json()["error"]["message"]
            assert text_of(post(decode, "completions", body | {"kv_transfer_params": params}))  # still served
