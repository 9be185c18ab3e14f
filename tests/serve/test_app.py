"""The HTTP layer with a scripted engine: forced replies exercise tool calls, reasoning, stop strings,
engine failures and every request-validation error through the official ``openai`` client."""

from __future__ import annotations

import json

import httpx
import numpy as np
import openai
import pytest

from jaxdsa.engine import EngineDeadError
from jaxdsa.serve import deepseek_v4_encoding as v4_encoding
from jaxdsa.serve.app import ServingContext, create_app
from jaxdsa.serve.chat_format import load_chat_format
from jaxdsa.serve.deepseek_encoding import render_tool_calls
from jaxdsa.serve.tokenizer import Tokenizer
from tests.serve.conftest import ScriptedEngine, scripted_logprobs, serving, wait_until

OBSERVATION = 501  # GLM's <|observation|>: ends an assistant turn that handed over to tools
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather for a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            },
        },
    },
    {
        "type": "function",
        "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}},
    },
]
TOOL_REPLY = (
    "The user wants weather.</think>Let me check."
    "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value><arg_key>days</arg_key><arg_value>3</arg_value></tool_call>"
    "<tool_call>get_time</tool_call>"
)


class Stub:
    def __init__(self, url: str, engine: ScriptedEngine, tok: Tokenizer):
        self.url, self.engine, self.tok = url, engine, tok
        self.client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)

    def script(self, text: str, stop_id: int | None = OBSERVATION) -> None:
        self.engine.scripts.append(self.tok.encode(text) + ([stop_id] if stop_id is not None else []))

    def post(self, path: str, body) -> httpx.Response:
        data = body if isinstance(body, str) else json.dumps(body)
        return httpx.post(
            self.url + path, content=data, headers={"Content-Type": "application/json"}, timeout=30
        )


def make_context(model_dir: str, engine: ScriptedEngine, **overrides) -> ServingContext:
    tok = Tokenizer(model_dir)
    settings = dict(
        generate=engine.generate,
        stats=engine.stats,
        tokenizer=tok,
        chat_format=load_chat_format(model_dir, "glm_moe_dsa", tok.config, tok.special_tokens_map),
        model_names=["stub"],
        max_model_len=engine.max_model_len,
        eos_token_ids=frozenset({492, 499, 501}),
        reasoning_parser="glm45",
        tool_parser="glm47",
        enable_auto_tool_choice=True,
        default_sampling={"temperature": 0.6},
        vocab_size=1000,
    )
    return ServingContext(**(settings | overrides))


@pytest.fixture(scope="module")
def stub(glm_dir):
    engine = ScriptedEngine(max_model_len=1024)  # room for the tools block of the system prompt
    ctx = make_context(glm_dir, engine)
    with serving(create_app(ctx)) as url:
        yield Stub(url, engine, ctx.tokenizer)


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


# ---- tool calls and reasoning ------------------------------------------------------------------


def test_tool_call_round_trip(stub):
    stub.script(TOOL_REPLY)
    r = stub.client.chat.completions.create(model="stub", messages=user("Weather in Paris?"), tools=TOOLS)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me check."
    assert choice.message.reasoning_content == "The user wants weather."
    calls = choice.message.tool_calls
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris", "days": 3}),
        ("get_time", {}),
    ]
    assert "get_weather" in stub.tok.decode(stub.engine.prompts[-1])  # the tools reached the prompt

    # The client sends the call and the results back; the template renders them for the next turn.
    stub.script("Got it.</think>It is sunny in Paris.", stop_id=499)
    history = user("Weather in Paris?") + [
        choice.message.model_dump(exclude_none=True, exclude={"reasoning_content"}),
        {"role": "tool", "tool_call_id": calls[0].id, "content": "sunny"},
        {"role": "tool", "tool_call_id": calls[1].id, "content": "12:00"},
    ]
    r2 = stub.client.chat.completions.create(model="stub", messages=history, tools=TOOLS)
    assert r2.choices[0].message.content == "It is sunny in Paris." and r2.choices[0].finish_reason == "stop"
    prompt = stub.tok.decode(stub.engine.prompts[-1], skip_special_tokens=False)
    assert (
        "<|assistant|></think>Let me check.<tool_call>get_weather"
        "<arg_key>city</arg_key><arg_value>Paris</arg_value>"
        "<arg_key>days</arg_key><arg_value>3</arg_value></tool_call><tool_call>get_time</tool_call>"
        "<|observation|><tool_response>sunny</tool_response><tool_response>12:00</tool_response>"
        "<|assistant|><think>"
    ) in prompt


def test_streamed_tool_calls_match_non_streamed(stub):
    stub.script(TOOL_REPLY)
    chunks = list(
        stub.client.chat.completions.create(model="stub", messages=user("Weather?"), tools=TOOLS, stream=True)
    )
    reasoning = "".join(
        getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in chunks if c.choices
    )
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    calls: dict[int, dict] = {}
    for c in chunks:
        for tc in (c.choices[0].delta.tool_calls or []) if c.choices else []:
            entry = calls.setdefault(tc.index, {"name": "", "arguments": ""})
            entry["name"] += tc.function.name or ""
            entry["arguments"] += tc.function.arguments or ""
    assert reasoning == "The user wants weather." and content == "Let me check."
    assert [(calls[i]["name"], json.loads(calls[i]["arguments"])) for i in sorted(calls)] == [
        ("get_weather", {"city": "Paris", "days": 3}),
        ("get_time", {}),
    ]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_tool_choice_none_keeps_the_text(stub):
    stub.script(TOOL_REPLY)
    r = stub.client.chat.completions.create(model="stub", messages=user("x"), tools=TOOLS, tool_choice="none")
    assert r.choices[0].message.tool_calls is None
    assert r.choices[0].message.content.startswith("Let me check.<tool_call>get_weather")


