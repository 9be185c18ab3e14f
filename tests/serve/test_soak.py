"""Soak: 200 concurrent streams on a cache small enough that requests wait and get preempted, a
quarter of them left mid-stream by their clients, hostile requests beside them; nothing is lost or
crossed, and the server ends healthy and idle.

The real engine (tiny GLM-5, float32) is conftest's small server: 16 slots and 12 pages of 8 tokens,
a quarter of what 16 growing requests need, so admission stops at the pages and decodes preempt.
The engine is held until all 200 requests are in flight, so every run starts from the same queue.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import numpy as np

from tests.serve.conftest import WAIT_S, EngineControl, until, wait_until

NUM_STREAMS, NUM_CANCELLED, NUM_COMPARED = 200, 50, 30
BOUND_S = 3 * WAIT_S  # the whole soak; a stream may wait that long for its first token (cold compiles)


def requests(vocab: int) -> list[dict]:
    """Prompts of 9-16 random token ids (past the indexer's 8 keys: sparse steps only), 6-12 tokens
    each, within the 32-token context; even ones greedy, odd ones seeded."""
    rng = np.random.default_rng(13)
    bodies = []
    for i in range(NUM_STREAMS):
        body = {
            "model": "small",
            "prompt": rng.integers(0, vocab, int(rng.integers(9, 17))).tolist(),
            "max_tokens": int(rng.integers(6, 13)),
            "ignore_eos": True,
        }
        body |= {"temperature": 0.0} if i % 2 == 0 else {"temperature": 1.0, "seed": i}
        bodies.append(body)
    return bodies


async def stream(client: httpx.AsyncClient, body: dict, *, leave_early: bool) -> dict:
    """A streamed completion's text and finish reason; with ``leave_early`` the client reads the
    first event (the echoed prompt, sent before any generated text) and leaves."""
    body = body | {"stream": True} | ({"echo": True} if leave_early else {})
    text, finish, done = "", None, False
    async with client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                break
            event = json.loads(line[len("data: ") :])
            assert "error" not in event, event
            if leave_early:
                return {"left": True}
            text += event["choices"][0]["text"]
            finish = event["choices"][0]["finish_reason"] or finish
    return {"text": text, "finish_reason": finish, "done": done}


HOSTILE = [
    {"model": "small", "prompt": [5, 2**31 + 7], "max_tokens": 4},  # an id past int32
    {"model": "small", "prompt": [5, 2**64 + 7], "max_tokens": 4},  # past int64
    {"model": "small", "prompt": [-1, 5], "max_tokens": 4},
    {"model": "small", "prompt": "x", "max_tokens": 4, "min_tokens": 1, "stop_token_ids": [2147483653]},
    {"model": "small", "prompt": "x", "max_tokens": 4, "logit_bias": {str(2**63): 5}},
    {"model": "small", "prompt": "x", "max_tokens": 4, "top_k": "many"},  # not a number
    {"model": "small", "prompt": ["x", 5], "max_tokens": 4},
    {"model": "small", "prompt": "x", "seed": 2**64},
    '{"model": "small", "prompt": "x", "max_tok',  # truncated JSON
    '{"model": "small", "prompt": "x", "temperature": NaN}',
]


async def hostile(client: httpx.AsyncClient, body) -> int:
    content = body if isinstance(body, str) else json.dumps(body)
    r = await client.post("/v1/completions", content=content, headers={"Content-Type": "application/json"})
    return r.status_code


def test_soak(small_server, monkeypatch):
    url, srv = small_server
    bodies = requests(srv.context.vocab_size)
    cancelled = set(range(0, NUM_STREAMS, NUM_STREAMS // NUM_CANCELLED))
    unrelated = {"model": "small", "prompt": list(range(100, 116)), "max_tokens": 12, "ignore_eos": True}
    unrelated |= {"temperature": 0.0}  # unseeded sampling would differ run to run (request-id seeds)
    control = EngineControl(srv.engine, monkeypatch)

    async def soak():
        limits = httpx.Limits(max_connections=NUM_STREAMS + 20)
        async with httpx.AsyncClient(base_url=url, limits=limits, timeout=BOUND_S) as client:
            control.hold_when(lambda engine: True)  # until every stream is in: the same queue each run
            streams = [
                asyncio.ensure_future(stream(client, b, leave_early=i in cancelled))
                for i, b in enumerate(bodies)
            ]
            await until(lambda: srv.engine.num_in_flight == NUM_STREAMS, "every stream in flight")
            control.release()
            beside = asyncio.ensure_future(client.post("/v1/completions", json=unrelated))
            statuses = await asyncio.gather(*(hostile(client, b) for b in HOSTILE))
            results = await asyncio.gather(*streams)
            return results, statuses, (await beside).json()

    results, statuses, beside = asyncio.run(asyncio.wait_for(soak(), BOUND_S))
    control.release()

    assert statuses == [400] * len(HOSTILE)
    assert all(results[i] == {"left": True} for i in cancelled)
    finished = [i for i in range(NUM_STREAMS) if i not in cancelled]
    for i in finished:
        r = results[i]
        assert r["done"] and r["finish_reason"] == "length", (i, r)

    def alone(body: dict) -> str:
        return httpx.post(f"{url}/v1/completions", json=body, timeout=WAIT_S).json()["choices"][0]["text"]

    compared = finished[:NUM_COMPARED]
    assert [results[i]["text"] for i in compared] == [alone(bodies[i]) for i in compared]
    assert beside["choices"][0]["text"] == alone(unrelated)

    health = httpx.get(f"{url}/health", timeout=WAIT_S)
    assert health.status_code == 200 and health.json() == {"status": "ok"}
    metrics = {}

    def idle() -> bool:
        text = httpx.get(f"{url}/metrics", timeout=WAIT_S).text
        metrics.update(
            (k, float(v))
            for k, v in (
                line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#")
            )
        )
        return metrics["jaxdsa:num_requests_running"] == 0 and metrics["jaxdsa:kv_cache_pages_used"] == 0

    wait_until(idle, "no running requests and no pages held")
    assert metrics["jaxdsa:num_requests_waiting"] == 0
    assert metrics["jaxdsa:num_preemptions_total"] > 0 and metrics["jaxdsa:failed_steps_total"] == 0
