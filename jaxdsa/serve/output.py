"""From engine tokens to what a response carries: text deltas, then reasoning / content / tool calls.

:class:`TextOutput` is one choice's text: incremental detokenization, stop strings (the engine
only knows stop *token ids*), and the hidden final stop token (EOS is never shown, as in vLLM).
:class:`ReplyParser` chains the reasoning splitter and the tool-call parser over those deltas.
Streaming and non-streaming responses both run these, so they always agree; so does
``jaxdsa.LLM.generate`` / ``.chat``, which drive the same objects from the engine's outputs (this
module, like the parsers and the tokenizer, imports no FastAPI).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from jaxdsa.engine import FinishReason, RequestOutput, SamplingParams
from jaxdsa.serve.reasoning import REASONING_PARSERS, ReasoningSplitter
from jaxdsa.serve.tokenizer import IncrementalDetokenizer, Tokenizer
from jaxdsa.serve.tool_parsers import TOOL_PARSERS, ToolCall, ToolParser


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

    def finish_reason(self, out: RequestOutput) -> str | None:
        """Why the choice ended with ``out`` (after :meth:`push`): "stop" for a stop string, else
        the engine's reason; None while it goes on."""
        if self.stopped:
            return "stop"
        return out.finish_reason.value if out.finished else None

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

    def __iadd__(self, other: ReplyDelta) -> ReplyDelta:
        self.reasoning += other.reasoning
        self.content += other.content
        self.tool_calls += other.tool_calls
        return self


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

    def finish_reason(self, finish_reason: str | None) -> str | None:
        """The choice's finish reason: "tool_calls" when a reply that stopped made calls."""
        return "tool_calls" if self.num_tool_calls and finish_reason == "stop" else finish_reason

    def message(self, reply: ReplyDelta) -> dict[str, Any]:
        """The whole reply as OpenAI's assistant message: ``reasoning_content`` with a reasoning
        parser (None unless the reply reasoned), ``tool_calls`` when there are any (``content``
        None when they came without text)."""
        message: dict[str, Any] = {"role": "assistant", "content": reply.content}
        if self.reasoning is not None:
            message["reasoning_content"] = reply.reasoning if self.reasoning.saw_reasoning else None
        if reply.tool_calls:
            message["tool_calls"] = [t.to_openai() for t in reply.tool_calls]
            message["content"] = reply.content or None
        return message


def parser_markers(reasoning_parser: str | None, tool_parser: str | None) -> tuple[str, ...]:
    """The tokens the parsers must see in the text (kept through ``skip_special_tokens``)."""
    return (REASONING_PARSERS[reasoning_parser].markers if reasoning_parser else ()) + (
        TOOL_PARSERS[tool_parser].markers if tool_parser else ()
    )


def reply_parser(
    reasoning_parser: str | None,
    tool_parser: str | None,
    tools: Sequence[Mapping[str, Any]] | None,
    thinking: bool,
) -> ReplyParser:
    """One choice's parser: reasoning split by ``reasoning_parser`` (the reply starts inside the
    reasoning block when the prompt opened it: ``thinking``), tool calls of ``tools`` by
    ``tool_parser``; None parses nothing of that kind."""
    return ReplyParser(
        REASONING_PARSERS[reasoning_parser].splitter(thinking) if reasoning_parser else None,
        TOOL_PARSERS[tool_parser](tools) if tool_parser else None,
    )


def text_output(
    tokenizer: Tokenizer,
    eos_token_ids: frozenset[int],
    sp: SamplingParams,
    *,
    stop: list[str],
    skip_special_tokens: bool,
    keep: tuple[str, ...] = (),
) -> TextOutput:
    """One choice's text: skipped special tokens (but the parsers' ``keep`` markers), ``stop``
    strings, and its hidden stop tokens (EOS unless ignored, ``sp.stop_token_ids``)."""
    skip = tokenizer.skip_ids(skip_special_tokens=skip_special_tokens, keep=keep)
    hidden = sp.stop_ids(eos_token_ids)
    return TextOutput(tokenizer, skip_ids=skip, stop=stop, hidden_ids=hidden, min_tokens=sp.min_tokens)