def test_thinking_off_is_all_content(stub):
    stub.script("No reasoning here.")
    r = stub.client.chat.completions.create(
        model="stub", messages=user("x"), extra_body={"chat_template_kwargs": {"enable_thinking": False}}
    )
    assert r.choices[0].message.content == "No reasoning here."
    assert r.choices[0].message.reasoning_content is None
    assert stub.tok.decode(stub.engine.prompts[-1], skip_special_tokens=False).endswith(
        "<|assistant|></think>"
    )


def test_auto_tool_choice_needs_the_flags(glm_dir):
    engine = ScriptedEngine()
    with serving(
        create_app(make_context(glm_dir, engine, tool_parser=None, enable_auto_tool_choice=False))
    ) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.BadRequestError, match="enable-auto-tool-choice"):
            client.chat.completions.create(model="stub", messages=user("x"), tools=TOOLS)


# ---- text, stop strings, defaults ------------------------------------------------------------


def test_stop_strings_cut_and_abort(stub):
    for stream in (False, True):
        stub.script("Hello world. Goodbye world.", stop_id=None)
        r = stub.client.completions.create(
            model="stub", prompt="x", max_tokens=50, stop=["Goodbye", "zzz"], stream=stream
        )
        if stream:
            chunks = list(r)
            text, reason = "".join(c.choices[0].text for c in chunks), chunks[-1].choices[0].finish_reason
        else:
            text, reason = r.choices[0].text, r.choices[0].finish_reason
        assert (text, reason) == ("Hello world. ", "stop")
        assert stub.engine.active == 0  # the engine request was closed (aborted) at the stop string


def _reply(stub, stream: bool, **kwargs) -> dict:
    """A chat reply's reasoning, content, tool calls (name, arguments) and finish reason."""
    r = stub.client.chat.completions.create(model="stub", stream=stream, **kwargs)
    if not stream:
        m = r.choices[0].message
        calls = [(c.function.name, json.loads(c.function.arguments)) for c in m.tool_calls or ()]
        return dict(
            reasoning=m.reasoning_content, content=m.content, calls=calls, reason=r.choices[0].finish_reason
        )
    chunks = [c for c in r if c.choices]
    calls: dict[int, list[str]] = {}
    for c in chunks:
        for tc in c.choices[0].delta.tool_calls or ():
            entry = calls.setdefault(tc.index, ["", ""])
            entry[0] += tc.function.name or ""
            entry[1] += tc.function.arguments or ""
    return dict(
        reasoning="".join(getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in chunks)
        or None,
        content="".join(c.choices[0].delta.content or "" for c in chunks) or None,
        calls=[(name, json.loads(args)) for name, args in (calls[i] for i in sorted(calls))],
        reason=chunks[-1].choices[0].finish_reason,
    )


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_parsers_read_several_tokens_per_step_alike(stub, stream):
    """Speculative decoding hands the server up to N + 1 tokens per step: the reasoning split, the
    tool calls and stop strings come out exactly as with one token per step."""
    replies = []
    try:
        for chunks in [(1,), (3, 1, 6, 2), (6,)]:
            stub.engine.chunks = chunks
            stub.script(TOOL_REPLY)
            calls = _reply(stub, stream, messages=user("Weather?"), tools=TOOLS)
            stub.script("I think. Hello world. Goodbye world.", stop_id=None)
            stopped = _reply(stub, stream, messages=user("x"), stop=["Goodbye"], max_tokens=50)
            replies.append((calls, stopped))
    finally:
        stub.engine.chunks = (1,)
    assert replies[0][0]["calls"][0] == ("get_weather", {"city": "Paris", "days": 3})
    assert replies[0][1]["reason"] == "stop" and "Goodbye" not in str(replies[0][1])
    assert replies[1] == replies[0] and replies[2] == replies[0]


def test_stop_strings_wait_for_min_tokens(stub):
    """As in vLLM, a stop string counts only once min_tokens tokens are out; min_tokens reaches
    the engine (which holds back EOS and stop ids)."""
    stub.script("Hello world. Goodbye world.", stop_id=None)
    r = stub.client.completions.create(
        model="stub", prompt="x", max_tokens=50, stop=["Goodbye"], extra_body={"min_tokens": 50}
    )
    assert r.choices[0].text == "Hello world. Goodbye world." and stub.engine.sampling[-1].min_tokens == 50


def test_penalties_and_logit_bias_reach_the_engine(stub):
    stub.script("Hello.", stop_id=None)
    stub.client.completions.create(
        model="stub",
        prompt="x",
        max_tokens=5,
        presence_penalty=0.5,
        frequency_penalty=-1.0,
        logit_bias={"7": -100, "3": 2.5},
        extra_body={"repetition_penalty": 1.2},
    )
    sp = stub.engine.sampling[-1]
    assert (sp.presence_penalty, sp.frequency_penalty, sp.repetition_penalty) == (0.5, -1.0, 1.2)
    assert sp.logit_bias == ((3, 2.5), (7, -100.0))
    stub.script("Hello.", stop_id=None)
    stub.client.chat.completions.create(
        model="stub", messages=user("x"), presence_penalty=0, frequency_penalty=0
    )
    assert not stub.engine.sampling[-1].penalized  # the OpenAI SDKs' zeros mean off


