"""DeepSeek-V4 chat encoding (docs/models.md §6.4), its parser, and the server's V4 chat format.

Expected prompts are written out by hand from the rules of DeepSeek's ``encoding_dsv4.py``. The
thinking-mode tool-call and tool-result prompts below are also what DeepSeek's ``deepseek-recipe``
0.2.0 renders for the same conversations, but for the zero-argument invoke (one newline there);
its chat-mode prompt with tools differs (see ``jaxdsa.serve.deepseek_v4_encoding``'s unverified notes).
Checked once by hand; deepseek-recipe is not a test dependency.
"""

from __future__ import annotations

import json

import pytest

from jaxdsa.serve.chat_format import ChatTemplateError, DeepSeekV4ChatFormat, load_chat_format
from jaxdsa.serve.deepseek_v4_encoding import (
    REASONING_EFFORT_MAX,
    encode_messages,
    parse_completion,
    render_tool_calls,
    render_tools,
)
from tests.serve.conftest import TOOLS

BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
USER, ASSISTANT = "<｜User｜>", "<｜Assistant｜>"
TWO_TURNS = [
    {"role": "system", "content": "S"},
    {"role": "user", "content": "U1"},
    {"role": "assistant", "content": "A1", "reasoning_content": "R1"},
    {"role": "user", "content": "U2"},
]
WEATHER = {"name": "get_weather", "arguments": '{"city": "Paris", "days": 3}'}
CALLS = [
    {"id": "c1", "type": "function", "function": WEATHER},
    {"id": "c2", "type": "function", "function": {"name": "now", "arguments": {}}},
]
CALLS_BLOCK = (
    "\n\n<｜DSML｜tool_calls>\n"
    '<｜DSML｜invoke name="get_weather">\n'
    '<｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>\n'
    '<｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>\n'
    "</｜DSML｜invoke>\n"
    '<｜DSML｜invoke name="now">\n\n</｜DSML｜invoke>\n'
    "</｜DSML｜tool_calls>"
)
TOOL_TURN = [
    {"role": "user", "content": "U"},
    {"role": "assistant", "content": "Checking.", "reasoning_content": "R", "tool_calls": CALLS},
    {"role": "tool", "tool_call_id": "c2", "content": "12:00"},  # out of order: sorted by call
    {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
]
RESULTS = f"{USER}<tool_result>sunny</tool_result>\n\n<tool_result>12:00</tool_result>{ASSISTANT}"


# ---- prompts ---------------------------------------------------------------------------------


def test_two_turn_example_thinking_and_chat():
    """docs/models.md §6.3's example renders the same for V4: older reasoning is dropped."""
    history = f"{BOS}S{USER}U1{ASSISTANT}</think>A1{EOS}{USER}U2{ASSISTANT}"
    assert encode_messages(TWO_TURNS, "thinking") == history + "<think>"
    assert encode_messages(TWO_TURNS, "chat") == history + "</think>"
    current = TWO_TURNS[:2] + [{"role": "assistant", "content": "A1", "reasoning": "R1"}]  # vLLM's key
    assert encode_messages(current, "thinking") == f"{BOS}S{USER}U1{ASSISTANT}<think>R1</think>A1{EOS}"


def test_reasoning_effort_max_prefixes_the_prompt_in_thinking_mode_only():
    plain = encode_messages(TWO_TURNS, "thinking")
    assert (
        encode_messages(TWO_TURNS, "thinking", reasoning_effort="max")
        == BOS + REASONING_EFFORT_MAX + plain[len(BOS) :]
    )
    assert REASONING_EFFORT_MAX.startswith(
        "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    )
    assert REASONING_EFFORT_MAX.endswith("no assumption is left unchecked.\n\n")
    assert encode_messages(TWO_TURNS, "thinking", reasoning_effort="high") == plain
    assert encode_messages(TWO_TURNS, "chat", reasoning_effort="max") == encode_messages(TWO_TURNS, "chat")
    with pytest.raises(ValueError, match="reasoning_effort"):
        encode_messages(TWO_TURNS, "thinking", reasoning_effort="low")


def test_tools_go_on_the_leading_system_message():
    tools_text = render_tools(TOOLS)
    assert tools_text.startswith("## Tools\n\nYou have access to a set of tools")
    assert '"<｜DSML｜tool_calls>" block' in tools_text and tools_text.endswith(
        "schemas to invoke tool calls.\n"
    )
    schema = '{"name": "get_weather", "description": "Weather for a city", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}'  # noqa: E501
    assert f"### Available Tool Schemas\n\n{schema}\n\nYou MUST" in tools_text
    user = [{"role": "user", "content": "U"}]
    assert encode_messages(TWO_TURNS[:2], "chat", tools=TOOLS) == (
        f"{BOS}S\n\n{tools_text}{USER}U1{ASSISTANT}</think>"
    )
    assert encode_messages(user, "chat", tools=TOOLS) == f"{BOS}\n\n{tools_text}{USER}U{ASSISTANT}</think>"
    developer = [{"role": "developer", "content": "D"}, *user]
    assert (
        encode_messages(developer, "chat", tools=TOOLS)
        == f"{BOS}{USER}D\n\n{tools_text}{USER}U{ASSISTANT}</think>"
    )


def test_tool_calls_and_results_thinking():
    """With tools nothing is dropped: every user turn opens <think>, every assistant turn keeps its
    reasoning."""
    out = encode_messages(TOOL_TURN, "thinking", tools=TOOLS)
    head = f"{BOS}\n\n{render_tools(TOOLS)}"
    assert out == f"{head}{USER}U{ASSISTANT}<think>R</think>Checking.{CALLS_BLOCK}{EOS}{RESULTS}<think>"
    more = TOOL_TURN + [
        {"role": "assistant", "content": "Sunny, noon.", "reasoning_content": "R2"},
        {"role": "user", "content": "U2"},
    ]
    assert encode_messages(more, "thinking", tools=TOOLS) == (
        f"{head}{USER}U{ASSISTANT}<think>R</think>Checking.{CALLS_BLOCK}{EOS}{RESULTS}<think>R2</think>"
        f"Sunny, noon.{EOS}{USER}U2{ASSISTANT}<think>"
    )


def test_tool_calls_and_results_chat_and_without_tools():
    """Chat mode: no reasoning anywhere. Without tools in the request, thinking mode drops what came
    before the last user turn (a tool-result turn is a user turn)."""
    out = encode_messages(TOOL_TURN, "chat", tools=TOOLS)
    assert out.endswith(f"{USER}U{ASSISTANT}</think>Checking.{CALLS_BLOCK}{EOS}{RESULTS}</think>")
    assert encode_messages(TOOL_TURN, "thinking") == (
        f"{BOS}{USER}U{ASSISTANT}</think>Checking.{CALLS_BLOCK}{EOS}{RESULTS}<think>"
    )
    text = TOOL_TURN + [{"role": "user", "content": "and?"}]  # user text joins the results' turn
    assert encode_messages(text, "chat").endswith(
        f"<tool_result>12:00</tool_result>\n\nand?{ASSISTANT}</think>"
    )
    assert encode_messages(TOOL_TURN, "thinking", drop_thinking=False).endswith(
        f"{USER}U{ASSISTANT}<think>R</think>Checking.{CALLS_BLOCK}{EOS}{RESULTS}<think>"
    )


def test_developer_turn_and_consecutive_users():
    conv = [
        {"role": "system", "content": "S"},
        {"role": "developer", "content": "D"},
        {"role": "user", "content": "U1"},
        {"role": "user", "content": "U2"},
    ]
    assert encode_messages(conv, "chat") == f"{BOS}S{USER}D{USER}U1\n\nU2{ASSISTANT}</think>"
    # thinking mode drops developer turns before the last user turn
    assert encode_messages(conv, "thinking") == f"{BOS}S{USER}U1\n\nU2{ASSISTANT}<think>"
    assert encode_messages(conv[:2], "thinking") == f"{BOS}S{USER}D{ASSISTANT}<think>"


@pytest.mark.parametrize(
    "messages, kwargs, match",
    [
        (TWO_TURNS, {"thinking_mode": "deep"}, "thinking_mode"),
        ([{"role": "narrator", "content": "x"}], {}, "narrator"),
        ([{"role": "developer", "content": ""}], {}, "developer"),
        ([{"role": "assistant", "tool_calls": [{"name": "f", "arguments": "[1]"}]}], {}, "JSON object"),
    ],
)  # fmt: skip
def test_bad_conversations_raise(messages, kwargs, match):
    with pytest.raises(ValueError, match=match):
        encode_messages(messages, **kwargs)


# ---- parsing -------------------------------------------------------------------------------------

ARGS = {"q": "naïve 🙂 <b>", "n": 2, "flags": [True, None], "opt": {"a": 1.5}, "s": "3", "empty": ""}


@pytest.mark.parametrize("mode", ["thinking", "chat"])
@pytest.mark.parametrize(
    "content, calls",
    [
        ("Answer.", []),
        ("", [{"name": "search", "arguments": ARGS}]),
        ("Let me look.", [{"name": "search", "arguments": ARGS}, {"name": "now", "arguments": {}}]),
    ],
)
def test_round_trip(mode, content, calls):
    """What the encoder writes for an assistant turn parses back to the same message."""
    user = {"role": "user", "content": "U"}
    reply = {
        "role": "assistant",
        "reasoning_content": "Think: a < b.",
        "content": content,
        "tool_calls": calls,
    }
    prompt, full = encode_messages([user], mode), encode_messages([user, reply], mode)
    parsed = parse_completion(full[len(prompt) :], mode)
    assert parsed.reasoning_content == ("Think: a < b." if mode == "thinking" else None)
    assert parsed.content == content
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in parsed.tool_calls] == [
        (c["name"], c["arguments"]) for c in calls
    ]


def test_parse_is_lenient_where_generation_stops_or_skips_steps():
    block = render_tool_calls([{"name": "f", "arguments": {"x": 1}}])
    cut = parse_completion("still thinking", "thinking")
    assert (cut.reasoning_content, cut.content, cut.tool_calls) == ("still thinking", "", [])
    early = parse_completion("R" + block + EOS, "thinking")  # calls before </think> end the reasoning
    assert (early.reasoning_content, early.content, len(early.tool_calls)) == ("R", "", 1)
    glued = parse_completion("Ok." + block.lstrip("\n"), "chat")  # no blank line before the block
    assert (glued.content, glued.tool_calls[0]["function"]["name"]) == ("Ok.", "f")
    unclosed = parse_completion('Ok.\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="f">\n', "chat")
    assert (unclosed.content, unclosed.tool_calls) == ("Ok.", [])
    v32_block = parse_completion("Ok.\n\n<｜DSML｜function_calls>\n</｜DSML｜function_calls>", "chat")
    assert v32_block.content.startswith("Ok.\n\n<｜DSML｜function_calls>")  # V3.2's block name is text here


# ---- the server's chat format ------------------------------------------------------------------


def test_load_chat_format_picks_the_v4_encoder(tmp_path):
    assert isinstance(load_chat_format(str(tmp_path), "deepseek_v4", {}, {}), DeepSeekV4ChatFormat)


@pytest.mark.parametrize(
    "kwargs, mode, effort",
    [
        ({}, "thinking", None),  # thinking is on by default, as in vLLM's V4 tokenizer
        ({"thinking": False}, "chat", None),
        ({"enable_thinking": False}, "chat", None),
        ({"thinking": False, "enable_thinking": True}, "thinking", None),
        ({"thinking_mode": "chat", "thinking": True}, "chat", None),
        ({"reasoning_effort": "max"}, "thinking", "max"),
        ({"reasoning_effort": "high"}, "thinking", None),
        ({"reasoning_effort": "low"}, "thinking", None),  # not a tier of the release encoder: as high
        ({"reasoning_effort": "none"}, "chat", None),
        ({"reasoning_effort": "max", "thinking": False}, "chat", "max"),
    ],
)
def test_chat_format_options(kwargs, mode, effort):
    assert DeepSeekV4ChatFormat.options(kwargs) == (mode, effort)
    prompt = DeepSeekV4ChatFormat().render(TWO_TURNS, kwargs=kwargs)
    assert prompt.text == encode_messages(TWO_TURNS, mode, reasoning_effort=effort)
    assert prompt.thinking == (mode == "thinking")


def test_chat_format_tools_drop_thinking_and_errors():
    fmt = DeepSeekV4ChatFormat()
    assert fmt.render(TOOL_TURN, TOOLS).text == encode_messages(TOOL_TURN, "thinking", tools=TOOLS)
    kept = fmt.render(TWO_TURNS, kwargs={"drop_thinking": False}).text
    assert f"{ASSISTANT}<think>R1</think>A1{EOS}" in kept
    with pytest.raises(ChatTemplateError, match="DeepSeek-V4 encoding"):
        fmt.render([{"role": "developer", "content": None}])
    with pytest.raises(ChatTemplateError, match="thinking_mode"):
        fmt.render(TWO_TURNS, kwargs={"thinking_mode": "maybe"})
