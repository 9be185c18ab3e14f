"""Reasoning and tool-call parsers, whole-text and streamed at every possible split."""

from __future__ import annotations

import json

import pytest

from jaxdsa.serve import deepseek_v4_encoding as v4_encoding
from jaxdsa.serve.deepseek_encoding import render_tool_calls
from jaxdsa.serve.output import ReplyDelta, ReplyParser
from jaxdsa.serve.reasoning import REASONING_PARSERS, ReasoningSplitter
from jaxdsa.serve.tool_parsers import (
    TOOL_PARSERS,
    DeepSeekV4ToolParser,
    DeepSeekV32ToolParser,
    Glm47ToolParser,
)

WEATHER_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "days": {"type": "integer"},
                    "code": {"type": "string"},
                },
            },
        },
    }
]


def run(parser: ReplyParser, chunks: list[str]) -> ReplyDelta:
    out = ReplyDelta()
    for d in [parser.feed(c) for c in chunks] + [parser.finish()]:
        out.reasoning += d.reasoning
        out.content += d.content
        out.tool_calls += d.tool_calls
    return out


def splits(text: str) -> list[list[str]]:
    """The whole text, character by character, and every two-piece split."""
    return [[text], list(text)] + [[text[:i], text[i:]] for i in range(1, len(text))]


def summary(d: ReplyDelta) -> tuple:
    return d.reasoning, d.content, [(c.name, json.loads(c.arguments)) for c in d.tool_calls]


# ---- reasoning ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "thinking, text, expected",
    [
        (True, "plan it</think>The answer.", ("plan it", "The answer.")),
        (True, "still thinking <th", ("still thinking <th", "")),  # cut off: all reasoning
        (True, "a</think>b</think>c", ("a", "b</think>c")),
        (False, "Just content.", ("", "Just content.")),
        (
            False,
            "<think>old style</think>content",
            ("old style", "content"),
        ),  # GLM-4.5: the reply opens the block
        (False, "\n<think>x</think>y", ("x", "y")),
        (False, "<thin", ("", "<thin")),
        (False, "", ("", "")),
    ],
)
def test_reasoning_split_streamed_and_whole(thinking, text, expected):
    for chunks in splits(text) if text else [[]]:
        d = run(ReplyParser(ReasoningSplitter(thinking), None), chunks)
        assert (d.reasoning, d.content) == expected, chunks


def test_reasoning_marks_whether_it_saw_a_block():
    assert ReasoningSplitter(True).saw_reasoning
    s = ReasoningSplitter(False)
    s.feed("plain")
    assert not s.saw_reasoning


# ---- GLM-4.7 / GLM-5 tool calls -------------------------------------------------------------


GLM_CASES = [
    (
        "Let me check.<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value>"
        "<arg_key>days</arg_key><arg_value>3</arg_value><arg_key>code</arg_key><arg_value>007</arg_value></tool_call>",
        ("", "Let me check.", [("get_weather", {"city": "Paris", "days": 3, "code": "007"})]),
    ),
    (  # several calls, a zero-argument call, JSON values, GLM-4.5's newlines, text between calls dropped
        "<tool_call>get_time</tool_call>\n<tool_call>search\n<arg_key>q</arg_key>\n"
        "<arg_value>a <b></arg_value>\n"
        '<arg_key>filters</arg_key>\n<arg_value>{"n": [1, 2]}</arg_value>\n</tool_call> trailing',
        ("", "", [("get_time", {}), ("search", {"q": "a <b>", "filters": {"n": [1, 2]}})]),
    ),
    (  # not typed by a schema: numbers and booleans become JSON, other text stays a string
        "<tool_call>f<arg_key>x</arg_key><arg_value>1.5</arg_value><arg_key>ok</arg_key><arg_value>true</arg_value>"
        "<arg_key>s</arg_key><arg_value>hello world</arg_value></tool_call>",
        ("", "", [("f", {"x": 1.5, "ok": True, "s": "hello world"})]),
    ),
    ("No tools needed: 1 < 2.", ("", "No tools needed: 1 < 2.", [])),
    (  # cut off inside the first call: nothing is lost, it is content
        "Sure.<tool_call>get_weather<arg_key>city</arg_key><arg_val",
        ("", "Sure.<tool_call>get_weather<arg_key>city</arg_key><arg_val", []),
    ),
]


@pytest.mark.parametrize("text, expected", GLM_CASES)
def test_glm47_tool_calls_streamed_and_whole(text, expected):
    for chunks in splits(text):
        assert summary(run(ReplyParser(None, Glm47ToolParser(WEATHER_TOOLS)), chunks)) == expected, chunks


def test_glm47_streaming_emits_each_call_once_when_it_closes():
    parser = Glm47ToolParser()
    text = "Hi<tool_call>a</tool_call><tool_call>b<arg_key>k</arg_key><arg_value>v</arg_value></tool_call>"
    seen = []
    for i, ch in enumerate(text):
        content, calls = parser.feed(ch)
        seen += [(i, c.name) for c in calls]
    assert seen == [(text.index("</tool_call>") + len("</tool_call>") - 1, "a"), (len(text) - 1, "b")]
    assert parser.finish() == ("", [])


