"""Incremental detokenization: never a split character, and the deltas add up to the full decode."""

from __future__ import annotations

import random

import pytest

from jaxdsa.serve.tokenizer import IncrementalDetokenizer, Tokenizer

TEXTS = [
    "你好，世界！今天天气很好。",
    "Emoji: 😀🚀🌍 👍🏽 ❤️ 🤖🧠",
    "Tiếng Việt có nhiều dấu: ă â đ ê ô ơ ư",
    "mixed: café 模型 😀 Größe こんにちは 안녕 𝔘𝔫𝔦",
]


@pytest.fixture(scope="module")
def tok(glm_dir) -> Tokenizer:
    return Tokenizer(glm_dir)


def stream(tok: Tokenizer, ids: list[int], skip: frozenset[int] = frozenset()) -> list[str]:
    detok = IncrementalDetokenizer(tok, skip)
    return [detok.push([i]) for i in ids] + [detok.push([], final=True)]


@pytest.mark.parametrize("text", TEXTS)
def test_characters_split_across_tokens_are_held_back(tok, text):
    ids = tok.encode(text)
    deltas = stream(tok, ids)
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)
    # The test is only meaningful if some character really spans tokens.
    assert any(d == "" for d in deltas[:-1]), "no multi-token character in this text"


def test_random_token_streams_match_full_decode(tok):
    """Random ids (what a random model emits) include invalid UTF-8; the sum still equals decode()."""
    rng = random.Random(0)
    for _ in range(200):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 40))]
        skip = tok.skip_ids(skip_special_tokens=True)
        assert "".join(stream(tok, ids, skip)) == tok.decode(ids, skip_special_tokens=True)
        assert "".join(stream(tok, ids)) == tok.decode(ids, skip_special_tokens=False)


def test_multi_token_pushes(tok):
    ids = tok.encode(TEXTS[1])
    detok = IncrementalDetokenizer(tok)
    text = "".join(detok.push(ids[i : i + 3]) for i in range(0, len(ids), 3)) + detok.push([], final=True)
    assert text == TEXTS[1]


def test_incomplete_character_at_the_end_is_flushed_as_replacement(tok):
    ids = tok.encode("ok 😀")
    detok = IncrementalDetokenizer(tok)
    partial = "".join(detok.push([i]) for i in ids[:-1])
    assert partial.startswith("ok") and "\ufffd" not in partial  # the emoji's first bytes are held back
    tail = detok.push([], final=True)
    assert tail.endswith("\ufffd") and partial + tail == tok.decode(ids[:-1], skip_special_tokens=False)


def test_skip_ids_keep_parser_markers(tok):
    ids = tok.encode("<|assistant|><think>r</think>a<tool_call>f</tool_call>")
    keep = tok.skip_ids(skip_special_tokens=True, keep=("<think>", "</think>"))
    assert "".join(stream(tok, ids, keep)) == "<think>r</think>a<tool_call>f</tool_call>"
    assert "".join(stream(tok, ids, tok.skip_ids(skip_special_tokens=True))) == "ra<tool_call>f</tool_call>"
    assert tok.skip_ids(skip_special_tokens=False) == frozenset()
