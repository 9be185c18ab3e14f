"""The real server (tiny GLM-5 checkpoint, real engine) on 127.0.0.1, driven by the ``openai`` client.

One module-scoped server, built by the same ``jaxdsa.serve.cli.build`` as ``python -m serve``, with the
engine defaults (16 sequences, pages of 64, 512-token steps) but a 256-token context, which the
length-limit tests below rely on (the bundled model's is 4,096: ``test_cli``'s Quick start test
serves that), and ``--max-queue-len 0`` so that 17 requests in flight hit HTTP 429.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys

import httpx
import jax
import openai
import pytest

from jaxdsa.engine.engine import enable_compilation_cache
from jaxdsa.serve import bench
from jaxdsa.serve.cli import build, parse_args
from tests.serve.conftest import ROOT, EngineControl, serving, until, wait_ready, wait_until

ARGS = [
    "--served-model-name", "tiny", "--host", "127.0.0.1", "--max-model-len", "256", "--max-num-seqs", "16",
    "--max-queue-len", "0", "--reasoning-parser", "glm45", "--tool-call-parser", "glm47",
    "--enable-auto-tool-choice", "--no-warmup",
]  # fmt: skip
GREEDY = {"temperature": 0.0}
PROMPTS = [
    "The quick brown fox",
    "Hello! How are you today?",
    "你好，世界",
    "Sparse attention selects the most relevant keys",
    "def add(a: int, b: int) -> int:",
    "Emoji: 😀 🚀",
    "The weather in Paris is mild in spring",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 42",
    "Café, naïve, façade",
    "SELECT name FROM users",
    "Good morning, good evening",
    "Привет, как дела?",
    "In 1969, two astronauts walked on the Moon",
    "Please write a short summary",
    "We should test the tokenizer",
    "for i in range(10):",
]


class Live:
    def __init__(self, url: str, server):
        self.url, self.server = url, server
        self.client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)

    def aclient(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0)

    def metrics(self) -> dict[str, float]:
        text = httpx.get(f"{self.url}/metrics").text
        return {
            k: float(v)
            for k, v in (
                line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#")
            )
        }

    def wait_idle(self) -> dict[str, float]:
        """Metrics once nothing runs and no cache page is held."""
        m = {}

        def idle() -> bool:
            m.update(self.metrics())
            return (
                m["jaxdsa:num_requests_running"] == 0
                and m["jaxdsa:num_requests_waiting"] == 0
                and m["jaxdsa:kv_cache_pages_used"] == 0
            )

        wait_until(idle, "the engine to be idle")
        return m


@pytest.fixture(scope="module")
def live(glm_dir):
    server = build(parse_args([glm_dir, *ARGS]))
    with serving(server.app) as url:
        yield Live(url, server)
    server.engine.shutdown()


@pytest.fixture
def control(live, monkeypatch):
    control = EngineControl(live.server.engine, monkeypatch)
    yield control
    control.release()  # before monkeypatch restores the engine: its thread may be held


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def test_models(live):
    models = live.client.models.list().data
    assert [m.id for m in models] == ["tiny"] and models[0].max_model_len == 256


def test_chat_streamed_equals_non_streamed(live):
    kwargs = dict(model="tiny", messages=user("Tell me a story."), max_tokens=24, **GREEDY)
    whole = live.client.chat.completions.create(**kwargs)
    chunks = list(
        live.client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs)
    )
    m = whole.choices[0].message
    assert m.reasoning_content is not None  # thinking is on by default: the reply starts in <think>
    assert (
        "".join(getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in chunks if c.choices)
        == m.reasoning_content
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == m.content
    assert chunks[-1].usage.model_dump() == whole.usage.model_dump()
    assert whole.usage.completion_tokens <= 24 and whole.choices[0].finish_reason in ("stop", "length")


def test_completions_streamed_equals_non_streamed(live):
    ids = httpx.post(f"{live.url}/tokenize", json={"prompt": "The quick brown fox"}).json()["tokens"]
    for prompt in ("The quick brown fox", ids):
        whole = live.client.completions.create(model="tiny", prompt=prompt, max_tokens=20, **GREEDY)
        text = "".join(
            c.choices[0].text
            for c in live.client.completions.create(
                model="tiny", prompt=prompt, max_tokens=20, stream=True, **GREEDY
            )
        )
        assert text == whole.choices[0].text
        assert whole.usage.prompt_tokens == len(ids) and whole.usage.completion_tokens == 20
        assert whole.choices[0].finish_reason == "length"


def test_logprobs_of_greedy_tokens_are_the_top_ones(live):
    kwargs = dict(
        model="tiny",
        messages=user("Tell me a story."),
        max_tokens=12,
        logprobs=True,
        top_logprobs=4,
        **GREEDY,
    )
    whole = live.client.chat.completions.create(**kwargs)
    content = whole.choices[0].logprobs.content
    assert len(content) == whole.usage.completion_tokens
    for e in content:
        top = [t.logprob for t in e.top_logprobs]
        assert (
            (e.top_logprobs[0].token, top[0]) == (e.token, e.logprob)
            and top == sorted(top, reverse=True)
            and top[0] <= 0
        )
    chunks = live.client.chat.completions.create(stream=True, **kwargs)
    streamed = [
        e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content
    ]
    assert [e.model_dump() for e in streamed] == [e.model_dump() for e in content]
    legacy = (
        live.client.completions.create(
            model="tiny", prompt="The quick brown fox", max_tokens=6, logprobs=3, **GREEDY
        )
        .choices[0]
        .logprobs
    )
    assert len(legacy.tokens) == 6 and all(
        lp == max(top.values()) for lp, top in zip(legacy.token_logprobs, legacy.top_logprobs)
    )


def test_echo_logprobs_score_the_prompt(live):
    ids = httpx.post(f"{live.url}/tokenize", json={"prompt": "Sparse attention selects keys"}).json()[
        "tokens"
    ]
    r = live.client.completions.create(
        model="tiny", prompt=ids, max_tokens=1, echo=True, logprobs=2, **GREEDY
    ).choices[0]
    lp = r.logprobs
    assert len(lp.tokens) == len(ids) + 1 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(
        v <= 0 and max(top.values()) >= v for v, top in zip(lp.token_logprobs[1:], lp.top_logprobs[1:])
    )
    assert lp.token_logprobs[-1] == max(lp.top_logprobs[-1].values())  # the greedy token is the top one
    assert r.text.startswith(httpx.post(f"{live.url}/detokenize", json={"tokens": ids}).json()["prompt"])


def test_n_seeded_choices_are_the_requests_with_seeds_seed_plus_j(live):
    kwargs = dict(
        model="tiny",
        prompt="The weather in Paris",
        max_tokens=8,
        temperature=1.0,
        extra_body={"ignore_eos": True},
    )
    both = live.client.completions.create(n=2, seed=40, **kwargs)
    alone = [live.client.completions.create(seed=40 + j, **kwargs).choices[0].text for j in range(2)]
    assert [c.text for c in both.choices] == alone and alone[0] != alone[1]
    assert both.usage.completion_tokens == 16


def test_reasoning_split_matches_the_raw_text(live):
    """reasoning_content + </think> + content is exactly what the model wrote after the prompt."""
    ids = httpx.post(f"{live.url}/tokenize", json={"messages": user("Why is the sky blue?")}).json()["tokens"]
    raw = (
        live.client.completions.create(
            model="tiny", prompt=ids, max_tokens=32, extra_body={"skip_special_tokens": False}, **GREEDY
        )
        .choices[0]
        .text
    )
    m = (
        live.client.chat.completions.create(
            model="tiny",
            messages=user("Why is the sky blue?"),
            max_tokens=32,
            extra_body={"skip_special_tokens": False},
            **GREEDY,
        )
        .choices[0]
        .message
    )
    reasoning, sep, content = raw.partition("</think>")
    assert (m.reasoning_content, m.content) == (reasoning, content)

    off = {"chat_template_kwargs": {"enable_thinking": False}}
    ids = httpx.post(f"{live.url}/tokenize", json={"messages": user("Hi")}).json()["tokens"]
    m = (
        live.client.chat.completions.create(
            model="tiny", messages=user("Hi"), max_tokens=16, extra_body=off, **GREEDY
        )
        .choices[0]
        .message
    )
    assert m.reasoning_content is None
    ids_off = live.client.chat.completions.create(
        model="tiny", messages=user("Hi"), max_tokens=1, extra_body=off
    ).usage.prompt_tokens
    assert ids_off == len(ids)  # "<think>" and "</think>" are one token each


def test_stop_string(live):
    text = (
        live.client.completions.create(model="tiny", prompt="Hello! How are you", max_tokens=24, **GREEDY)
        .choices[0]
        .text
    )
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    expected = text[: text.index(stop)]
    for stream in (False, True):
        r = live.client.completions.create(
            model="tiny", prompt="Hello! How are you", max_tokens=24, stop=[stop], stream=stream, **GREEDY
        )
        got = "".join(c.choices[0].text for c in r) if stream else r.choices[0].text
        assert got == expected
    live.wait_idle()


def test_concurrent_requests_equal_sequential_ones(live):
    async def one(client: openai.AsyncOpenAI, prompt: str) -> str:
        r = await client.completions.create(model="tiny", prompt=prompt, max_tokens=8, **GREEDY)
        return r.choices[0].text

    async def together() -> list[str]:
        client = live.aclient()
        return await asyncio.gather(*(one(client, p) for p in PROMPTS))

    concurrent = asyncio.run(together())
    sequential = [
        live.client.completions.create(model="tiny", prompt=p, max_tokens=8, **GREEDY).choices[0].text
        for p in PROMPTS
    ]
    assert concurrent == sequential


def test_cancelled_stream_frees_its_pages(live, control):
    """The engine holds after the request's first token (the stream has begun: its headers come
    after that token), so the request is surely running, with its pages, when the client leaves,
    and is released once the abort has arrived. The engine thread reads its commands before each
    step: the abort stops the request before the held step or right after it, depending on whether
    it came before the thread last read them, so one or two tokens, never more."""
    before = live.metrics()["jaxdsa:generation_tokens_total"]
    control.hold_when(lambda engine: any(r.output for r in engine.requests.values()))
    stream = live.client.completions.create(
        model="tiny", prompt="Once upon a time", max_tokens=240, stream=True, extra_body={"ignore_eos": True}
    )
    assert live.metrics()["jaxdsa:kv_cache_pages_used"] > 0
    stream.close()
    control.wait_for_aborts(1)
    control.release()
    after = live.wait_idle()["jaxdsa:generation_tokens_total"]
    assert 1 <= after - before <= 2


def test_disconnected_non_streaming_request_is_aborted(live, control):
    """The engine holds before the request's first step; the client leaves; the server aborts it."""
    before = live.metrics()["jaxdsa:generation_tokens_total"]
    control.hold_when(lambda engine: bool(engine.requests))
    body = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 240, "ignore_eos": True}

    async def leave_early() -> None:
        async with httpx.AsyncClient(timeout=60) as client:
            post = asyncio.ensure_future(client.post(f"{live.url}/v1/completions", json=body))
            await until(lambda: live.server.engine.num_in_flight == 1, "the request to reach the engine")
            post.cancel()  # the client leaves: its connection closes
            await asyncio.gather(post, return_exceptions=True)

    asyncio.run(leave_early())
    control.wait_for_aborts(1)
    control.release()
    after = live.wait_idle()["jaxdsa:generation_tokens_total"]
    assert after - before <= 1  # the step it was held before; the abort came next


