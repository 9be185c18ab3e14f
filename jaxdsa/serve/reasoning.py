"""Reasoning parsers: split generated text into ``reasoning_content`` and ``content``.

GLM-4.5+/5 (``glm45``) and DeepSeek-V3.x (``deepseek_v3``) both reason inside ``<think>…</think>``
and both open the block in the prompt when thinking is on, so one splitter serves both: a reply
whose prompt ended with ``<think>`` is reasoning up to ``</think>``; a reply that itself starts
with ``<think>`` (older GLM-4.5 templates) is treated the same; anything else is all content.
The splitter is incremental; the non-streaming result is the same splitter fed the whole text.

DeepSeek-V4 (``deepseek_v4``) may open its ``<｜DSML｜tool_calls>`` block without closing the
reasoning first; as in vLLM's and DeepSeek's own V4 parsers, the block then ends the reasoning and
goes to the content (where the tool parser reads it).
"""

from __future__ import annotations

import dataclasses

from jaxdsa.serve import deepseek_v4_encoding as v4

THINK_START, THINK_END = "<think>", "</think>"


@dataclasses.dataclass(frozen=True)
class ReasoningParser:
    """A ``--reasoning-parser``: the tokens its splitter must see in the text (kept through
    ``skip_special_tokens``) and the markers that end reasoning and begin content."""

    markers: tuple[str, ...] = (THINK_START, THINK_END)
    content_starts: tuple[str, ...] = ()

    def splitter(self, thinking: bool) -> ReasoningSplitter:
        return ReasoningSplitter(thinking, content_starts=self.content_starts)


# --reasoning-parser names (vLLM's).
REASONING_PARSERS = {
    "glm45": ReasoningParser(),
    "deepseek_v3": ReasoningParser(),
    "deepseek_v4": ReasoningParser(
        (THINK_START, THINK_END, v4.DSML), content_starts=(v4.TOOL_CALLS_START, v4.TOOL_CALLS_OPEN)
    ),
}


def held_suffix(text: str, marker: str) -> int:
    """Length of the longest end of ``text`` that could be the start of ``marker``."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class ReasoningSplitter:
    """Streams (reasoning, content) deltas out of text deltas. Reasoning ends at ``end`` (dropped)
    or at the first of ``content_starts`` (kept: it begins the content), whichever comes first."""

    def __init__(
        self,
        thinking: bool,
        start: str = THINK_START,
        end: str = THINK_END,
        content_starts: tuple[str, ...] = (),
    ):
        self._start, self._end, self._content_starts = start, end, content_starts
        self._state = "reasoning" if thinking else "opening"  # opening: might still begin with <think>
        self._buffer = ""
        self.saw_reasoning = thinking

    def feed(self, text: str) -> tuple[str, str]:
        self._buffer += text
        reasoning = content = ""
        if self._state == "opening":
            head = self._buffer.lstrip()
            if self._start.startswith(head) and len(head) < len(self._start):
                return "", ""  # could still be the opening tag
            if head.startswith(self._start):
                self._state, self._buffer, self.saw_reasoning = "reasoning", head[len(self._start) :], True
            else:
                self._state = "content"
        if self._state == "reasoning":
            stops = (self._end, *self._content_starts)
            found = [(i, m) for m in stops if (i := self._buffer.find(m)) >= 0]
            if not found:
                keep = max(held_suffix(self._buffer, m) for m in stops)
                reasoning, self._buffer = (
                    self._buffer[: len(self._buffer) - keep],
                    self._buffer[len(self._buffer) - keep :],
                )
                return reasoning, ""
            index, marker = min(found)
            rest = index + len(marker) if marker == self._end else index
            reasoning, self._buffer = self._buffer[:index], self._buffer[rest:]
            self._state = "content"
        content, self._buffer = self._buffer, ""
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """Flush what was held back: an unterminated reasoning block stays reasoning."""
        rest, self._buffer = self._buffer, ""
        return (rest, "") if self._state == "reasoning" else ("", rest)
