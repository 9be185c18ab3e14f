"""DeepSeek-V4 prompt encoding and completion parsing (docs/models.md §6.4).

DeepSeek-V4 ships no Jinja chat template but a Python encoder, ``encoding/encoding_dsv4.py``,
with the structure of V3.2's (``jaxdsa.serve.deepseek_encoding``, whose DSML helpers this module uses).
This is our implementation of its rules:

* prompt = BOS, then, in thinking mode with ``reasoning_effort="max"``, :data:`REASONING_EFFORT_MAX`
  (``"high"`` and None add nothing), then the messages;
* system: its text, then ``\\n\\n`` + the tools block when it carries tools (request-level tools go on
  the first message when that is a system or developer message, else on a new empty system message
  in front, as vLLM's V4 tokenizer does);
* user: ``<｜User｜>{content}``. Tool results are not a role of their own: each ``tool`` message
  becomes a ``<tool_result>{content}</tool_result>`` block of a user turn; consecutive user and
  tool messages form one turn, blocks joined by ``\\n\\n``, tool results put in the order of the
  assistant's ``tool_calls`` (matched on ``tool_call_id``);
* developer: ``<｜User｜>{content}`` then its tools block (non-empty content required);
* a user or developer turn followed by an assistant turn (or ending the conversation) is closed by
  ``<｜Assistant｜>`` + ``<think>`` (thinking mode, the last user turn) or ``</think>``;
* assistant: ``[{reasoning}</think>]{content}[\\n\\n<｜DSML｜tool_calls>…]<｜end▁of▁sentence｜>``, the
  reasoning part in thinking mode after the last user turn only;
* ``drop_thinking`` (default on) is what drops older reasoning; it is off whenever a message
  carries tools, and then every user turn opens ``<think>`` and every assistant turn keeps its
  reasoning (thinking mode). With it on, developer turns before the last user turn are dropped.

Differences from V3.2: the ``tool_calls`` block name and the tools prompt text; ``<tool_result>``
user turns instead of ``<function_results>``; the developer turn; the effort prefix; and no
requirement that an assistant turn in thinking mode carries reasoning.

Messages carry reasoning in ``reasoning_content`` (or ``reasoning``, vLLM's name); tool-call
arguments may be an OpenAI JSON string or a mapping.

Sources: DeepSeek's ``encoding_dsv4.py`` as vendored in vLLM (``vllm/tokenizers/
deepseek_v4_encoding.py``) and its README; vLLM's V4 tokenizer wrapper (tools placement, the
thinking and effort options); DeepSeek's ``deepseek-recipe`` 0.2.0 renderer, which agrees with the
rules above on two-turn, tool-call, tool-result and thinking-drop prompts.

Unverified or left out:

* ``<｜latest_reminder｜>`` messages and the quick-instruction ``task`` tokens (internal; our
  protocol has no such role): not supported. (deepseek-recipe 0.2.0 puts a reminder before
  ``<｜Assistant｜>``; the vendored encoder after it.)
* ``response_format`` schema text on system messages (only ``{"type": "text"}`` is accepted).
* Where deepseek-recipe 0.2.0 (a later release) renders differently, the vendored encoder is
  followed: in chat mode with tools, older assistant turns there keep ``<think>{reasoning}</think>``
  (here: ``</think>`` and no reasoning); with tools in thinking mode, an older assistant turn
  without reasoning there opens with ``</think>`` (here: ``<think></think>``).
* A zero-argument call renders ``<｜DSML｜invoke name="f">\\n\\n</｜DSML｜invoke>`` as the vendored
  encoder does; deepseek-recipe 0.2.0 writes a single newline there.
* Later checkpoints (DeepSeek-V4 "0731") use three effort tiers (low: nothing, high: this module's
  max text, max: a stronger text); only the release rules above are implemented.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from jaxdsa.serve import deepseek_encoding as v32
from jaxdsa.serve.deepseek_encoding import (
    ASSISTANT,
    BOS,
    DSML,
    EOS,
    THINK_END,
    THINK_START,
    THINKING_MODES,
    USER,
    ParsedCompletion,
)

TOOL_CALLS_BLOCK = "tool_calls"
TOOL_CALLS_OPEN = f"<{DSML}{TOOL_CALLS_BLOCK}>"
TOOL_CALLS_START = v32.TOOL_CALLS_LEAD + TOOL_CALLS_OPEN
REASONING_EFFORTS = (None, "high", "max")

REASONING_EFFORT_MAX = (
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively decompose the problem to resolve "
    "the root cause, rigorously stress-testing your logic against all potential paths, edge cases, "
    "and adversarial scenarios.\n"
    "Explicitly write out your entire deliberation process, documenting every intermediate step, "
    "considered alternative, and rejected hypothesis to ensure absolutely no assumption is left "
    "unchecked.\n\n"
)

TOOLS_TEMPLATE = f"""## Tools

You have access to a set of tools to help answer the user's question. You can invoke tools by writing a "<{DSML}tool_calls>" block like the following:

<{DSML}tool_calls>
<{DSML}invoke name="$TOOL_NAME">
<{DSML}parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</{DSML}parameter>
...
</{DSML}invoke>
<{DSML}invoke name="$TOOL_NAME2">
...
</{DSML}invoke>
</{DSML}tool_calls>

String parameters should be specified as is and set `string="true"`. For all other types (numbers, booleans, arrays, objects), pass the value in JSON format and set `string="false"`.

If thinking_mode is enabled (triggered by {THINK_START}), you MUST output your complete reasoning inside {THINK_START}...{THINK_END} BEFORE any tool calls or final response.

Otherwise, output directly after {THINK_END} with tool calls or final response.

### Available Tool Schemas

{{schemas}}

