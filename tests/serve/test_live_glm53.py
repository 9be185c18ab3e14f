"""``python -m serve`` on a tiny GLM-5.3-Flash checkpoint (``make_tiny --family glm5_next``), driven by the
``openai`` client: GLM's chat template and parsers on the hybrid KDA / DSA model's engine.

One server subprocess for the module, started the way it is deployed (``--port 0``). Steps of at most
32 tokens keep the compiled shapes few; replies are checked against the raw completion of the same
prompt, streaming against the whole reply, and eight requests at once against the same eight one by
one (each sequence's KDA state and rings must stay its own).
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys

import openai
import pytest

from jaxdsa.checkpoints.tiny.make import make_tiny
from tests.serve.conftest import ROOT, wait_ready

pytestmark = pytest.mark.slow  # GLM-5.3 served live; the live server: tests/serve/test_live.py

ARGS = [
    "--served-model-name", "tiny-glm53", "--host", "127.0.0.1", "--port", "0", "--dtype", "float32",
    "--max-model-len", "512", "--max-num-seqs", "8", "--max-num-batched-tokens", "32", "--page-size", "16",
    "--reasoning-parser", "glm45", "--tool-call-parser", "glm47", "--enable-auto-tool-choice",
]  # fmt: skip
GREEDY = {"model": "tiny-glm53", "temperature": 0.0, "max_tokens": 12}
PROMPTS = [
    "Hello there",
    "What is 2 + 2?",
    "你好，世界",
    "Tell me a story.",
    "Paris",
    "😀 🚀",
    "def f():",
    "Hi",
]


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    model = make_tiny(
        "glm5_next",
        tmp_path_factory.mktemp("serve-glm53"),
        seed=0,
        overrides={"max_position_embeddings": 512},
    )
    log_path = tmp_path_factory.mktemp("live-glm53") / "server.log"
    argv = [sys.executable, "-m", "serve", model, *ARGS]
    with (
        open(log_path, "w+") as log,
        subprocess.Popen(argv, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT) as proc,
    ):
        try:
            url = wait_ready(proc, log_path)
            yield openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0), url
        finally:
            proc.send_signal(signal.SIGINT)
            assert proc.wait(timeout=60) == 0, log_path.read_text()


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def text_of(message) -> tuple:
    return getattr(message, "reasoning_content", None), message.content


def test_chat_streamed_equals_whole(client):
    client, _ = client
    whole = client.chat.completions.create(messages=user("Tell me a story."), **GREEDY)
    assert whole.choices[0].finish_reason in ("stop", "length") and whole.usage.completion_tokens <= 12
    chunks = list(client.chat.completions.create(messages=user("Tell me a story."), stream=True, **GREEDY))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    reasoning, content = text_of(whole.choices[0].message)
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == (reasoning or "")
    assert "".join(d.content or "" for d in deltas) == (content or "")


def test_concurrent_requests_equal_sequential_ones(client):
    client, url = client

    async def together() -> list[tuple]:
        async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0) as aclient:
            replies = await asyncio.gather(
                *(aclient.chat.completions.create(messages=user(p), **GREEDY) for p in PROMPTS)
            )
            return [text_of(r.choices[0].message) for r in replies]

    concurrent = asyncio.run(together())
    sequential = [
        text_of(client.chat.completions.create(messages=user(p), **GREEDY).choices[0].message)
        for p in PROMPTS
    ]
    assert concurrent == sequential