def test_eos_is_hidden_and_defaults_apply(stub):
    stub.script("Done.", stop_id=492)
    r = stub.client.chat.completions.create(model="stub", messages=user("Hi"))
    assert r.choices[0].message.reasoning_content == "Done." and r.choices[0].finish_reason == "stop"
    sp = stub.engine.sampling[-1]
    assert sp.temperature == 0.6  # from generation_config.json defaults
    assert sp.max_tokens == 1024 - len(stub.engine.prompts[-1])  # chat: the rest of the context
    stub.script("abc", stop_id=None)
    stub.client.completions.create(model="stub", prompt="Hi")
    assert stub.engine.sampling[-1].max_tokens == 16  # completions: OpenAI's default
    stub.script("abc", stop_id=None)
    stub.client.completions.create(
        model="stub", prompt="Hi", extra_body={"max_completion_tokens": 7, "top_k": -1}
    )
    assert stub.engine.sampling[-1].max_tokens == 7 and stub.engine.sampling[-1].top_k == 0


def test_batched_prompts_stream_with_indices(stub):
    stub.script("first", stop_id=None)
    stub.script("second one", stop_id=None)
    r = stub.client.completions.create(model="stub", prompt=["a", "b"], max_tokens=20)
    assert sorted(c.text for c in r.choices) == ["first", "second one"] and r.usage.completion_tokens > 2
    stub.script("first", stop_id=None)
    stub.script("second one", stop_id=None)
    texts = {0: "", 1: ""}
    for c in stub.client.completions.create(model="stub", prompt=["a", "b"], max_tokens=20, stream=True):
        texts[c.choices[0].index] += c.choices[0].text
    assert sorted(texts.values()) == ["first", "second one"]


def test_closing_a_batched_stream_releases_every_request(glm_dir):
    # Each request stops after its first token until it is closed, so both are surely running when
    # the client leaves. The line iterator is kept: dropping it closes the response.
    engine = ScriptedEngine(hold_after=1)
    ctx = make_context(glm_dir, engine)
    with serving(create_app(ctx)) as url:
        engine.scripts += [ctx.tokenizer.encode("word " * 200)] * 2
        body = {"model": "stub", "prompt": ["a", "b"], "max_tokens": 200, "stream": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body) as r:
            lines = r.iter_lines()
            next(lines)
            assert engine.active == 2
        wait_until(lambda: engine.active == 0, "the engine requests to close after the client left")


def test_include_usage_chunk(stub):
    stub.script("abc", stop_id=None)
    chunks = list(
        stub.client.chat.completions.create(
            model="stub", messages=user("x"), stream=True, stream_options={"include_usage": True}
        )
    )
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(stub.tok.encode("abc"))
    assert all(c.usage is None for c in chunks[:-1])


def test_tokenize_and_detokenize(stub):
    ids = stub.post("/tokenize", {"prompt": "Hello 😀"}).json()["tokens"]
    assert stub.post("/detokenize", {"tokens": ids}).json()["prompt"] == "Hello 😀"
    chat = stub.post("/tokenize", {"messages": user("Hi")}).json()
    assert stub.tok.decode(chat["tokens"], skip_special_tokens=False).endswith(
        "<|user|>Hi<|assistant|><think>"
    )
    assert chat["max_model_len"] == 1024


# ---- n choices ----------------------------------------------------------------------------------


def test_chat_n_choices_each_parse_their_own_reply(stub):
    replies = ["First thought.</think>Plain answer.", TOOL_REPLY, "Third.</think>Another answer."]
    messages = {}
    for stream in (False, True):
        for text in replies:
            stub.script(text)
        r = stub.client.chat.completions.create(
            model="stub",
            messages=user("x"),
            tools=TOOLS,
            n=3,
            seed=5,
            stream=stream,
            stream_options={"include_usage": True} if stream else None,
        )
        assert [sp.seed for sp in stub.engine.sampling[-3:]] == [5, 6, 7]
        if stream:
            chunks = list(r)
            got = {i: {"content": "", "reasoning": "", "calls": [], "finish": None} for i in range(3)}
            for c in chunks[:-1]:
                (ch,) = c.choices
                g = got[ch.index]
                g["content"] += ch.delta.content or ""
                g["reasoning"] += getattr(ch.delta, "reasoning_content", None) or ""
                g["calls"] += [t.function.name for t in ch.delta.tool_calls or ()]
                g["finish"] = ch.finish_reason or g["finish"]
            usage = chunks[-1].usage
        else:
            assert [c.index for c in r.choices] == [0, 1, 2]
            got = {
                c.index: {
                    "content": c.message.content or "",
                    "reasoning": c.message.reasoning_content,
                    "calls": [t.function.name for t in c.message.tool_calls or ()],
                    "finish": c.finish_reason,
                }
                for c in r.choices
            }
            usage = r.usage
        messages[stream] = got
        assert usage.prompt_tokens == len(stub.engine.prompts[-1])  # the prompt counts once, not n times
        assert usage.completion_tokens == sum(len(stub.tok.encode(t)) + 1 for t in replies)
    assert messages[True] == messages[False]
    got = messages[False]
    assert (got[0]["content"], got[0]["reasoning"], got[0]["finish"]) == (
        "Plain answer.",
        "First thought.",
        "stop",
    )
    assert got[1]["calls"] == ["get_weather", "get_time"] and got[1]["finish"] == "tool_calls"
    assert got[2]["content"] == "Another answer." and got[2]["calls"] == []