def test_reasoning_then_tool_calls():
    text = (
        "weather needed</think>Checking.<tool_call>get_weather<arg_key>city</arg_key>"
        "<arg_value>Oslo</arg_value></tool_call>"
    )
    for chunks in splits(text):
        d = run(ReplyParser(ReasoningSplitter(True), Glm47ToolParser(WEATHER_TOOLS)), chunks)
        assert summary(d) == ("weather needed", "Checking.", [("get_weather", {"city": "Oslo"})])


def test_tool_call_ids_are_unique_and_openai_shaped():
    _, calls = Glm47ToolParser().feed("<tool_call>a</tool_call><tool_call>a</tool_call>")
    shaped = [c.to_openai() for c in calls]
    assert len({c["id"] for c in shaped}) == 2
    assert shaped[0]["type"] == "function" and shaped[0]["function"] == {"name": "a", "arguments": "{}"}


# ---- DeepSeek-V3.2 DSML ----------------------------------------------------------------------


def test_deepseek_dsml_tool_calls_streamed_and_whole():
    calls = [
        {"name": "get_weather", "arguments": {"city": "Paris", "days": 3}},
        {"name": "get_time", "arguments": {}},
    ]
    for text in (
        "Let me look." + render_tool_calls(calls),
        "Let me look." + render_tool_calls(calls).lstrip("\n"),
    ):
        for chunks in splits(text)[:2] + splits(text)[2::7]:
            d = run(ReplyParser(None, DeepSeekV32ToolParser()), chunks)
            assert summary(d) == (
                "",
                "Let me look.",
                [("get_weather", {"city": "Paris", "days": 3}), ("get_time", {})],
            )


def test_deepseek_reasoning_and_content_without_tools():
    d = run(ReplyParser(ReasoningSplitter(True), DeepSeekV32ToolParser()), list("why</think>\n\nbecause"))
    assert summary(d) == ("why", "\n\nbecause", [])


# ---- DeepSeek-V4 DSML (scripted text: a tiny random model never writes a DSML block) ---------

V4_CALLS = [
    {"name": "get_weather", "arguments": {"city": "Paris", "days": 3}},
    {"name": "get_time", "arguments": {}},
]
V4_EXPECTED = [("get_weather", {"city": "Paris", "days": 3}), ("get_time", {})]


def v4_parser(thinking: bool) -> ReplyParser:
    return ReplyParser(
        REASONING_PARSERS["deepseek_v4"].splitter(thinking), DeepSeekV4ToolParser(WEATHER_TOOLS)
    )


V4_BLOCK = v4_encoding.render_tool_calls(V4_CALLS)
V4_CASES = [
    ("Need data.</think>Let me look." + V4_BLOCK + " trailing", ("Need data.", "Let me look.", V4_EXPECTED)),
    # the block straight after the reasoning, with or without its blank line: reasoning ends there
    ("Need data." + V4_BLOCK, ("Need data.", "", V4_EXPECTED)),
    ("Need data." + V4_BLOCK.lstrip("\n"), ("Need data.", "", V4_EXPECTED)),
    ("why</think>\n\nbecause", ("why", "\n\nbecause", [])),
]


@pytest.mark.parametrize(
    "text, expected",
    V4_CASES
    + [
        # cut off inside the first call: its text (blank line included) stays content
        (
            'a</think>b\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="get_time">',
            ("a", 'b\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="get_time">', []),
        ),
        # V3.2's block name is not V4's: plain content
        ("a</think>b" + render_tool_calls(V4_CALLS), ("a", "b" + render_tool_calls(V4_CALLS), [])),
    ],
)
def test_deepseek_v4_reasoning_and_tool_calls_streamed_and_whole(text, expected):
    for chunks in splits(text)[:2] + splits(text)[2::5]:
        assert summary(run(v4_parser(True), chunks)) == expected, chunks


@pytest.mark.parametrize("text, expected", V4_CASES)
def test_deepseek_v4_parse_completion_agrees_with_the_incremental_parsers(text, expected):
    parsed = v4_encoding.parse_completion(text, "thinking")
    calls = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in parsed.tool_calls]
    assert (parsed.reasoning_content, parsed.content, calls) == expected


def test_deepseek_v4_chat_mode_and_markers():
    text = "Sure." + v4_encoding.render_tool_calls(V4_CALLS[:1])
    for chunks in splits(text)[:2]:
        assert summary(run(v4_parser(False), chunks)) == ("", "Sure.", V4_EXPECTED[:1])
    assert DeepSeekV4ToolParser.markers == ("｜DSML｜",)
    assert "｜DSML｜" in REASONING_PARSERS["deepseek_v4"].markers
    assert TOOL_PARSERS["deepseek_v4"] is DeepSeekV4ToolParser
