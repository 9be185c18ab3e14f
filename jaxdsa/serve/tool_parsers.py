"""Tool-call parsers: generated text -> content + OpenAI ``tool_calls``.

``glm47`` (GLM-4.5/4.7/5; also registered as ``glm45``) reads
``<tool_call>name<arg_key>k</arg_key><arg_value>v</arg_value>…</tool_call>``: values are JSON when
they parse (and the tool schema does not say ``string``), else raw strings (docs/models.md §6.2).
``deepseek_v32`` reads DeepSeek-V3.2's DSML ``function_calls`` block and ``deepseek_v4``
DeepSeek-V4's ``tool_calls`` block through ``jaxdsa.serve.deepseek_encoding`` (vLLM's names).

All share one incremental shape, as vLLM's parsers behave: text before the first call marker is
content (streamed, holding back a partial marker, and without the blank line DeepSeek writes before
its block); each complete call is emitted whole, once; text between or after calls is dropped. If
generation ends without one complete call, the raw text from the marker on (blank line included)
is returned as content so nothing is lost. Non-streaming parsing is the same parser fed the whole
text.
"""

from __future__ import annotations

import dataclasses
import json
import re
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from jaxdsa.serve import deepseek_encoding, deepseek_v4_encoding
from jaxdsa.serve.reasoning import held_suffix


@dataclasses.dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object, as OpenAI sends it
    id: str = dataclasses.field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def to_openai(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


class ToolParser:
    """Content until ``start``; afterwards complete calls as ``_calls`` finds them."""

    start: str
    lead = ""  # what the format writes right before ``start``: not content when the calls follow
    markers: tuple[str, ...]  # tokens that must survive skip_special_tokens for this parser

    def __init__(self, tools: Sequence[Mapping[str, Any]] | None = None):
        self._tools = {
            t["function"]["name"]: t["function"]
            for t in tools or ()
            if t.get("type", "function") == "function"
        }
        self._content = ""  # content held back (a partial start marker)
        self._region: str | None = None  # text from the first start marker on
        self._emitted = 0

    def _calls(self, region: str) -> list[tuple[str, dict[str, Any]]]:
        raise NotImplementedError

    def _new_calls(self) -> list[ToolCall]:
        calls = self._calls(self._region)[self._emitted :]
        self._emitted += len(calls)
        return [ToolCall(name, json.dumps(args, ensure_ascii=False)) for name, args in calls]

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        if self._region is not None:
            self._region += text
            return "", self._new_calls()
        self._content += text
        index = self._content.find(self.start)
        if index >= 0:
            if self.lead and self._content[:index].endswith(self.lead):
                index -= len(self.lead)
            content, self._region, self._content = self._content[:index], self._content[index:], ""
            return content, self._new_calls()
        keep = max(held_suffix(self._content, self.lead + self.start), held_suffix(self._content, self.start))
        content, self._content = (
            self._content[: len(self._content) - keep],
            self._content[len(self._content) - keep :],
        )
        return content, []

    def finish(self) -> tuple[str, list[ToolCall]]:
        if self._region is None:
            content, self._content = self._content, ""
            return content, []
        calls = self._new_calls()
        if self._emitted == 0:  # a call cut off before it closed: keep its text
            return self._region, []
        return "", calls


def _typed_value(raw: str, schema: Mapping[str, Any] | None) -> Any:
    """A GLM argument value: raw text for string parameters, else JSON when it parses."""
    declared = (schema or {}).get("type")
    if declared == "string" or (isinstance(declared, list) and declared == ["string"]):
        return raw
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        return raw


class Glm47ToolParser(ToolParser):
    start = "<tool_call>"
    markers = ("<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>")
    _BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
    _NAME = re.compile(r"\s*([^\s<]+)")
    _ARG = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)

    def _calls(self, region: str) -> list[tuple[str, dict[str, Any]]]:
        calls = []
        for body in self._BLOCK.findall(region):
            name = self._NAME.match(body)
            if name is None:
                continue  # no function name: not a call
            properties = (self._tools.get(name.group(1), {}).get("parameters") or {}).get("properties") or {}
            args = {k.strip(): _typed_value(v, properties.get(k.strip())) for k, v in self._ARG.findall(body)}
            calls.append((name.group(1), args))
        return calls


class DeepSeekV32ToolParser(ToolParser):
    block = deepseek_encoding.TOOL_CALLS_BLOCK
    start = f"<{deepseek_encoding.DSML}{block}>"
    lead = deepseek_encoding.TOOL_CALLS_LEAD
    markers = (deepseek_encoding.DSML,)

    def _calls(self, region: str) -> list[tuple[str, dict[str, Any]]]:
        block = region.split(f"</{deepseek_encoding.DSML}{self.block}>", 1)[0]
        calls = deepseek_encoding.parse_tool_calls(block)
        return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


class DeepSeekV4ToolParser(DeepSeekV32ToolParser):
    block = deepseek_v4_encoding.TOOL_CALLS_BLOCK
    start = deepseek_v4_encoding.TOOL_CALLS_OPEN


TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "glm47": Glm47ToolParser,
    "glm45": Glm47ToolParser,
    "deepseek_v32": DeepSeekV32ToolParser,
    "deepseek_v4": DeepSeekV4ToolParser,
}
