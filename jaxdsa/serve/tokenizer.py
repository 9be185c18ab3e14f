"""A checkpoint's tokenizer (``tokenizer.json`` + ``tokenizer_config.json``) without transformers.

The ``tokenizers`` library does the work; this wrapper adds what the server needs from the config
(special-token strings for chat templates, which ids are "special" for ``skip_special_tokens``) and
the incremental detokenizer used for streaming.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Iterable
from typing import Any

from tokenizers import Tokenizer as _HFTokenizer
from tokenizers import decoders

# The special-token attributes HF passes to chat templates (``special_tokens_map``).
_SPECIAL_TOKEN_KEYS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)


def _token_text(value: Any) -> str | None:
    """tokenizer_config stores a token as a string or as an AddedToken dict ``{"content": ...}``."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


class Tokenizer:
    """Encode / decode with a checkpoint's fast tokenizer."""

    def __init__(self, model_dir: str | os.PathLike):
        model_dir = os.fspath(model_dir)
        path = os.path.join(model_dir, "tokenizer.json")
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{model_dir}: no tokenizer.json (jaxdsa needs a fast tokenizer file)")
        try:
            self._tok = _HFTokenizer.from_file(path)
        except Exception as e:  # the tokenizers library raises plain Exceptions for unreadable files
            raise ValueError(f"{path}: cannot load: {e}") from e
        config_path = os.path.join(model_dir, "tokenizer_config.json")
        self.config: dict[str, Any] = {}
        if os.path.isfile(config_path):
            with open(config_path, encoding="utf-8") as fh:
                self.config = json.load(fh)
        self.special_tokens_map: dict[str, Any] = {
            key: text
            for key in _SPECIAL_TOKEN_KEYS
            if (text := _token_text(self.config.get(key))) is not None
        }
        extra = [t for t in map(_token_text, self.config.get("additional_special_tokens") or []) if t]
        self.special_tokens_map["additional_special_tokens"] = extra
        added = self._tok.get_added_tokens_decoder()
        self.special_ids = frozenset(i for i, tok in added.items() if tok.special)
        self._added_ids = frozenset(added)
        self._byte_level = isinstance(self._tok.decoder, decoders.ByteLevel)
        # Per-instance caches: logprobs look the same few thousand tokens up again and again.
        self.token_text = functools.lru_cache(maxsize=1 << 16)(self._token_text)
        self.token_bytes = functools.lru_cache(maxsize=1 << 16)(self._token_bytes)
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Iterable[int], *, skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def _token_text(self, token_id: int) -> str:
        """One token decoded on its own (as vLLM reports logprob tokens): part of a multi-byte
        character decodes to U+FFFD; :meth:`token_bytes` has the exact bytes."""
        return self._tok.decode([token_id], skip_special_tokens=False)

    def _token_bytes(self, token_id: int) -> bytes:
        """The exact bytes a token stands for (OpenAI's logprob ``bytes``).

        Byte-level BPE vocabularies (GLM, DeepSeek) spell each byte as one printable character;
        that spelling is undone here. Added tokens are their text; other vocabularies fall back to
        the UTF-8 of :meth:`token_text`.
        """
        piece = self._tok.id_to_token(token_id)
        if self._byte_level and piece is not None and token_id not in self._added_ids:
            return bytes(_BYTE_OF_CHAR[c] for c in piece)
        return self._token_text(token_id).encode("utf-8")

    def skip_ids(self, *, skip_special_tokens: bool, keep: Iterable[str] = ()) -> frozenset[int]:
        """Ids to drop from output text: the special ones, except the single-token ``keep`` markers.

        Parsers need their markers (``</think>``, ``<tool_call>``, ...) in the text even when they
        are special tokens, while the user's ``skip_special_tokens`` still hides the others.
        """
        if not skip_special_tokens:
            return frozenset()
        kept = {self.token_to_id(t) for t in keep}
        return self.special_ids - kept


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte -> printable character map, inverted: printable Latin-1 bytes stand for
    themselves, the other 68 bytes for the characters from U+0100 on, in byte order."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("\xa1"), ord("\xac") + 1),
        *range(ord("\xae"), ord("\xff") + 1),
    ]
    others = [b for b in range(256) if b not in printable]
    return {chr(b): b for b in printable} | {chr(256 + i): b for i, b in enumerate(others)}


_BYTE_OF_CHAR = _byte_level_alphabet()


class IncrementalDetokenizer:
    """Token ids in, text deltas out, never splitting a UTF-8 character.

    Byte-level BPE tokens can end in the middle of a character (an emoji is often two or three
    tokens). Each push decodes the ids since the last emitted boundary together with the tokens of
    the previous delta (as context for decoders that strip a leading space) and holds everything
    back while the decoded text ends in U+FFFD, i.e. while the last character is incomplete.
    """

    def __init__(self, tokenizer: Tokenizer, skip_ids: frozenset[int] = frozenset()):
        self._tokenizer = tokenizer
        self._skip = skip_ids
        self._ids: list[int] = []
        self._prefix = 0  # start of the context window (the previous delta's tokens)
        self._read = 0  # ids before this have been emitted

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=False)

    def push(self, ids: Iterable[int], *, final: bool = False) -> str:
        """Add generated ids; return the newly complete text (maybe empty).

        With ``final`` nothing is held back: an incomplete last character decodes to U+FFFD, as a
        full decode of the same ids does.
        """
        self._ids.extend(i for i in ids if i not in self._skip)
        if len(self._ids) == self._read:
            return ""
        full = self._decode(self._ids[self._prefix :])
        if full.endswith("\ufffd") and not final:
            return ""
        delta = full[len(self._decode(self._ids[self._prefix : self._read])) :]
        self._prefix, self._read = self._read, len(self._ids)
        return delta