def test_queue_full_is_429_and_requests_in_flight_release_everything(live, control):
    """16 requests in flight (max_num_seqs + max_queue_len 0) while the engine holds: the 17th gets
    429 at once; the 16 clients leave and every slot and page comes back."""
    control.hold_when(lambda engine: True)

    async def scenario() -> None:
        client = live.aclient()
        held = [
            asyncio.ensure_future(
                client.completions.create(
                    model="tiny", prompt=p, max_tokens=200, stream=True, extra_body={"ignore_eos": True}
                )
            )
            for p in PROMPTS
        ]
        try:
            await until(lambda: live.server.engine.num_in_flight == len(PROMPTS), "16 requests in flight")
            with pytest.raises(openai.RateLimitError) as e:
                await client.completions.create(model="tiny", prompt="one too many", max_tokens=4)
            assert e.value.status_code == 429 and e.value.body["code"] == "queue_full"
        finally:
            for request in held:
                request.cancel()
            await asyncio.gather(*held, return_exceptions=True)
            await client.close()

    asyncio.run(scenario())
    control.wait_for_aborts(len(PROMPTS))
    control.release()
    live.wait_idle()


def test_client_errors(live):
    with pytest.raises(openai.BadRequestError) as e:
        live.client.chat.completions.create(model="tiny", messages=user("x"), max_tokens=300)
    assert e.value.body["code"] == "context_length_exceeded" and e.value.body["param"] == "max_tokens"
    with pytest.raises(openai.BadRequestError) as e:
        live.client.completions.create(model="tiny", prompt="word " * 300)
    assert e.value.body["param"] == "prompt"
    with pytest.raises(openai.BadRequestError) as e:
        live.client.chat.completions.create(model="tiny", messages=user("x"), temperature=-0.5)
    assert e.value.body["param"] == "temperature"
    with pytest.raises(openai.BadRequestError, match="outside the vocabulary") as e:
        live.client.completions.create(model="tiny", prompt=[10**6])
    assert e.value.body["param"] == "prompt"
    with pytest.raises(openai.NotFoundError):
        live.client.completions.create(model="not-served", prompt="x")
    r = httpx.post(
        f"{live.url}/v1/chat/completions", content=b"{", headers={"Content-Type": "application/json"}
    )
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"


