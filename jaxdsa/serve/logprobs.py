"""The engine's per-token logprobs in OpenAI's two response shapes.

Chat completions: ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}]}``.
Completions (the legacy shape): ``{"tokens", "token_logprobs", "top_logprobs": [{token: logprob}],
"text_offset"}``, led by the prompt's entries with ``echo``. Every generated token has an entry,
a final EOS or stop token included (its text is hidden, its probability is still the model's);
streamed chunks carry the entries of the tokens that arrived since the previous chunk, so the
entries of all chunks are the non-streamed list. Token strings are single-token decodes, as in
vLLM.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from jaxdsa.engine import TokenLogprobs
from jaxdsa.serve.tokenizer import Tokenizer

# JSON has no -inf; vLLM reports impossible tokens with this value.
_FLOOR = -9999.0


def _lp(value: float) -> float:
    return max(value, _FLOOR)


class LogprobsFormatter:
    """One choice's logprobs; keeps the running ``text_offset`` of the completions shape."""

    def __init__(self, tokenizer: Tokenizer):
        self._tok = tokenizer
        self._offset = 0

    def _chat_entry(self, token_id: int, logprob: float) -> dict[str, Any]:
        return {
            "token": self._tok.token_text(token_id),
            "logprob": _lp(logprob),
            "bytes": list(self._tok.token_bytes(token_id)),
        }

    def chat(self, entries: Iterable[TokenLogprobs]) -> dict[str, Any]:
        content = [
            {
                **self._chat_entry(e.token_id, e.logprob),
                "top_logprobs": [self._chat_entry(i, lp) for i, lp in e.top],
            }
            for e in entries
        ]
        return {"content": content}

    def completion(
        self, entries: Iterable[TokenLogprobs | None], prompt_ids: list[int] | None = None
    ) -> dict[str, Any]:
        """Entries in order; an echoed prompt leads them, and its first token has none: that
        position gets ``prompt_ids[0]``'s text and ``None`` logprob and top (OpenAI's and vLLM's echo)."""
        out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for k, e in enumerate(entries):
            token_id = e.token_id if e is not None else prompt_ids[k]
            text = self._tok.token_text(token_id)
            out["tokens"].append(text)
            out["text_offset"].append(self._offset)
            self._offset += len(text)
            if e is None:
                out["token_logprobs"].append(None)
                out["top_logprobs"].append(None)
                continue
            out["token_logprobs"].append(_lp(e.logprob))
            top: dict[str, float] = {}
            for i, lp in e.top:  # tokens that decode alike (partial characters) keep the likelier
                top.setdefault(self._tok.token_text(i), _lp(lp))
            out["top_logprobs"].append(top)
        return out