def test_completions_n_choices_are_prompt_major(stub):
    for text in ("a1", "a2", "b1", "b2"):
        stub.script(text, stop_id=None)
    r = stub.client.completions.create(model="stub", prompt=["first prompt", "b"], max_tokens=10, n=2)
    assert [(c.index, c.text) for c in r.choices] == [(0, "a1"), (1, "a2"), (2, "b1"), (3, "b2")]
    prompts = stub.engine.prompts[-4:]
    assert prompts[0] == prompts[1] != prompts[2] == prompts[3]
    assert r.usage.prompt_tokens == len(prompts[0]) + len(prompts[2])


# ---- logprobs -----------------------------------------------------------------------------------

LOGPROB_REPLY = "Why 😀?</think>Answer: 你好 🚀"  # the emoji and CJK characters span several tokens


def test_chat_logprobs_cover_every_token_streamed_or_not(stub):
    ids = stub.tok.encode(LOGPROB_REPLY) + [OBSERVATION]
    expected = [scripted_logprobs(i, t, 3) for i, t in enumerate(ids)]
    got = {}
    for stream in (False, True):
        stub.script(LOGPROB_REPLY)
        r = stub.client.chat.completions.create(
            model="stub", messages=user("x"), logprobs=True, top_logprobs=3, stream=stream
        )
        if stream:
            chunks = list(r)
            got[stream] = [
                e
                for c in chunks
                if c.choices and c.choices[0].logprobs
                for e in c.choices[0].logprobs.content
            ]
            assert (
                chunks[1].choices[0].logprobs is not None
            )  # entries arrive with the text, not only at the end
        else:
            got[stream] = r.choices[0].logprobs.content
            assert r.choices[0].message.content == "Answer: 你好 🚀"
    assert [e.model_dump() for e in got[True]] == [e.model_dump() for e in got[False]]
    content = got[False]
    assert [(e.logprob, [t.logprob for t in e.top_logprobs]) for e in content] == [
        (x.logprob, [lp for _, lp in x.top]) for x in expected
    ]
    assert [e.token for e in content] == [stub.tok.token_text(t) for t in ids]
    assert content[-1].token == "<|observation|>"  # the hidden stop token keeps its entry
    assert (
        b"".join(bytes(e.bytes) for e in content[:-1]).decode() == LOGPROB_REPLY
    )  # bytes rebuild split characters
    assert [t.token for t in content[0].top_logprobs] == [stub.tok.token_text(ids[0] + k) for k in range(3)]


def test_chat_logprobs_without_top_and_off_by_default(stub):
    stub.script("ok")
    r = stub.client.chat.completions.create(model="stub", messages=user("x"), logprobs=True)
    assert stub.engine.sampling[-1].logprobs == 0 and all(
        e.top_logprobs == [] for e in r.choices[0].logprobs.content
    )
    stub.script("ok")
    assert stub.client.chat.completions.create(model="stub", messages=user("x")).choices[0].logprobs is None
    assert stub.engine.sampling[-1].logprobs is None


def test_completion_logprobs_legacy_shape_streamed_or_not(stub):
    text = "Hello 😀 world"
    ids = stub.tok.encode(text)
    merged = {}
    for stream in (False, True):
        stub.script(text, stop_id=None)
        r = stub.client.completions.create(model="stub", prompt="x", max_tokens=50, logprobs=2, stream=stream)
        parts = (
            [c.choices[0].logprobs for c in r if c.choices[0].logprobs] if stream else [r.choices[0].logprobs]
        )
        merged[stream] = {
            k: [v for p in parts for v in getattr(p, k)]
            for k in ("tokens", "token_logprobs", "top_logprobs", "text_offset")
        }
    assert merged[True] == merged[False]
    lp = merged[False]
    tokens = [stub.tok.token_text(t) for t in ids]
    assert lp["tokens"] == tokens
    assert lp["token_logprobs"] == [scripted_logprobs(i, t, 2).logprob for i, t in enumerate(ids)]
    assert lp["text_offset"] == np.cumsum([0] + [len(t) for t in tokens[:-1]]).tolist()
    for i, t in enumerate(ids):
        top = {}
        for j, v in scripted_logprobs(i, t, 2).top:
            top.setdefault(stub.tok.token_text(j), v)
        assert lp["top_logprobs"][i] == top


