"""DeepSeek-V3.2 prompt encoding and completion parsing (docs/models.md §6.3).

DeepSeek-V3.2 ships no Jinja chat template, only a Python encoder (``encoding_dsv32.py``); this is
our implementation of the same rules, so that prompts match what the model was trained on:

* prompt = BOS + system text (+ tools block) + turns; a user turn is
  ``<｜User｜>{content}<｜Assistant｜>`` followed by ``<think>`` (thinking mode, last user turn) or
  ``</think>``;
* an assistant turn is ``[{reasoning}</think>]{content}[tool calls]<｜end▁of▁sentence｜>``, where the
  reasoning part only appears in thinking mode after the last user turn (older reasoning is dropped);
* tool calls are DSML blocks; tool results are ``<function_results>`` blocks followed by the think
  marker that reopens the assistant's turn.

Tool-call arguments may be an OpenAI JSON string or a mapping. Messages carry reasoning in
``reasoning_content``.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
THINK_START = "<think>"
THINK_END = "</think>"
DSML = "｜DSML｜"
TOOL_CALLS_BLOCK = "function_calls"  # DeepSeek-V4 names the block "tool_calls"
TOOL_CALLS_LEAD = "\n\n"  # written between the content and the block
TOOL_CALLS_START = f"{TOOL_CALLS_LEAD}<{DSML}{TOOL_CALLS_BLOCK}>"

TOOLS_TEMPLATE = f"""## Tools
You have access to a set of tools you can use to answer the user's question.
You can invoke functions by writing a "<{DSML}function_calls>" block like the following as part of your reply to the user:
<{DSML}function_calls>
<{DSML}invoke name="$FUNCTION_NAME">
<{DSML}parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</{DSML}parameter>
...
</{DSML}invoke>
<{DSML}invoke name="$FUNCTION_NAME2">
...
</{DSML}invoke>
</{DSML}function_calls>
String and scalar parameters should be specified as is without any escaping or quotes, while lists and objects should use JSON format. The "string" attribute should be set to "true" for string type parameters and "false" for other types (numbers, booleans, arrays, objects).
If the thinking_mode is enabled, then after function results you should strongly consider outputting a thinking block. Here is an example:
<{DSML}function_calls>
...
</{DSML}function_calls>
<function_results>
...
</function_results>
{THINK_START}...thinking about results{THINK_END}
Here are the functions available in JSONSchema format:
<functions>
{{schemas}}
</functions>
"""  # noqa: E501 (DeepSeek's own prompt text, byte for byte)

THINKING_MODES = ("chat", "thinking")


def _to_json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def render_tools(tools: Sequence[Mapping[str, Any]]) -> str:
    """The tools block appended to the system prompt (OpenAI ``{"type": "function", ...}`` tools)."""
    return TOOLS_TEMPLATE.replace("{schemas}", "\n".join(_to_json(t.get("function", t)) for t in tools))


def _arguments(call: Mapping[str, Any]) -> dict[str, Any]:
    args = call["arguments"]
    args = json.loads(args) if isinstance(args, str) else args
    if not isinstance(args, Mapping):
        raise ValueError(f"tool call {call.get('name')!r}: arguments must be a JSON object, got {args!r}")
    return dict(args)


def render_tool_calls(tool_calls: Sequence[Mapping[str, Any]], block: str = TOOL_CALLS_BLOCK) -> str:
    """OpenAI tool calls as a DSML ``block`` (led by a blank line): strings raw with
    ``string="true"``, other values as JSON."""
    invokes = []
    for tc in tool_calls:
        call = tc.get("function", tc)
        params = [
            f'<{DSML}parameter name="{key}" string="{"true" if isinstance(value, str) else "false"}">'
            f"{value if isinstance(value, str) else _to_json(value)}</{DSML}parameter>"
            for key, value in _arguments(call).items()
        ]
        invokes.append(f'<{DSML}invoke name="{call["name"]}">\n' + "\n".join(params) + f"\n</{DSML}invoke>")
    return f"{TOOL_CALLS_LEAD}<{DSML}{block}>\n" + "\n".join(invokes) + f"\n</{DSML}{block}>"


def _last_user_index(messages: Sequence[Mapping[str, Any]]) -> int:
    return max((i for i, m in enumerate(messages) if m.get("role") in ("user", "developer")), default=-1)


def _preceding_tool_calls(messages: Sequence[Mapping[str, Any]], index: int) -> tuple[int, list]:
    """(position of this tool result among its group, the tool calls of the assistant turn it answers)."""
    start = index
    while start > 0 and messages[start - 1].get("role") == "tool":
        start -= 1
    owner = messages[start - 1] if start > 0 else {}
    calls = (owner.get("tool_calls") or []) if owner.get("role") == "assistant" else []
    if index - start >= len(calls):
        raise ValueError(f"message {index}: tool result without a matching assistant tool call")
    return index - start, calls


def _render_message(messages: Sequence[Mapping[str, Any]], index: int, thinking: bool, last_user: int) -> str:
    msg = messages[index]
    role, content = msg.get("role"), msg.get("content") or ""
    if role == "system":
        return content
    if role in ("user", "developer"):
        if role == "developer":
            content = f"\n\n# The user's message is: {content}"
        marker = THINK_START if thinking and index == last_user else THINK_END
        return f"{USER}{content}{ASSISTANT}{marker}"
    if role == "assistant":
        reasoning = ""
        if thinking and index > last_user:
            if not (msg.get("reasoning_content") or msg.get("tool_calls")):
                raise ValueError(
                    f"message {index}: thinking mode needs reasoning_content after the last user turn"
                )
            reasoning = (msg.get("reasoning_content") or "") + THINK_END
        calls = render_tool_calls(msg["tool_calls"]) if msg.get("tool_calls") else ""
        return f"{reasoning}{content}{calls}{EOS}"
    if role == "tool":
        position, calls = _preceding_tool_calls(messages, index)
        text = ("\n\n<function_results>" if position == 0 else "") + f"\n<result>{content}</result>"
        if position == len(calls) - 1:  # the last result reopens the assistant's turn
            text += "\n</function_results>\n\n" + (
                THINK_START if thinking and index > last_user else THINK_END
            )
        return text
    raise ValueError(f"message {index}: unknown role {role!r}")


def encode_messages(
    messages: Sequence[Mapping[str, Any]],
    thinking_mode: str = "chat",
    tools: Sequence[Mapping[str, Any]] | None = None,
) -> str:
    """The prompt string (BOS included; tokenize it without adding special tokens).

    ``tools`` (OpenAI format) go into the system prompt; an empty system message is added in
    front when the conversation has none.
    """
    if thinking_mode not in THINKING_MODES:
        raise ValueError(f"thinking_mode must be one of {THINKING_MODES}, got {thinking_mode!r}")
    messages = list(messages)
    if tools:
        if not messages or messages[0].get("role") != "system":
            messages.insert(0, {"role": "system", "content": ""})
        system = messages[0]
        messages[0] = {**system, "content": (system.get("content") or "") + "\n\n" + render_tools(tools)}
    last_user = _last_user_index(messages)
    thinking = thinking_mode == "thinking"
    return BOS + "".join(_render_message(messages, i, thinking, last_user) for i in range(len(messages)))


@dataclasses.dataclass(frozen=True)
class ParsedCompletion:
    """An assistant reply split into OpenAI message fields."""

    reasoning_content: str | None
    content: str
    tool_calls: list[dict[str, Any]]


_INVOKE = re.compile(rf'<{DSML}invoke name="(.*?)">\n(.*?)</{DSML}invoke>', re.DOTALL)
_PARAM = re.compile(
    rf'<{DSML}parameter name="(.*?)" string="(true|false)">(.*?)</{DSML}parameter>', re.DOTALL
)


def _param_value(raw: str, is_string: str) -> Any:
    if is_string == "true":
        return raw
    try:
        return json.loads(raw)
    except json.JSONDecodeError:  # the model wrote a non-JSON value: keep its text
        return raw


def parse_tool_calls(text: str) -> list[dict[str, Any]]:
    """The complete ``invoke`` elements in ``text`` (the inside of a DSML block, whatever the block
    is called), in OpenAI shape with JSON-string arguments; an unclosed one is not a call yet."""
    calls = []
    for name, body in _INVOKE.findall(text):
        args = {key: _param_value(raw, is_str) for key, is_str, raw in _PARAM.findall(body)}
        calls.append({"type": "function", "function": {"name": name, "arguments": _to_json(args)}})
    return calls


def split_tool_calls(text: str, block: str = TOOL_CALLS_BLOCK) -> tuple[str, str | None]:
    """(content, the DSML ``block`` from its opening tag on, or None when there is none). The blank
    line the format writes before the block belongs to neither; a block without it is still one."""
    index = text.find(f"<{DSML}{block}>")
    if index < 0:
        return text, None
    content = text[:index]
    return content.removesuffix(TOOL_CALLS_LEAD), text[index:]


def parse_completion(
    text: str,
    thinking_mode: str = "chat",
    *,
    block: str = TOOL_CALLS_BLOCK,
    block_ends_reasoning: bool = False,
) -> ParsedCompletion:
    """Split generated text (after the prompt) into reasoning, content and DSML tool calls.

    Lenient where generation can legitimately stop early: text after EOS is ignored, a missing
    EOS is fine, and in thinking mode a reply cut off before ``</think>`` is all reasoning. With
    ``block_ends_reasoning`` (DeepSeek-V4) a tool-call block met before ``</think>`` ends the
    reasoning, as DeepSeek's and vLLM's V4 parsers read it. Tool calls come back in OpenAI shape
    with JSON-string arguments.
    """
    if thinking_mode not in THINKING_MODES:
        raise ValueError(f"thinking_mode must be one of {THINKING_MODES}, got {thinking_mode!r}")
    text = text.split(EOS, 1)[0]
    reasoning = None
    if thinking_mode == "thinking":
        reasoning, sep, rest = text.partition(THINK_END)
        early, calls = split_tool_calls(reasoning, block) if block_ends_reasoning else (reasoning, None)
        if calls is not None:
            reasoning, text = early, calls + sep + rest
        elif not sep:
            return ParsedCompletion(reasoning_content=reasoning, content="", tool_calls=[])
        else:
            text = rest
    content, calls = split_tool_calls(text, block)
    tool_calls = parse_tool_calls(calls.split(f"</{DSML}{block}>", 1)[0]) if calls is not None else []
    return ParsedCompletion(reasoning_content=reasoning, content=content, tool_calls=tool_calls)
