"""``jaxdsa.LLM.generate`` with text and ``LLM.chat`` give what the server gives for the same request.

Live: one tiny GLM-5 ``LLM`` and one server built by ``jaxdsa.serve.cli.build`` over the same checkpoint,
both with the engine geometry of conftest's small server (so they share its compiled step shapes),
the server with the parsers ``LLM.chat`` uses for the family; greedy, a fixed ``max_tokens``.
Scripted: a random tiny model never writes a tool call, so the same scripted tokens go through
``LLM.chat`` (a synchronous stand-in for the engine) and through the server's chat route (conftest's
``ScriptedEngine``), which must agree on the prompt, the reasoning, the content and the calls.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import httpx
import numpy as np
import openai
import pytest

import jaxdsa
from jaxdsa.engine import SamplingParams as EngineSamplingParams
from jaxdsa.serve.app import create_app
from jaxdsa.serve.chat_format import DeepSeekChatFormat, DeepSeekV4ChatFormat
from jaxdsa.serve.cli import build, parse_args
from jaxdsa.serve.context import ServingContext
from tests.serve.conftest import SMALL_SERVER_ARGS, TOOLS, ScriptedEngine, serving

PARSERS = ["--reasoning-parser", "glm45", "--tool-call-parser", "glm47", "--enable-auto-tool-choice"]
GREEDY = jaxdsa.SamplingParams(temperature=0.0, max_tokens=12)
PROMPTS = ["Hello there", "The quick brown fox", "你好，世界"]
THINKING_OFF = [{"enable_thinking": False}, {"thinking": False}]


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


@pytest.fixture(scope="module")
def llm(glm_dir) -> jaxdsa.LLM:
    # the geometry of SMALL_SERVER_ARGS
    return jaxdsa.LLM(
        glm_dir, dtype="float32", max_model_len=32, max_num_seqs=16, max_num_batched_tokens=32,
        page_size=8, num_pages=12, progress=False,
    )  # fmt: skip


@pytest.fixture(scope="module")
def server(glm_dir):
    srv = build(parse_args([glm_dir, *SMALL_SERVER_ARGS, *PARSERS]))
    with serving(srv.app) as url:
        yield url, openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    srv.engine.shutdown()


def test_import_jaxdsa_pulls_in_neither_serve_nor_fastapi():
    code = (
        "import sys, jaxdsa;"
        " print(sorted(m for m in ('fastapi', 'jaxdsa.serve', 'pydantic') if m in sys.modules))"
    )
    assert (
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
        == "[]\n"
    )


# ---- live: the real engine, greedy -------------------------------------------------------------


def test_generate_text_equals_completions(llm, server):
    url, client = server
    outs = llm.generate(PROMPTS, GREEDY)
    r = client.completions.create(model="small", prompt=PROMPTS, max_tokens=12, temperature=0.0, logprobs=0)
    assert [o.prompt for o in outs] == PROMPTS
    for o, choice, prompt in zip(outs, r.choices, PROMPTS):
        assert o.prompt_token_ids == httpx.post(f"{url}/tokenize", json={"prompt": prompt}).json()["tokens"]
        (c,) = o.outputs
        assert (c.text, c.finish_reason) == (choice.text, choice.finish_reason)
        assert [llm.tokenizer.token_text(t) for t in c.token_ids] == choice.logprobs.tokens
    assert r.usage.completion_tokens == sum(len(o.outputs[0].token_ids) for o in outs)

    # A stop string ends the completion where the server's ends, on the same tokens.
    whole = outs[1].outputs[0]
    stop = whole.text[len(whole.text) // 2 :][:2]
    (c,) = llm.generate(PROMPTS[1], jaxdsa.SamplingParams(temperature=0.0, max_tokens=12, stop=stop))[
        0
    ].outputs
    r = client.completions.create(model="small", prompt=PROMPTS[1], max_tokens=12, temperature=0.0, stop=stop)
    assert (
        (c.text, c.finish_reason)
        == (r.choices[0].text, "stop")
        == (whole.text[: whole.text.index(stop)], "stop")
    )
    assert len(c.token_ids) == r.usage.completion_tokens < 12


def test_chat_equals_chat_completions(llm, server):
    url, client = server
    for kwargs in [None, *THINKING_OFF]:
        (o,) = llm.chat(user("Why is the sky blue?"), GREEDY, chat_template_kwargs=kwargs)
        extra = {"chat_template_kwargs": kwargs} if kwargs else {}
        r = client.chat.completions.create(
            model="small", messages=user("Why is the sky blue?"), max_tokens=12, temperature=0.0,
            logprobs=True, extra_body=extra,
        )  # fmt: skip
        (c,), m = o.outputs, r.choices[0].message
        assert (c.content, c.reasoning_content, c.tool_calls) == (m.content, m.reasoning_content, None)
        assert c.message == {
            "role": "assistant",
            "content": m.content,
            "reasoning_content": m.reasoning_content,
        }
        assert c.finish_reason == r.choices[0].finish_reason
        assert len(o.prompt_token_ids) == r.usage.prompt_tokens and o.prompt == llm.tokenizer.decode(
            o.prompt_token_ids, skip_special_tokens=False
        )
        assert [list(llm.tokenizer.token_bytes(t)) for t in c.token_ids] == [
            e.bytes for e in r.choices[0].logprobs.content
        ]
        assert (c.reasoning_content is None) == (kwargs is not None)  # thinking is on by default


def test_thinking_off_by_either_key_gives_one_prompt(llm):
    on, *off = [llm.chat(user("Hi"), GREEDY, chat_template_kwargs=k)[0] for k in [None, *THINKING_OFF]]
    assert off[0].prompt_token_ids == off[1].prompt_token_ids != on.prompt_token_ids
    assert off[0].prompt.endswith("<|assistant|></think>") and on.prompt.endswith("<|assistant|><think>")
    for fmt, default in ((DeepSeekChatFormat(), "off"), (DeepSeekV4ChatFormat(), "on")):
        prompts = [fmt.render(user("Hi"), kwargs=k) for k in [{}, *THINKING_OFF, {"thinking": True}]]
        assert prompts[1] == prompts[2] != prompts[3] and not prompts[1].thinking and prompts[3].thinking
        assert prompts[0] == (prompts[1] if default == "off" else prompts[3])


def test_token_id_prompts_keep_their_api(llm):
    ids = llm.tokenizer.encode("Hello there")
    tokens = llm.generate([ids, ids[:3]], max_new_tokens=6)
    assert isinstance(tokens, list) and [len(t) for t in tokens] == [6, 6] and isinstance(tokens[0][0], int)
    again, logits = llm.generate([ids], max_new_tokens=6, return_logits=True)
    assert again == tokens[:1] and np.asarray(logits[0]).shape == (6, llm.config.vocab_size)
    # the same request through the text path: the same tokens
    as_text = llm.generate([ids], EngineSamplingParams(max_tokens=6, ignore_eos=True))[0]
    assert as_text.prompt is None and as_text.outputs[0].token_ids == tokens[0]
    with pytest.raises(TypeError, match="by name"):
        llm.generate([ids], 6)
    with pytest.raises(ValueError, match="max_new_tokens: for token-id prompts only"):
        llm.generate(["Hello"], max_new_tokens=6)


# ---- scripted: the same reply tokens through LLM.chat and the server's chat route ---------------


class SyncScripted:
    """The synchronous engine calls ``LLM`` makes (add_request / step / abort / requests /
    max_model_len), answered by a :class:`ScriptedEngine`: one token per request per step."""

    def __init__(self, scripted: ScriptedEngine):
        self.scripted, self.max_model_len = scripted, scripted.max_model_len
        self.requests: dict = {}
        self._loop = asyncio.new_event_loop()

    def add_request(self, request_id, prompt, sampling, *, return_logits=False):
        self.requests[request_id] = self.scripted.generate(request_id, prompt, sampling)

    def step(self):
        outs = []
        for request_id, stream in list(self.requests.items()):
            outs.append(self._loop.run_until_complete(anext(stream)))
            if outs[-1].finished:
                self.abort(request_id)
        return outs

    def abort(self, request_id):
        stream = self.requests.pop(request_id, None)
        if stream is not None:
            self._loop.run_until_complete(stream.aclose())


REPLIES = [
    "The user wants weather.</think>Let me check."
    "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value></tool_call>",
    "Short.</think>No tools needed.",
]


def test_chat_parses_tool_calls_and_reasoning_as_the_server(llm, monkeypatch):
    tok = llm.tokenizer
    eos = sorted(llm.eos_token_ids)[0]
    scripts = [tok.encode(text) + [eos] for text in REPLIES]
    stub, scripted = ScriptedEngine(max_model_len=1024), ScriptedEngine(max_model_len=1024)
    stub.scripts, scripted.scripts = list(scripts), list(scripts)
    monkeypatch.setattr(llm, "_engine", SyncScripted(scripted))
    ctx = ServingContext(
        generate=stub.generate, stats=stub.stats, tokenizer=tok, chat_format=llm.chat_format,
        model_names=["stub"], max_model_len=1024, eos_token_ids=frozenset(llm.eos_token_ids),
        reasoning_parser=llm.reasoning_parser, tool_parser=llm.tool_call_parser, enable_auto_tool_choice=True,
        default_sampling=llm.default_sampling, vocab_size=llm.config.vocab_size,
    )  # fmt: skip
    requests = [(user("Weather in Paris?"), TOOLS, None), (user("Hi"), None, {"thinking": True})]
    got = []
    with serving(create_app(ctx)) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        for messages, tools, kwargs in requests:
            sp = jaxdsa.SamplingParams(max_tokens=64)
            (o,) = llm.chat(messages, sp, tools=tools, chat_template_kwargs=kwargs)
            r = client.chat.completions.create(
                model="stub", messages=messages, max_tokens=64, tools=tools or openai.NOT_GIVEN,
                extra_body={"chat_template_kwargs": kwargs},
            )  # fmt: skip
            assert o.prompt_token_ids == stub.prompts[-1] == scripted.prompts[-1]
            (c,), m = o.outputs, r.choices[0].message
            calls = [(t.function.name, json.loads(t.function.arguments)) for t in m.tool_calls or ()]
            assert c.tool_calls is None or [t["id"] for t in c.tool_calls] == [
                t["id"] for t in c.message["tool_calls"]
            ]
            mine = [
                (t["function"]["name"], json.loads(t["function"]["arguments"])) for t in c.tool_calls or ()
            ]
            assert (c.reasoning_content, c.content, mine, c.finish_reason) == (
                m.reasoning_content,
                m.content,
                calls,
                r.choices[0].finish_reason,
            )
            got.append((c.reasoning_content, c.content, mine, c.finish_reason, c.token_ids))
    assert got == [
        (
            "The user wants weather.",
            "Let me check.",
            [("get_weather", {"city": "Paris"})],
            "tool_calls",
            scripts[0],
        ),
        ("Short.", "No tools needed.", [], "stop", scripts[1]),  # token_ids: EOS included, as vLLM's
    ]
