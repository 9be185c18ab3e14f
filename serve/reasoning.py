"""Reasoning parsers: split generated text into ``reasoning_content`` and ``content``.

GLM-4.5+/5 (``glm45``) and DeepSeek-V3.x (``deepseek_v3``) both reason inside ``<think>…</think>``
and both open the block in the prompt when thinking is on, so one splitter serves both: a reply
whose prompt ended with ``<think>`` is reasoning up to ``</think>``; a reply that itself starts
with ``<think>`` (older GLM-4.5 templates) is treated the same; anything else is all content.
The splitter is incremental; the non-streaming result is the same splitter fed the whole text.
"""

from __future__ import annotations

THINK_START, THINK_END = "<think>", "</think>"

# --reasoning-parser names (vLLM's) -> the marker tokens their splitter needs to see.
REASONING_PARSERS = {"glm45": (THINK_START, THINK_END), "deepseek_v3": (THINK_START, THINK_END)}


def held_suffix(text: str, marker: str) -> int:
    """Length of the longest end of ``text`` that could be the start of ``marker``."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class ReasoningSplitter:
    """Streams (reasoning, content) deltas out of text deltas."""

    def __init__(self, thinking: bool, start: str = THINK_START, end: str = THINK_END):
        self._start, self._end = start, end
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
            index = self._buffer.find(self._end)
            if index < 0:
                keep = held_suffix(self._buffer, self._end)
                reasoning, self._buffer = (
                    self._buffer[: len(self._buffer) - keep],
                    self._buffer[len(self._buffer) - keep :],
                )
                return reasoning, ""
            reasoning, self._buffer = self._buffer[:index], self._buffer[index + len(self._end) :]
            self._state = "content"
        content, self._buffer = self._buffer, ""
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """Flush what was held back: an unterminated reasoning block stays reasoning."""
        rest, self._buffer = self._buffer, ""
        return (rest, "") if self._state == "reasoning" else ("", rest)
