"""From engine tokens to what a response carries: text deltas, then reasoning / content / tool calls.

:class:`TextOutput` is one choice's text: incremental detokenization, stop strings (the engine
only knows stop *token ids*), and the hidden final stop token (EOS is never shown, as in vLLM).
:class:`ReplyParser` chains the reasoning splitter and the tool-call parser over those deltas.
Streaming and non-streaming responses both run these, so they always agree.
"""

from __future__ import annotations

import dataclasses

from jaxdsa.engine import FinishReason, RequestOutput
from serve.reasoning import ReasoningSplitter
from serve.tokenizer import IncrementalDetokenizer, Tokenizer
from serve.tool_parsers import ToolCall, ToolParser


class TextOutput:
    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        skip_ids: frozenset[int],
        stop: list[str],
        hidden_ids: frozenset[int],
        min_tokens: int = 0,
    ):
        self._detok = IncrementalDetokenizer(tokenizer, skip_ids)
        self._stop = stop
        self._min_tokens = min_tokens  # stop strings count only once this many tokens are out (vLLM)
        self._hold = max((len(s) for s in stop), default=1) - 1  # a stop string may still be forming
        self._hidden = hidden_ids
        self._text = ""
        self._sent = 0
        self.stopped = False  # a stop string ended the reply

    def push(self, out: RequestOutput) -> str:
        """The text this engine output adds that is safe to send now."""
        ids = out.new_token_ids
        if out.finished and out.finish_reason is FinishReason.STOP and ids and ids[-1] in self._hidden:
            ids = ids[:-1]
        text = self._detok.push(ids, final=out.finished)
        return self._append(text, final=out.finished, search=out.num_output_tokens >= self._min_tokens)

    def _append(self, text: str, final: bool, search: bool) -> str:
        search_from = max(0, len(self._text) - self._hold)
        self._text += text
        hits = [i for i in (self._text.find(s, search_from) for s in self._stop) if i >= 0] if search else []
        if hits:
            self._text, self.stopped, final = self._text[: min(hits)], True, True
        end = len(self._text) if final else max(self._sent, len(self._text) - self._hold)
        delta, self._sent = self._text[self._sent : end], end
        return delta


@dataclasses.dataclass
class ReplyDelta:
    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCall] = dataclasses.field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.tool_calls)


class ReplyParser:
    """Reasoning first (on the raw text), then tool calls (on the content)."""

    def __init__(self, reasoning: ReasoningSplitter | None, tools: ToolParser | None):
        self.reasoning, self.tools = reasoning, tools
        self.num_tool_calls = 0

    def _split(self, reasoning: str, content: str, final: bool) -> ReplyDelta:
        calls: list[ToolCall] = []
        if self.tools is not None:
            content, calls = self.tools.feed(content)
            if final:
                tail, more = self.tools.finish()
                content, calls = content + tail, calls + more
        self.num_tool_calls += len(calls)
        return ReplyDelta(reasoning, content, calls)

    def feed(self, text: str) -> ReplyDelta:
        reasoning, content = self.reasoning.feed(text) if self.reasoning else ("", text)
        return self._split(reasoning, content, final=False)

    def finish(self) -> ReplyDelta:
        reasoning, content = self.reasoning.finish() if self.reasoning else ("", "")
        return self._split(reasoning, content, final=True)
