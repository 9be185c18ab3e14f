"""``python -m serve`` on a tiny DeepSeek-V4 checkpoint (``jaxdsa.checkpoints.make_tiny``), driven by the
``openai`` client: the V4 chat encoding and the ``deepseek_v4`` reasoning and tool-call parsers on a
real engine.

One server subprocess for the module, started the way it is deployed (``--port 0``; the URL comes
from its "ready" line). The engine geometry keeps the compiled step shapes few (steps of at most 32
tokens: buckets 1 to 32, compiled at start-up by the warm-up) and the context just long enough for
the tools prompt. Replies are checked against the raw completion of the same prompt ids parsed by
``jaxdsa.serve.deepseek_v4_encoding.parse_completion`` and against the prompt the encoder renders. A tiny
random model never writes a DSML block, so tool calls themselves are parsed from scripted text
(``test_parsers.py``, ``test_app.py::test_deepseek_v4_reasoning_and_dsml_tool_calls``); here the
tools prompt and the parsers run on what the model does write.
"""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys

import openai
import pytest

from jaxdsa.serve import deepseek_v4_encoding as v4
from jaxdsa.serve.tokenizer import Tokenizer
from tests.serve.conftest import ROOT, TOOLS, wait_ready

pytestmark = pytest.mark.slow  # V4 served live; the live server: tests/serve/test_live.py

ARGS = [
    "--served-model-name", "tiny-v4", "--host", "127.0.0.1", "--port", "0", "--dtype", "float32",
    "--max-model-len", "1024", "--max-num-seqs", "8", "--max-num-batched-tokens", "32", "--page-size", "16",
    "--reasoning-parser", "deepseek_v4", "--tool-call-parser", "deepseek_v4", "--enable-auto-tool-choice",
]  # fmt: skip
MAX_TOKENS = 16
GREEDY = {"temperature": 0.0, "max_tokens": MAX_TOKENS}
RAW = {"skip_special_tokens": False}  # special tokens stay in the text, so it can be parsed like the raw one
PROMPTS = [
    "Hello there",
    "What is 2 + 2?",
    "你好，世界",
    "Tell me a story.",
    "The weather in Paris",
    "Emoji: 😀 🚀",
    "def add(a, b):",
    "Good morning",
]


class Server:
    def __init__(self, url: str, model_dir: str):
        self.url, self.tok = url, Tokenizer(model_dir)
        self.client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)

    def prompt_ids(self, messages, mode: str = "thinking", **kwargs) -> list[int]:
        """What the server should feed the engine for these messages."""
        return self.tok.encode(v4.encode_messages(messages, mode, **kwargs))

    def raw(self, ids: list[int]) -> str:
        """The greedy completion of these prompt ids, special tokens kept."""
        r = self.client.completions.create(model="tiny-v4", prompt=ids, extra_body=RAW, **GREEDY)
        return r.choices[0].text


@pytest.fixture(scope="module")
def server(dsv4_dir, tmp_path_factory):
    log_path = tmp_path_factory.mktemp("live-v4") / "server.log"
    argv = [sys.executable, "-m", "serve", dsv4_dir, *ARGS]
    with (
        open(log_path, "w+") as log,
        subprocess.Popen(argv, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT) as proc,
    ):
        try:
            yield Server(wait_ready(proc, log_path), dsv4_dir)
        finally:
            proc.send_signal(signal.SIGINT)
            assert proc.wait(timeout=60) == 0, log_path.read_text()


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def reply(message) -> tuple:
    calls = [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or ()]
    return getattr(message, "reasoning_content", None), message.content, calls


def parsed(text: str, mode: str) -> tuple:
    p = v4.parse_completion(text, mode)
    calls = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in p.tool_calls]
    return p.reasoning_content, p.content or (None if calls else ""), calls


def test_chat_thinking_by_default_and_chat_mode(server):
    """Thinking is on by default (the prompt opens <think>); thinking off gives no reasoning; each
    reply is the raw completion of the encoder's prompt, split by the V4 parser."""
    for mode, extra in (("thinking", {}), ("chat", {"chat_template_kwargs": {"thinking": False}})):
        r = server.client.chat.completions.create(
            model="tiny-v4", messages=user("Hello there"), extra_body={**RAW, **extra}, **GREEDY
        )
        ids = server.prompt_ids(user("Hello there"), mode)
        assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens <= MAX_TOKENS
        assert r.choices[0].finish_reason in ("stop", "length")
        assert reply(r.choices[0].message) == parsed(server.raw(ids), mode)
        if mode == "chat":
            assert r.choices[0].message.reasoning_content is None


def test_reasoning_effort_max_adds_the_prefix(server):
    r = server.client.chat.completions.create(
        model="tiny-v4", messages=user("Hello there"), reasoning_effort="max", **GREEDY
    )
    ids = server.prompt_ids(user("Hello there"), reasoning_effort="max")
    assert r.usage.prompt_tokens == len(ids) > len(server.prompt_ids(user("Hello there")))


def test_streamed_equals_non_streamed(server):
    kwargs = dict(model="tiny-v4", messages=user("Tell me a story."), **GREEDY)
    whole = server.client.chat.completions.create(**kwargs)
    chunks = list(
        server.client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs)
    )
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    m = whole.choices[0].message
    assert m.reasoning_content is not None
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == m.reasoning_content
    assert "".join(d.content or "" for d in deltas) == m.content
    assert chunks[-1].usage.model_dump() == whole.usage.model_dump()


def test_concurrent_requests_equal_sequential_ones(server):
    async def one(client: openai.AsyncOpenAI, prompt: str) -> tuple:
        r = await client.chat.completions.create(model="tiny-v4", messages=user(prompt), **GREEDY)
        return reply(r.choices[0].message)

    async def together() -> list[tuple]:
        async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0) as client:
            return await asyncio.gather(*(one(client, p) for p in PROMPTS))

    concurrent = asyncio.run(together())
    sequential = [
        reply(
            server.client.chat.completions.create(model="tiny-v4", messages=user(p), **GREEDY)
            .choices[0]
            .message
        )
        for p in PROMPTS
    ]
    assert concurrent == sequential


def test_tool_request_and_tool_result_history(server):
    """The tools block goes into the prompt, the tool-call parser reads what the model writes (as
    the raw completion parses), and a history with a call and its result renders as the encoder's."""
    messages = user("Weather in Paris?")
    r = server.client.chat.completions.create(
        model="tiny-v4", messages=messages, tools=TOOLS, extra_body=RAW, **GREEDY
    )
    ids = server.prompt_ids(messages, tools=TOOLS)
    assert r.usage.prompt_tokens == len(ids)
    assert reply(r.choices[0].message) == parsed(server.raw(ids), "thinking")
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
    }
    history = messages + [
        {"role": "assistant", "content": "", "reasoning_content": "Look it up.", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21°C"},
    ]
    r = server.client.chat.completions.create(model="tiny-v4", messages=history, tools=TOOLS, **GREEDY)
    assert r.usage.prompt_tokens == len(server.prompt_ids(history, tools=TOOLS))
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
