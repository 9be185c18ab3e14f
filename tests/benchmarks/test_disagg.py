"""benchmarks/disagg.py's accounting on made-up timelines (which gaps count as "long prompts in
flight", the TTFT of the long requests, the transfer counters read from a Prometheus page) and its
workload against a stand-in server that streams at a fixed pace."""

from __future__ import annotations

import argparse
import asyncio
import math

from fastapi import FastAPI
from fastapi.responses import StreamingResponse

from benchmarks.disagg import (
    Timeline,
    itl_split,
    metric_values,
    random_prompts,
    summarize,
    transfer_row,
    workload,
)
from tests.serve.conftest import serving, wait_until


def test_gaps_split_by_the_long_requests_windows():
    stream = Timeline(sent=0.0, chunks=[1.0, 1.01, 1.02, 1.52, 1.53, 3.0, 3.01])
    long = Timeline(sent=1.4, chunks=[1.6, 1.7])  # in flight 1.4 .. 1.7
    during, outside = itl_split([stream], [long])
    assert [round(g) for g in during] == [500, 10]  # the gaps ending at 1.52 and 1.53
    assert [round(g) for g in outside] == [10, 10, 1470, 10]


def test_summary_row():
    streams = [Timeline(sent=0.0, chunks=[0.5, 0.6, 0.7, 1.9]), Timeline(sent=0.0, chunks=[7.0, 7.1])]
    longs = [Timeline(sent=1.0, chunks=[1.8, 2.0]), Timeline(sent=3.0, error="HTTP 503: no pages")]
    row = summarize({"streams": streams, "longs": longs}, settle_s=5.0)
    assert math.isclose(row["ITL max ms (long prompts in flight)"], 1200.0)
    assert row["gaps (in flight / otherwise)"] == "1 / 3"
    assert math.isclose(row["long TTFT mean ms"], 800.0)
    assert row["failed"] == 1
    assert row["streams not decoding when the first long prompt came"] == 1


def test_no_long_request_finished():
    row = summarize({"streams": [Timeline(sent=0.0, chunks=[0.1, 0.2])], "longs": []}, settle_s=1.0)
    assert math.isnan(row["long TTFT mean ms"]) and math.isnan(row["ITL p99 ms (long prompts in flight)"])


def test_transfer_counters_from_metrics_page():
    page = "\n".join(
        [
            "# HELP jaxdsa:kv_transfer_received_total caches read",
            "# TYPE jaxdsa:kv_transfer_received_total counter",
            "jaxdsa:kv_transfer_received_total 4.0",
            'jaxdsa:kv_transfer_received_bytes_total{model="m"} 2e8',
            "jaxdsa:kv_transfer_receive_seconds_total 0.1",
            "jaxdsa:kv_transfer_failed_total 0.0",
            "jaxdsa:requests_total 9.0",
        ]
    )
    values = metric_values(page, "jaxdsa:kv_transfer_")
    assert values == {"received_total": 4.0, "received_bytes_total": 2e8, "receive_seconds_total": 0.1,
                      "failed_total": 0.0}  # fmt: skip
    row = transfer_row(values)
    assert row["transfers"] == 4 and math.isclose(row["transfer MB per request"], 50.0)
    assert math.isclose(row["transfer ms per request"], 25.0) and math.isclose(row["transfer GB/s"], 2.0)
    assert math.isnan(transfer_row({})["transfer GB/s"])


def test_prompts_avoid_the_vocabularys_ends():
    prompts = random_prompts(3, 50, vocab=1000, seed=0)
    assert len(prompts) == 3 and all(len(p) == 50 for p in prompts)
    assert min(map(min, prompts)) >= 100 and max(map(max, prompts)) < 900
    assert prompts != random_prompts(3, 50, vocab=1000, seed=1)


def _paced_server() -> FastAPI:
    """A stand-in OpenAI server: every completion streams one token chunk each 5 ms, up to its
    ``max_tokens``, and remembers which streams its clients closed early."""
    app = FastAPI()
    app.state.closed = 0

    @app.post("/v1/completions")
    async def completions(body: dict):
        async def chunks():
            try:
                for _ in range(body["max_tokens"]):
                    await asyncio.sleep(0.005)
                    yield 'data: {"choices": [{"text": "x"}]}\n\n'
                yield "data: [DONE]\n\n"
            except asyncio.CancelledError:
                app.state.closed += 1
                raise

        return StreamingResponse(chunks(), media_type="text/event-stream")

    return app


def test_workload_closes_the_streams_after_the_long_prompts():
    """Against the stand-in: the long requests get all their tokens, the streams are closed once they
    end (long before their 100,000 tokens), and every stream's gaps fall on both sides."""
    args = argparse.Namespace(
        streams=3, stream_input=4, stream_output=100_000, long_prompts=2, long_len=8, long_output=5,
        long_interval=0.1, settle=0.2, tail=0.1, request_timeout=30,
    )  # fmt: skip
    app = _paced_server()
    with serving(app) as url:
        timelines = asyncio.run(workload(url, "m", args, vocab=1000))
        wait_until(lambda: app.state.closed == 3, "the streams to close")
    assert [len(line.chunks) for line in timelines["longs"]] == [5, 5]
    assert all(20 < len(line.chunks) < 10_000 and not line.error for line in timelines["streams"])
    row = summarize(timelines, settle_s=args.settle)
    during, outside = map(int, row["gaps (in flight / otherwise)"].split(" / "))
    assert during > 0 and outside > 0 and row["failed"] == 0
