#!/usr/bin/env python3
"""Compare ``jaxdsa.serve.deepseek_v4_encoding`` with DeepSeek's own renderer (not part of CI).

    pip install deepseek-recipe     # DeepSeek's reference encoder (Rust, abi3 wheels), into any venv
    <venv>/bin/python tests/reference/check_v4_encoding.py

deepseek-recipe 0.2.0 renders a later V4 release than the ``encoding_dsv4.py`` rules we follow, so
its effort tiers are mapped (our "max" paragraph is its "high", our none its "low") and the known
differences are expected, not failures (``jaxdsa/serve/deepseek_v4_encoding.py`` lists them): in chat mode
with tools it keeps older reasoning, and with tools it opens a reasoning-less older assistant turn
with ``</think>``. Every other conversation must render byte for byte the same. Needs only the
standard library besides deepseek_recipe (our encoder imports nothing else).
"""

from __future__ import annotations

import itertools
import json
import pathlib
import sys

import deepseek_recipe as dr

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))
from jaxdsa.serve.deepseek_v4_encoding import encode_messages  # noqa: E402

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER},
    },
    {
        "type": "function",
        "function": {"name": "now", "description": "Time", "parameters": {"type": "object"}},
    },
]
CALLS = [
    {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": json.dumps(
        {"city": "Paris", "days": 3, "x": [1, {"a": None}], "b": True})}},
    {"id": "c2", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}},
]  # fmt: skip
S = {"role": "system", "content": "You are helpful."}
U1 = {"role": "user", "content": "Weather in Paris and Oslo? 🙂"}
U2 = {"role": "user", "content": "Thanks. And tomorrow?"}
U3 = {"role": "user", "content": "Also: details"}
CALL = {
    "role": "assistant",
    "content": "Let me check.",
    "reasoning_content": "Need tools.",
    "tool_calls": CALLS,
}
BARE_CALL = {**CALL, "content": ""}
T1 = {"role": "tool", "tool_call_id": "c1", "content": '{"temp": 20}'}
T2 = {"role": "tool", "tool_call_id": "c2", "content": "cold"}
ANSWER = {"role": "assistant", "content": "Paris 20, Oslo cold.", "reasoning_content": "Summarize."}
HELLO = {"role": "assistant", "content": "Hello!", "reasoning_content": "Greet back."}
PLAIN = {"role": "assistant", "content": "A"}
CONVERSATIONS = {
    "one user": [U1],
    "system user": [S, U1],
    "two turns": [S, U1, HELLO, U2],
    "two users": [S, U1, U3],
    "tool results, out of order": [S, U1, CALL, T2, T1],
    "tool results, no content": [U1, BARE_CALL, T1, T2],
    "answer then user": [S, U1, CALL, T1, T2, ANSWER, U2],
    "results and user text": [S, U1, CALL, T1, T2, U3],
    "answer without reasoning": [S, U1, PLAIN, U2],
}


def recipe_messages(messages: list[dict]) -> list[dr.Message]:
    out: list[dr.Message] = []
    for m in messages:
        role, content = m["role"], m.get("content") or ""
        if role == "system":
            out.append(dr.SystemMessage(content))
        elif role == "user":
            out.append(dr.UserMessage(content))
        elif role == "tool":
            out.append(dr.ToolMessage(content, m["tool_call_id"]))
        else:
            calls = [
                dr.ToolCall(c["id"], c["function"]["name"], c["function"]["arguments"])
                for c in m.get("tool_calls", [])
            ]
            out.append(dr.AssistantMessage(content, m.get("reasoning_content"), calls or None))
    return out


def expected_difference(messages: list[dict], thinking: bool, tools: bool) -> bool:
    history = any(m["role"] == "assistant" for m in messages)
    return tools and history and (not thinking or PLAIN in messages)


def main() -> int:
    encoding = dr.DeepseekV4Encoding()
    definitions = [dr.ToolDefinition(**t["function"]) for t in TOOLS]
    same = differ = failed = 0
    for (name, messages), thinking, tools, effort in itertools.product(
        CONVERSATIONS.items(), (True, False), (True, False), (None, "max")
    ):
        ours = encode_messages(
            messages,
            "thinking" if thinking else "chat",
            tools=TOOLS if tools else None,
            reasoning_effort=effort,
        )
        conversation = dr.Conversation(
            recipe_messages(messages),
            thinking_mode=thinking,
            tools=definitions if tools else None,
            reasoning_effort="high" if effort == "max" else "low",
        )
        theirs = encoding.render_conversation(conversation).prompt
        case = f"{name} / {'thinking' if thinking else 'chat'} / tools {tools} / effort {effort}"
        if ours == theirs:
            same += 1
        elif expected_difference(messages, thinking, tools):
            differ += 1
        else:
            failed += 1
            print(f"MISMATCH {case}\n  ours:   {ours!r}\n  recipe: {theirs!r}")
    print(
        f"deepseek-recipe {dr.__version__}: {same} identical, {differ} known differences, {failed} mismatches"
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