def test_echo_returns_the_prompt_and_its_logprobs_as_lm_eval_reads_them(stub):
    prompt = "The capital of France is"
    ids = stub.tok.encode(prompt, add_special_tokens=True)
    merged = {}
    for stream in (False, True):
        stub.script(" Paris", stop_id=None)
        r = stub.client.completions.create(
            model="stub", prompt=prompt, max_tokens=1, echo=True, logprobs=1, temperature=0, stream=stream
        )
        if stream:
            chunks = list(r)
            text = "".join(c.choices[0].text for c in chunks)
            parts = [c.choices[0].logprobs for c in chunks if c.choices[0].logprobs]
            merged[stream] = (
                text,
                {
                    k: [v for p in parts for v in getattr(p, k)]
                    for k in ("tokens", "token_logprobs", "top_logprobs", "text_offset")
                },
            )
        else:
            lp = r.choices[0].logprobs
            merged[stream] = (
                r.choices[0].text,
                {k: getattr(lp, k) for k in ("tokens", "token_logprobs", "top_logprobs", "text_offset")},
            )
        assert stub.engine.sampling[-1].prompt_logprobs == 1
    assert merged[True] == merged[False]
    text, lp = merged[False]
    generated = stub.tok.encode(" Paris")[0]
    assert text == prompt + stub.tok.decode([generated])
    assert lp["tokens"] == [stub.tok.token_text(t) for t in ids + [generated]]
    assert (
        lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    )  # the first prompt token has none
    assert lp["token_logprobs"][1:] == [
        scripted_logprobs(p, ids[p], 1).logprob for p in range(1, len(ids))
    ] + [scripted_logprobs(0, generated, 1).logprob]
    assert "".join(lp["tokens"][: len(ids)]) == prompt and lp["text_offset"][len(ids)] == len(prompt)


def test_echo_without_logprobs_only_prefixes_the_text(stub):
    stub.script("!", stop_id=None)
    r = stub.client.completions.create(
        model="stub", prompt=stub.tok.encode("Hi there"), max_tokens=3, echo=True
    )
    assert r.choices[0].text == "Hi there!" and r.choices[0].logprobs is None
    assert stub.engine.sampling[-1].prompt_logprobs is None


# ---- failures -----------------------------------------------------------------------------------