You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.
"""  # noqa: E501 (DeepSeek's own prompt text, byte for byte)


def render_tools(tools: Sequence[Mapping[str, Any]]) -> str:
    """The tools block (OpenAI ``{"type": "function", ...}`` tools): one JSON schema per line."""
    schemas = "\n".join(v32._to_json(t.get("function", t)) for t in tools)
    return TOOLS_TEMPLATE.replace("{schemas}", schemas)


def render_tool_calls(tool_calls: Sequence[Mapping[str, Any]]) -> str:
    """OpenAI tool calls as V4's ``tool_calls`` DSML block, led by a blank line."""
    return v32.render_tool_calls(tool_calls, block=TOOL_CALLS_BLOCK)


def _merge_turns(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Consecutive user and tool messages as one user turn of ``blocks``: ("text", content, "") or
    ("tool_result", content, tool_call_id); each turn's tool results in their calls' order."""
    merged: list[dict[str, Any]] = []
    order: dict[str, int] = {}  # tool_call_id -> position in the latest assistant turn's calls
    for msg in messages:
        role = msg.get("role")
        if role == "assistant" and msg.get("tool_calls"):
            order = {tc["id"]: i for i, tc in enumerate(msg["tool_calls"]) if tc.get("id")}
        if role not in ("user", "tool"):
            merged.append(dict(msg))
            continue
        kind = "text" if role == "user" else "tool_result"
        block = (kind, msg.get("content") or "", msg.get("tool_call_id") or "")
        if merged and "blocks" in merged[-1]:
            merged[-1]["blocks"].append(block)
        else:
            merged.append({"role": "user", "blocks": [block], "order": order})
    for turn in merged:
        blocks = turn.get("blocks", ())
        results = [b for b in blocks if b[0] == "tool_result"]
        if len(results) > 1 and turn["order"]:
            ranked = iter(sorted(results, key=lambda b: turn["order"].get(b[2], 0)))
            turn["blocks"] = [next(ranked) if b[0] == "tool_result" else b for b in blocks]
    return merged


def _last_user_index(messages: Sequence[Mapping[str, Any]]) -> int:
    return max((i for i, m in enumerate(messages) if m.get("role") in ("user", "developer")), default=-1)


def _drop_old_turns(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Thinking mode with drop_thinking: developer turns before the last user turn go (older
    assistant reasoning is not rendered anyway)."""
    last_user = _last_user_index(messages)
    return [m for i, m in enumerate(messages) if m.get("role") != "developer" or i >= last_user]


def _user_text(turn: Mapping[str, Any]) -> str:
    return "\n\n".join(
        text if kind == "text" else f"<tool_result>{text}</tool_result>" for kind, text, _ in turn["blocks"]
    )


def _render(
    messages: Sequence[Mapping[str, Any]], index: int, thinking: bool, drop: bool, effort: str | None
) -> str:
    msg, last_user = messages[index], _last_user_index(messages)
    role, content = msg.get("role"), msg.get("content") or ""
    text = REASONING_EFFORT_MAX if index == 0 and thinking and effort == "max" else ""
    tools = "\n\n" + render_tools(msg["tools"]) if msg.get("tools") else ""
    if role == "system":
        text += content + tools
    elif role == "developer":
        if not content:
            raise ValueError(f"message {index}: a developer message needs content")
        text += USER + content + tools
    elif role == "user":
        text += USER + _user_text(msg)
    elif role == "assistant":
        if thinking and (not drop or index > last_user):
            reasoning = msg.get("reasoning_content") or msg.get("reasoning") or ""
            text += reasoning + THINK_END
        text += content + (render_tool_calls(msg["tool_calls"]) if msg.get("tool_calls") else "") + EOS
    else:
        raise ValueError(f"message {index}: role {role!r} is not supported by the DeepSeek-V4 encoding")
    following = messages[index + 1].get("role") if index + 1 < len(messages) else None
    if role in ("user", "developer") and following in (None, "assistant"):
        text += ASSISTANT + (THINK_START if thinking and (not drop or index >= last_user) else THINK_END)
    return text


def encode_messages(
    messages: Sequence[Mapping[str, Any]],
    thinking_mode: str = "chat",
    tools: Sequence[Mapping[str, Any]] | None = None,
    reasoning_effort: str | None = None,
    drop_thinking: bool = True,
) -> str:
    """The prompt string (BOS included; tokenize it without adding special tokens)."""
    if thinking_mode not in THINKING_MODES:
        raise ValueError(f"thinking_mode must be one of {THINKING_MODES}, got {thinking_mode!r}")
    if reasoning_effort not in REASONING_EFFORTS:
        raise ValueError(f"reasoning_effort must be one of {REASONING_EFFORTS}, got {reasoning_effort!r}")
    messages = [dict(m) for m in messages]
    if tools:
        if messages and messages[0].get("role") in ("system", "developer"):
            messages[0]["tools"] = list(tools)
        else:
            messages.insert(0, {"role": "system", "content": "", "tools": list(tools)})
    messages = _merge_turns(messages)
    thinking = thinking_mode == "thinking"
    drop = drop_thinking and not any(m.get("tools") for m in messages)
    if thinking and drop:
        messages = _drop_old_turns(messages)
    return BOS + "".join(_render(messages, i, thinking, drop, reasoning_effort) for i in range(len(messages)))


def parse_completion(text: str, thinking_mode: str = "chat") -> ParsedCompletion:
    """Split generated text into reasoning, content and tool calls (see
    :func:`jaxdsa.serve.deepseek_encoding.parse_completion`); a ``tool_calls`` block before ``</think>``
    ends the reasoning."""
    return v32.parse_completion(text, thinking_mode, block=TOOL_CALLS_BLOCK, block_ends_reasoning=True)