def test_engine_failure_is_503_and_the_server_recovers(live, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("device lost")

    with monkeypatch.context() as m:
        m.setattr(live.server.engine.engine.runner, "launch", broken)
        with pytest.raises(openai.InternalServerError) as e:
            live.client.completions.create(model="tiny", prompt="x y z", max_tokens=4)
    assert e.value.status_code == 503 and "device lost" in e.value.message
    again = live.client.completions.create(
        model="tiny", prompt="x y z", max_tokens=4, extra_body={"ignore_eos": True}, **GREEDY
    )
    assert again.usage.completion_tokens == 4
    live.wait_idle()


def test_issue_13_bad_numbers_beside_a_running_request(live, control):
    """The issue's reproductions on the real engine: ``min_tokens: 1`` with stop id 2147483653 and
    ``/detokenize [-1]`` (which failed the engine step for every request in flight, or answered
    500) are 400s naming the field while a 100-token request runs beside them, and that request
    finishes with the text it has alone; ``top_k: 2^40`` samples as top-k off."""
    kwargs = dict(
        model="tiny", prompt="The weather in Paris", max_tokens=100, extra_body={"ignore_eos": True}, **GREEDY
    )
    alone = live.client.completions.create(**kwargs).choices[0].text
    failed_steps = live.metrics()["jaxdsa:failed_steps_total"]
    control.hold_when(lambda engine: any(r.output for r in engine.requests.values()))  # surely running
    stream = live.client.completions.create(stream=True, **kwargs)
    with pytest.raises(openai.BadRequestError) as e:
        live.client.completions.create(
            model="tiny",
            prompt="x",
            max_tokens=4,
            extra_body={"min_tokens": 1, "stop_token_ids": [2147483653]},
        )
    assert e.value.body["param"] == "stop_token_ids"
    r = httpx.post(f"{live.url}/detokenize", json={"tokens": [-1]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"
    control.release()
    assert "".join(c.choices[0].text for c in stream) == alone
    sampled = dict(model="tiny", prompt="x", max_tokens=8, temperature=1.0, seed=3)
    texts = [
        live.client.completions.create(**sampled, extra_body={"top_k": k, "ignore_eos": True}).choices[0].text
        for k in (1099511627776, 0)
    ]
    assert texts[0] == texts[1]
    assert live.wait_idle()["jaxdsa:failed_steps_total"] == failed_steps


def test_a_repeated_long_prompt_hits_the_prefix_cache(live):
    ids = httpx.post(f"{live.url}/tokenize", json={"prompt": " ".join(PROMPTS)}).json()["tokens"][
        :160
    ]  # 2.5 pages of 64
    before = live.metrics()["jaxdsa:prefix_cache_hits_total"]
    texts = [
        live.client.completions.create(model="tiny", prompt=ids, max_tokens=8, **GREEDY).choices[0].text
        for _ in range(2)
    ]
    assert texts[0] == texts[1]
    assert (
        live.metrics()["jaxdsa:prefix_cache_hits_total"] - before >= 128
    )  # the second request skipped two pages


def test_metrics(live):
    m = live.metrics()
    for name in (
        "jaxdsa:num_requests_running",
        "jaxdsa:num_requests_waiting",
        "jaxdsa:generation_tokens_total",
        "jaxdsa:kv_cache_usage_perc",
        "jaxdsa:time_to_first_token_seconds_count",
        "jaxdsa:prompt_tokens_total",
        "jaxdsa:prefix_cache_queries_total",
    ):
        assert name in m, name
    assert m["jaxdsa:time_to_first_token_seconds_count"] > 10 and m["jaxdsa:generation_tokens_total"] > 100
    assert m['jaxdsa:request_success_total{finished_reason="length"}'] > 0


def test_bench(live, tmp_path, capsys):
    out = tmp_path / "bench.json"
    bench.main(
        [
            "--url",
            live.url,
            "--concurrency",
            "1,4",
            "--input-len",
            "16",
            "--output-len",
            "8",
            "--num-prompts",
            "4",
            "--json",
            str(out),
            "--plot",
            str(tmp_path / "p.png"),
        ]
    )
    rows = json.loads(out.read_text())["results"]
    assert [r["concurrency"] for r in rows] == [1, 4] and all(r["failed"] == 0 for r in rows)
    assert all(r["output_throughput"] > 0 and r["ttft_ms"]["p99"] >= r["ttft_ms"]["median"] > 0 for r in rows)
    table = capsys.readouterr().out
    assert "out tok/s" in table and len(table.strip().splitlines()) == 3


def test_tensor_parallel_server_gives_the_same_text(live, glm_dir, tmp_path):
    """``--tensor-parallel-size 2`` on two (fake CPU) devices serves what the one-device server does."""
    enable_compilation_cache()
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=2")
    if jax.config.jax_compilation_cache_dir:
        env |= {
            "JAX_COMPILATION_CACHE_DIR": jax.config.jax_compilation_cache_dir,
            "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
        }
    argv = [sys.executable, "-m", "serve", glm_dir, *ARGS, "--port", "0", "--tensor-parallel-size", "2"]
    with (
        open(tmp_path / "tp.log", "w+") as log,
        subprocess.Popen(argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT) as proc,
    ):
        try:
            url = wait_ready(proc, tmp_path / "tp.log")
            tp = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
            for prompt in PROMPTS[:2]:
                expected = (
                    live.client.completions.create(model="tiny", prompt=prompt, max_tokens=8, **GREEDY)
                    .choices[0]
                    .text
                )
                assert (
                    tp.completions.create(model="tiny", prompt=prompt, max_tokens=8, **GREEDY).choices[0].text
                    == expected
                )
        finally:
            proc.send_signal(signal.SIGINT)
            assert proc.wait(timeout=60) == 0, (tmp_path / "tp.log").read_text()


def test_speculative_server_gives_the_same_replies(live, glm_dir):
    """``--speculative-config`` (MTP, 3 drafts): greedy chat replies, streamed and whole, through the
    reasoning and tool-call parsers, are the ones the server without it gives (tool calls over
    several tokens per step: ``test_parsers_read_several_tokens_per_step_alike``, whose tools block
    would not fit this server's 256 tokens); /metrics counts the drafts."""
    spec = build(
        parse_args([glm_dir, *ARGS, "--speculative-config", '{"method": "mtp", "num_speculative_tokens": 3}'])
    )
    try:
        with serving(spec.app) as url:
            client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
            for prompt in PROMPTS[:3]:
                kwargs = dict(model="tiny", messages=user(prompt), max_tokens=24, **GREEDY)
                for c in (live.client, client):
                    message = c.chat.completions.create(**kwargs).choices[0].message
                    chunks = [x for x in c.chat.completions.create(stream=True, **kwargs) if x.choices]
                    streamed = "".join(x.choices[0].delta.content or "" for x in chunks)
                    assert streamed == (message.content or "")
                    calls = [(t.function.name, t.function.arguments) for t in message.tool_calls or ()]
                    reply = (message.content, getattr(message, "reasoning_content", None), calls)
                    if c is live.client:
                        want = reply
                    else:
                        assert reply == want
            metrics = Live(url, spec).metrics()
            assert metrics["jaxdsa:spec_decode_num_draft_tokens_total"] > 0
            assert 'jaxdsa:spec_decode_num_accepted_tokens_per_pos_total{position="2"}' in metrics
    finally:
        spec.engine.shutdown()


def test_server_is_alive_after_everything(live):
    assert httpx.get(f"{live.url}/health").status_code == 200
    r = live.client.chat.completions.create(model="tiny", messages=user("still there?"), max_tokens=4)
    assert r.usage.completion_tokens >= 1
    live.wait_idle()