def test_engine_failure_is_503_or_an_error_event(stub):
    stub.engine.scripts.append(EngineDeadError)
    with pytest.raises(openai.InternalServerError) as e:
        stub.client.completions.create(model="stub", prompt="x", max_tokens=5)
    assert e.value.status_code == 503
    stub.engine.scripts.append(EngineDeadError)
    with pytest.raises(openai.APIError, match="engine failure"):
        list(stub.client.completions.create(model="stub", prompt="x", max_tokens=5, stream=True))


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/chat/completions", "{not json", None),
        ("/v1/chat/completions", {"model": "stub"}, "messages"),
        ("/v1/chat/completions", {"messages": []}, "messages"),
        ("/v1/chat/completions", {"messages": [{"role": "bot", "content": "x"}]}, "messages.0.role"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            "messages.0.content",
        ),
        ("/v1/chat/completions", {"messages": user("x"), "n": 0}, "n"),
        ("/v1/chat/completions", {"messages": user("x"), "n": 129}, "n"),
        ("/v1/chat/completions", {"messages": user("x"), "temperature": -1}, "temperature"),
        ("/v1/chat/completions", {"messages": user("x"), "top_p": 0}, "top_p"),
        ("/v1/chat/completions", {"messages": user("x"), "max_tokens": 0}, "max_tokens"),
        ("/v1/chat/completions", {"messages": user("x"), "max_tokens": "many"}, "max_tokens"),
        ("/v1/chat/completions", {"messages": user("x"), "top_logprobs": 2}, "top_logprobs"),
        (
            "/v1/chat/completions",
            {"messages": user("x"), "logprobs": True, "top_logprobs": 21},
            "top_logprobs",
        ),
        (
            "/v1/chat/completions",
            {"messages": user("x"), "logprobs": True, "top_logprobs": -1},
            "top_logprobs",
        ),
        ("/v1/chat/completions", {"messages": user("x"), "presence_penalty": 2.5}, "presence_penalty"),
        ("/v1/chat/completions", {"messages": user("x"), "repetition_penalty": 0}, "repetition_penalty"),
        ("/v1/chat/completions", {"messages": user("x"), "logit_bias": {"5": 101}}, "logit_bias"),
        ("/v1/chat/completions", {"messages": user("x"), "logit_bias": {"x": 1}}, "logit_bias.x.[key]"),
        ("/v1/chat/completions", {"messages": user("x"), "logit_bias": {"1000": 1}}, "logit_bias"),
        (
            "/v1/chat/completions",
            {"messages": user("x"), "stream_options": {"include_usage": True}},
            "stream_options",
        ),
        (
            "/v1/chat/completions",
            {"messages": user("x"), "tools": TOOLS, "tool_choice": "required"},
            "tool_choice",
        ),
        (
            "/v1/chat/completions",
            {"messages": user("x"), "response_format": {"type": "json_object"}},
            "response_format",
        ),
        ("/v1/chat/completions", {"messages": user("x"), "stop": [""]}, "stop"),
        (
            "/v1/chat/completions",
            {
                "messages": [
                    {
                        "role": "assistant",
                        "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "{oops"}}],
                    }
                ]
            },
            "messages.0.tool_calls.0.function.arguments",
        ),
        ("/v1/chat/completions", {"messages": user("hello " * 1100)}, "messages"),
        ("/v1/chat/completions", {"messages": user("x"), "max_tokens": 1020}, "max_tokens"),
        ("/v1/completions", {"prompt": []}, "prompt"),
        ("/v1/completions", {"prompt": [1, "a"]}, "prompt"),
        ("/v1/completions", {}, "prompt"),
        ("/v1/completions", {"prompt": "x", "frequency_penalty": -2.1}, "frequency_penalty"),
        ("/v1/completions", {"prompt": "x", "logprobs": 21}, "logprobs"),
        ("/v1/completions", {"prompt": "x", "logprobs": -1}, "logprobs"),
        ("/v1/completions", {"prompt": "x", "best_of": 3}, "best_of"),
        ("/v1/completions", {"prompt": "x", "min_tokens": -1}, "min_tokens"),
        ("/v1/completions", {"prompt": "x", "max_tokens": 2, "min_tokens": 3}, "min_tokens"),
        # Numbers the engine cannot represent (issue 13): each a 400 naming its field, never a 500.
        (
            "/v1/completions",
            {"prompt": "x", "min_tokens": 1, "stop_token_ids": [2147483653]},
            "stop_token_ids",
        ),
        ("/v1/completions", {"prompt": "x", "stop_token_ids": [-1]}, "stop_token_ids"),
        ("/v1/completions", {"prompt": "x", "stop_token_ids": [1000]}, "stop_token_ids"),
        ("/v1/completions", {"prompt": "x", "stop_token_ids": ["a"]}, "stop_token_ids.0"),
        (
            "/v1/completions",
            {"prompt": "x", "min_tokens": 1, "stop_token_ids": list(range(40))},
            "stop_token_ids",
        ),
        ("/v1/completions", {"prompt": [-1]}, "prompt"),
        ("/v1/completions", {"prompt": [5, 2**63]}, "prompt"),
        ("/v1/completions", {"prompt": [[5], [2**64 + 1]]}, "prompt"),
        ("/v1/completions", {"prompt": [5.5]}, "prompt"),
        ("/v1/completions", {"prompt": "x", "seed": 2**63}, "seed"),
        ("/v1/completions", {"prompt": "x", "seed": -(2**63) - 1}, "seed"),
        ("/v1/completions", {"prompt": "x", "top_k": -2}, "top_k"),
        ("/v1/completions", {"prompt": "x", "top_k": "many"}, "top_k"),
        ("/v1/completions", {"prompt": "x", "n": 2**70}, "n"),
        ("/v1/completions", {"prompt": "x", "max_tokens": 2**64}, "max_tokens"),
        ("/v1/completions", {"prompt": "x", "max_completion_tokens": 2000}, "max_completion_tokens"),
        ("/v1/completions", {"prompt": "x", "min_tokens": 2**64}, "min_tokens"),
        ("/v1/completions", {"prompt": "x", "logprobs": 2**64}, "logprobs"),
        ("/v1/completions", '{"prompt": "x", "temperature": NaN}', "temperature"),
        ("/v1/completions", '{"prompt": "x", "top_p": Infinity}', "top_p"),
        ("/v1/completions", '{"prompt": "x", "repetition_penalty": Infinity}', "repetition_penalty"),
        ("/v1/completions", {"prompt": "x", "logit_bias": {"-1": 1}}, "logit_bias"),
        ("/v1/completions", {"prompt": "x", "logit_bias": {str(2**70): 1}}, "logit_bias"),
        ("/v1/completions", '{"prompt": "x", "logit_bias": {"5": NaN}}', "logit_bias.5"),
        ("/v1/chat/completions", {"messages": user("x"), "stop_token_ids": [2**64]}, "stop_token_ids"),
        ("/v1/chat/completions", {"messages": user("x"), "seed": 1.5}, "seed"),
        ("/detokenize", {"tokens": [-1]}, "tokens"),
        ("/detokenize", {"tokens": [2**64]}, "tokens"),
        ("/detokenize", {"tokens": [1000]}, "tokens"),
        ("/detokenize", {"tokens": "abc"}, "tokens"),
        ("/detokenize", {"tokens": [1.5]}, "tokens.0"),
        ("/tokenize", {"prompt": "x", "messages": user("x")}, "prompt"),
        ("/tokenize", {}, "prompt"),
        ("/tokenize", {"prompt": 5}, "prompt"),
        ("/tokenize", {"messages": []}, "messages"),  # was a 500 (schemathesis)
    ],
)
def test_invalid_requests_are_400_naming_the_field(stub, path, body, param):
    r = stub.post(path, body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    assert error["param"] == param
    if param:
        assert param in error["message"] or error["code"] == "context_length_exceeded"


def test_a_body_that_is_not_a_json_object_says_so(stub):
    for headers in ({}, {"Content-Type": "text/plain"}):
        r = httpx.post(stub.url + "/v1/completions", content=b"prompt=hi", headers=headers, timeout=30)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["code"] == "invalid_json" and "must be a JSON object" in error["message"]


def test_unknown_model_is_404(stub):
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        stub.client.chat.completions.create(model="gpt-4o", messages=user("x"))
    assert (
        stub.post("/v1/completions", {"model": "nope", "prompt": "x"}).json()["error"]["code"]
        == "model_not_found"
    )
    assert stub.client.models.retrieve("stub").id == "stub"


def test_api_key(glm_dir):
    engine = ScriptedEngine()
    with serving(create_app(make_context(glm_dir, engine, api_key="sesame"))) as url:
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0).models.list()
        assert [m.id for m in openai.OpenAI(base_url=f"{url}/v1", api_key="sesame").models.list()] == ["stub"]
        assert httpx.get(f"{url}/health").status_code == 200  # health stays open for load balancers


