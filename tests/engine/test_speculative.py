"""The speculative verifier against the distributions it must preserve, and vLLM's config.

The sampling tests draw many independent rows (one seed each) of one verify step on a tiny
vocabulary and compare, by a chi-square test at significance 0.001, the emitted tokens with the
target distribution: the first token with position 0's, the second (among rows that kept the first
draft) with position 1's, and so on. The seeds are fixed, so the test is deterministic.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from jaxdsa.engine.sampling import Penalties, sample
from jaxdsa.engine.speculative import SpeculativeConfig, verify

V, K = 6, 3
ROWS = 30000
SIGNIFICANCE = 1e-3


def _penalties(rows: int, *, frequency: float = 0.0, counts=None, vocab: int = V) -> Penalties:
    counts = np.zeros((rows, vocab), np.int32) if counts is None else counts
    return Penalties(
        jnp.asarray(counts),
        jnp.zeros((rows, vocab), bool),
        jnp.zeros((rows, vocab), jnp.float32),
        jnp.arange(rows, dtype=jnp.int32),
        jnp.zeros(rows, jnp.float32),
        jnp.full(rows, frequency, jnp.float32),
        jnp.ones(rows, jnp.float32),
        jnp.full(rows, frequency != 0),
    )


def _verify(logits, drafts, *, temperature=1.0, top_p=1.0, top_k=0, rows=ROWS, penalties=None, seeds=None):
    """One verify step of ``rows`` rows sharing ``logits`` [K, V] and ``drafts`` [K - 1]."""
    logits = np.broadcast_to(np.asarray(logits, np.float32), (rows, *np.shape(logits)))
    proposed = np.broadcast_to(np.array(list(drafts) + [logits.shape[-1]], np.int32), (rows, K))
    full = lambda v, dt: np.full(rows, v, dt)  # noqa: E731
    vocab = logits.shape[-1]
    out = jax.jit(verify, static_argnames="num_logprobs")(
        logits, proposed, full(temperature, np.float32), full(top_p, np.float32), full(top_k, np.int32),
        np.arange(rows, dtype=np.int32) if seeds is None else seeds, full(0, np.int32),
        np.full((rows, K, 2), vocab, np.int32), penalties or _penalties(rows, vocab=vocab),
        num_logprobs=2,
    )  # fmt: skip
    return jax.tree.map(np.asarray, out)


def _target(logits, temperature=1.0, top_p=1.0, top_k=0):
    """The distribution the plain sampler draws from (NumPy): temperature, then vLLM's filters."""
    z = np.asarray(logits, np.float64) / temperature
    order = np.argsort(-z, kind="stable")
    keep = np.ones(len(z), bool)
    if top_k:
        keep[order[top_k:]] = False
    p = np.where(keep, np.exp(z - z.max()), 0)
    p /= p.sum()
    if top_p < 1:
        before = np.cumsum(p[order]) - p[order]
        keep[order[before >= top_p]] = False
        p = np.where(keep, p, 0)
        p /= p.sum()
    return p


def _chi_square(tokens: np.ndarray, p: np.ndarray) -> float:
    """p-value of the tokens' counts against ``p``; a token outside its support fails outright."""
    counts = np.bincount(tokens, minlength=len(p))
    assert counts[p == 0].sum() == 0, "a token the distribution excludes was emitted"
    support = p > 0
    if support.sum() == 1:
        return 1.0
    return stats.chisquare(counts[support], p[support] * len(tokens)).pvalue


LOGITS = np.array(
    [
        [1.0, 0.2, -0.5, 0.9, -1.0, 0.0],
        [-0.3, 1.2, 0.4, -0.8, 0.7, 0.1],
        [0.5, -0.2, 1.1, 0.3, -0.6, 0.8],
    ],
    np.float32,
)
DRAFTS = (3, 4)  # neither is the argmax at its position: greedy rejects the first