def deepseek_context(model_dir: str, model_type: str, engine, *, reasoning_parser: str):
    """(tokenizer, serving context) of a DeepSeek checkpoint: its own encoder, EOS id 1, the
    reasoning parser named and the tool parser of its model type."""
    tok = Tokenizer(model_dir)
    ctx = make_context(
        model_dir,
        engine,
        chat_format=load_chat_format(model_dir, model_type, tok.config, tok.special_tokens_map),
        eos_token_ids=frozenset({1}),
        reasoning_parser=reasoning_parser,
        tool_parser=model_type,
    )
    return tok, ctx


def test_deepseek_v32_reasoning_and_dsml_tool_calls(dsv32_dir):
    engine = ScriptedEngine(max_model_len=2048)
    tok, ctx = deepseek_context(dsv32_dir, "deepseek_v32", engine, reasoning_parser="deepseek_v3")
    call = [{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}]
    reply = "Need the weather.</think>Checking." + render_tool_calls(call)
    engine.scripts += [tok.encode(reply) + [1], tok.encode("Sunny.") + [1]]
    with serving(create_app(ctx)) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        thinking = {"chat_template_kwargs": {"thinking": True}}
        r = client.chat.completions.create(
            model="stub", messages=user("Weather?"), tools=TOOLS, extra_body=thinking
        )
        m = r.choices[0].message
        assert (m.reasoning_content, m.content, r.choices[0].finish_reason) == (
            "Need the weather.",
            "Checking.",
            "tool_calls",
        )
        assert [(c.function.name, json.loads(c.function.arguments)) for c in m.tool_calls] == [
            ("get_weather", {"city": "Paris", "days": 3})
        ]
        assert tok.decode(engine.prompts[-1], skip_special_tokens=False).endswith(
            "<｜User｜>Weather?<｜Assistant｜><think>"
        )
        history = user("Weather?") + [
            m.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": m.tool_calls[0].id, "content": "sunny"},
        ]
        r2 = client.chat.completions.create(
            model="stub", messages=history, tools=TOOLS
        )  # chat mode: no reasoning
        assert r2.choices[0].message.content == "Sunny." and r2.choices[0].message.reasoning_content is None
        prompt = tok.decode(engine.prompts[-1], skip_special_tokens=False)
        assert prompt.endswith(
            '<｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>\n'
            '<｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>\n</｜DSML｜invoke>\n'
            "</｜DSML｜function_calls><｜end▁of▁sentence｜>\n\n<function_results>\n<result>sunny</result>\n"
            "</function_results>\n\n</think>"
        )


def test_deepseek_v4_reasoning_and_dsml_tool_calls(dsv4_dir):
    """The V4 chat format and parsers through HTTP: thinking on by default, a tool-call block right
    after the reasoning (no ``</think>``), streamed and whole alike, the tool result rendered back
    as a ``<tool_result>`` user turn, ``reasoning_effort`` and thinking off."""
    engine = ScriptedEngine(max_model_len=2048)
    tok, ctx = deepseek_context(dsv4_dir, "deepseek_v4", engine, reasoning_parser="deepseek_v4")
    call = [{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}]
    reply = tok.encode("Need the weather." + v4_encoding.render_tool_calls(call)) + [1]
    engine.scripts += [reply, reply, tok.encode("Sunny.") + [1], tok.encode("Hi.") + [1], [1]]
    with serving(create_app(ctx)) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        r = client.chat.completions.create(model="stub", messages=user("Weather?"), tools=TOOLS)
        m = r.choices[0].message
        assert (m.reasoning_content, m.content, r.choices[0].finish_reason) == (
            "Need the weather.",
            None,
            "tool_calls",
        )
        calls = [(c.function.name, json.loads(c.function.arguments)) for c in m.tool_calls]
        assert calls == [("get_weather", {"city": "Paris", "days": 3})]
        prompt = tok.decode(engine.prompts[-1], skip_special_tokens=False)
        assert prompt.startswith("<｜begin▁of▁sentence｜>\n\n## Tools\n")
        assert prompt.endswith("<｜User｜>Weather?<｜Assistant｜><think>")
        chunks = [c for c in client.chat.completions.create(
            model="stub", messages=user("Weather?"), tools=TOOLS, stream=True
        ) if c.choices]  # fmt: skip
        deltas = [c.choices[0].delta for c in chunks]
        assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == "Need the weather."
        assert "".join(d.content or "" for d in deltas) == ""
        streamed = [
            (t.function.name, json.loads(t.function.arguments)) for d in deltas for t in d.tool_calls or ()
        ]
        assert streamed == calls and chunks[-1].choices[0].finish_reason == "tool_calls"
        history = user("Weather?") + [
            m.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": m.tool_calls[0].id, "content": "sunny"},
        ]
        r2 = client.chat.completions.create(model="stub", messages=history, tools=TOOLS)
        assert (r2.choices[0].message.content, r2.choices[0].message.reasoning_content) == ("", "Sunny.")
        prompt = tok.decode(engine.prompts[-1], skip_special_tokens=False)
        assert prompt.endswith(
            "<｜User｜>Weather?<｜Assistant｜><think>Need the weather.</think>\n\n<｜DSML｜tool_calls>\n"
            '<｜DSML｜invoke name="get_weather">\n'
            '<｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>\n'
            '<｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>\n</｜DSML｜invoke>\n'
            "</｜DSML｜tool_calls><｜end▁of▁sentence｜><｜User｜><tool_result>sunny</tool_result>"
            "<｜Assistant｜><think>"
        )
        r3 = client.chat.completions.create(model="stub", messages=user("Hi"), reasoning_effort="max")
        assert r3.choices[0].message.reasoning_content == "Hi."
        prompt = tok.decode(engine.prompts[-1], skip_special_tokens=False)
        assert (
            prompt
            == "<｜begin▁of▁sentence｜>"
            + v4_encoding.REASONING_EFFORT_MAX
            + "<｜User｜>Hi<｜Assistant｜><think>"
        )
        off = {"chat_template_kwargs": {"thinking": False}}
        r4 = client.chat.completions.create(model="stub", messages=user("Hi"), extra_body=off)
        assert r4.choices[0].message.reasoning_content is None and r4.choices[0].finish_reason == "stop"
        assert tok.decode(engine.prompts[-1], skip_special_tokens=False).endswith("<｜Assistant｜></think>")