@pytest.mark.parametrize(
    "filters",
    [dict(temperature=1.0), dict(temperature=0.7, top_k=3), dict(temperature=1.3, top_p=0.8)],
    ids=["temperature", "top_k", "top_p"],
)
def test_emitted_tokens_follow_the_target_distribution(filters):
    out = _verify(LOGITS, DRAFTS, **filters)
    assert ((out.num_emitted >= 1) & (out.num_emitted <= K)).all()
    reached = np.ones(ROWS, bool)  # rows whose output reaches position j (drafts before it kept)
    for j in range(K):
        p = _target(LOGITS[j], **filters)
        tokens = out.tokens[reached, j]
        assert len(tokens) > 1000, "too few rows reach this position for the test to mean anything"
        assert _chi_square(tokens, p) > SIGNIFICANCE, f"position {j}"
        kept = (out.num_emitted > j + 1)[reached]
        if j < K - 1:  # a draft is kept exactly when the emitted token is it
            assert (kept == (tokens == DRAFTS[j])).all()
        reached[reached] = kept


def test_greedy_keeps_drafts_while_they_are_the_argmax():
    logits = LOGITS.copy()
    out = _verify(logits, (0, 1), temperature=0.0, rows=4)
    assert out.num_emitted.tolist() == [3] * 4 and out.tokens[0].tolist() == [0, 1, 2]
    out = _verify(logits, (0, 4), temperature=0.0, rows=4)
    assert out.num_emitted.tolist() == [2] * 4 and out.tokens[0, :2].tolist() == [0, 1]
    out = _verify(logits, DRAFTS, temperature=0.0, rows=4)
    assert out.num_emitted.tolist() == [1] * 4 and out.tokens[0, 0] == 0


def test_penalties_count_the_drafts_before_each_position():
    """Position 1's argmax is token 1 by a small margin; a frequency penalty of 2 moves it unless the
    verifier forgot that the draft at position 0 (token 1) is then an output token."""
    logits = LOGITS.copy()
    logits[0] = [0, 3, 0, 0, 0, 0]  # position 0: token 1 (the draft)
    logits[1] = [0, 1.5, 1.0, 0, 0, 0]  # position 1: token 1 unless penalized (1.5 - 2 < 1.0)
    out = _verify(logits, (1, 2), temperature=0.0, rows=2, penalties=_penalties(2, frequency=2.0))
    assert out.tokens[0, :2].tolist() == [1, 2] and out.num_emitted[0] >= 2
    out = _verify(logits, (1, 2), temperature=0.0, rows=2)
    assert out.tokens[0, :2].tolist() == [1, 1] and out.num_emitted[0] == 2


def test_one_position_is_the_plain_sampler_bit_for_bit():
    rows, vocab = 64, 50
    logits = np.random.default_rng(1).normal(0, 2, (rows, vocab)).astype(np.float32)
    args = (np.full(rows, 0.8, np.float32), np.full(rows, 0.9, np.float32), np.full(rows, 7, np.int32))
    seeds, counters = np.arange(rows, dtype=np.int32) * 7, np.arange(rows, dtype=np.int32)
    banned = np.full((rows, 1, 2), vocab, np.int32)
    penalties = _penalties(rows, vocab=vocab)
    got = verify(
        logits[:, None], np.full((rows, 1), vocab, np.int32), *args, seeds, counters, banned, penalties,
        num_logprobs=3,
    )  # fmt: skip
    want = sample(logits, *args, seeds, counters, banned[:, 0], penalties, num_logprobs=3)
    np.testing.assert_array_equal(got.tokens[:, 0], want.ids)
    np.testing.assert_array_equal(got.top_ids[:, 0], want.top_ids)
    assert (got.num_emitted == 1).all()


def test_config_reads_vllms_json():
    assert SpeculativeConfig.parse('{"method": "mtp", "num_speculative_tokens": 3}') == SpeculativeConfig(
        "mtp", 3
    )
    assert (
        SpeculativeConfig.parse({"method": "deepseek_mtp", "num_speculative_tokens": 1}).method
        == "deepseek_mtp"
    )
    assert SpeculativeConfig.parse(None) is None
    for bad, why in [
        ("{", "not JSON"),
        ("[1]", "JSON object"),
        ('{"method": "eagle", "num_speculative_tokens": 2}', "eagle"),
        ('{"method": "mtp", "num_speculative_tokens": 0}', r"\[1, 5\]"),
        ('{"method": "mtp", "num_speculative_tokens": 2.5}', "integer"),
        ('{"method": "mtp"}', "needs num_speculative_tokens"),
        ('{"method": "mtp", "num_speculative_tokens": 2, "draft_model": "x"}', "unknown key"),
    ]:
        with pytest.raises(ValueError, match=why):
            SpeculativeConfig.parse(bad)