def test_numbers_the_engine_reads_its_own_way_pass_through(stub):
    """top_k past the vocabulary (the engine takes it as off, as vLLM does) and any int64 seed (the
    engine reduces it to its 31 bits) are not errors."""
    stub.script("ok", stop_id=None)
    stub.script("ok", stop_id=None)
    stub.client.completions.create(
        model="stub", prompt="x", max_tokens=2, n=2, seed=2**63 - 1, extra_body={"top_k": 1099511627776}
    )
    assert [(sp.top_k, sp.seed) for sp in stub.engine.sampling[-2:]] == [
        (1099511627776, 2**63 - 1),
        (1099511627776, 2**63),  # choice j: seed + j, reduced by the engine like any other
    ]


def test_health_answers_json_and_503_once_the_engine_stops(glm_dir):
    running = [True]
    ctx = make_context(glm_dir, ScriptedEngine(), alive=lambda: running[0])
    with serving(create_app(ctx)) as url:
        r = httpx.get(f"{url}/health")
        assert r.status_code == 200 and r.json() == {"status": "ok"}
        assert r.headers["content-type"] == "application/json"
        running[0] = False
        r = httpx.get(f"{url}/health")
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_stopped"


def test_openapi_documents_every_answer_with_the_error_schema(stub):
    doc = httpx.get(f"{stub.url}/openapi.json").json()
    error = {"$ref": "#/components/schemas/ErrorResponse"}
    expected = {
        ("get", "/health"): {"200", "503"},
        ("get", "/metrics"): {"200"},
        ("get", "/v1/models"): {"200", "401"},
        ("get", "/v1/models/{name}"): {"200", "401", "404"},
        ("post", "/tokenize"): {"200", "400", "401", "404"},
        ("post", "/detokenize"): {"200", "400", "401", "404"},
        ("post", "/v1/completions"): {"200", "400", "401", "404", "429", "503"},
        ("post", "/v1/chat/completions"): {"200", "400", "401", "404", "429", "503"},
        ("post", "/start_profile"): {"200", "400", "401", "404"},
        ("post", "/stop_profile"): {"200", "400", "401", "404"},
    }
    operations = {(m, p): op for p, ops in doc["paths"].items() for m, op in ops.items()}
    assert set(operations) == set(expected)
    for key, op in operations.items():
        assert set(op["responses"]) == expected[key], key
        for status, answer in op["responses"].items():
            if status != "200":
                assert answer["content"]["application/json"]["schema"] == error, (key, status)
    for path in ("/v1/completions", "/v1/chat/completions"):
        assert set(doc["paths"][path]["post"]["responses"]["200"]["content"]) == {
            "application/json",
            "text/event-stream",
        }
    assert "HTTPValidationError" not in doc["components"]["schemas"]


class _Profiler:
    """What the profile routes drive, recording the calls (the real one is AsyncEngine's)."""

    profile_dir = "/tmp/traces"

    def __init__(self):
        self.running, self.calls = False, []

    def start_profile(self):
        if self.running:
            raise RuntimeError("a profile is already being recorded")
        self.running = True
        self.calls.append("start")

    def stop_profile(self):
        if not self.running:
            raise RuntimeError("no profile is being recorded")
        self.running = False
        self.calls.append("stop")


def test_profile_routes_start_and_stop_the_engines_trace(glm_dir):
    """vLLM's /start_profile and /stop_profile: 404 without --profile-dir, else they start and stop
    the engine's trace; starting twice or stopping none is a 400 in OpenAI's error shape."""
    off = make_context(glm_dir, ScriptedEngine(max_model_len=64))
    with serving(create_app(off)) as url:
        r = httpx.post(f"{url}/start_profile")
        assert r.status_code == 404 and r.json()["error"]["code"] == "profiling_off"
    profiler = _Profiler()
    on = make_context(glm_dir, ScriptedEngine(max_model_len=64), profiler=profiler)
    with serving(create_app(on)) as url:
        assert httpx.post(f"{url}/start_profile").json() == {
            "status": "profiling",
            "directory": "/tmp/traces",
        }
        again = httpx.post(f"{url}/start_profile")
        assert again.status_code == 400 and "already" in again.json()["error"]["message"]
        assert httpx.post(f"{url}/stop_profile").json()["status"] == "written"
        assert httpx.post(f"{url}/stop_profile").status_code == 400
    assert profiler.calls == ["start", "stop"]
