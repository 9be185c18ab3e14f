"""The on-device sampler against NumPy: filters, seeds and logprobs."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jaxdsa.engine.sampling import Penalties, penalize, sample

V = 12
DRAWS = 4000  # rows of one distribution, each with its own counter: frequencies within ~0.03


def _rows(
    logits,
    *,
    temperature=1.0,
    top_p=1.0,
    top_k=0,
    seed=3,
    num_logprobs=0,
    n=DRAWS,
    banned=None,
    candidates=1024,
):
    """``n`` rows of the same logits with counters 0..n-1 -> host arrays of the Sampled fields;
    ``banned``: ids every row must not pick (padded with V, as the runner pads)."""
    logits = np.broadcast_to(np.asarray(logits, np.float32), (n, len(logits)))
    full = lambda v, dt: np.full(n, v, dt)  # noqa: E731
    ban = (
        None
        if banned is None
        else np.broadcast_to(np.array(list(banned) + [V, V + 3], np.int32), (n, len(banned) + 2))
    )
    out = jax.jit(sample, static_argnames=("num_logprobs", "candidates"))(
        logits, full(temperature, np.float32), full(top_p, np.float32), full(top_k, np.int32),
        full(seed, np.int32), np.arange(n, dtype=np.int32), ban,
        num_logprobs=num_logprobs, candidates=candidates,
    )  # fmt: skip
    return jax.tree.map(np.asarray, out)


def _log_softmax(x):
    x = np.asarray(x, np.float64)
    return x - x.max() - np.log(np.exp(x - x.max()).sum())


def _frequencies(ids):
    return np.bincount(ids, minlength=V) / len(ids)


@pytest.fixture
def logits():
    return np.random.default_rng(0).normal(0, 1.5, V).astype(np.float32)


def test_temperature_draws_follow_the_softmax(logits):
    for t in (0.5, 1.0, 2.0):
        expected = np.exp(_log_softmax(logits / t))
        assert np.abs(_frequencies(_rows(logits, temperature=t).ids) - expected).max() < 0.03


def test_greedy_is_argmax_whatever_the_seed(logits):
    assert (_rows(logits, temperature=0.0, n=16).ids == np.argmax(logits)).all()
    assert (_rows(logits, temperature=0.7, top_k=1, n=16).ids == np.argmax(logits)).all()


@pytest.mark.parametrize("top_k", [2, 5])
def test_top_k_keeps_the_k_most_likely(logits, top_k):
    kept = np.argsort(-logits)[:top_k]
    expected = np.zeros(V)
    expected[kept] = np.exp(_log_softmax(logits[kept]))
    assert np.abs(_frequencies(_rows(logits, top_k=top_k).ids) - expected).max() < 0.03


@pytest.mark.parametrize("top_p", [0.3, 0.75, 0.95])
def test_top_p_keeps_the_smallest_set_reaching_p(logits, top_p):
    p = np.exp(_log_softmax(logits))
    order = np.argsort(-p)
    before = np.cumsum(p[order]) - p[order]  # mass above each token
    kept = order[before < top_p]
    expected = np.zeros(V)
    expected[kept] = p[kept] / p[kept].sum()
    assert np.abs(_frequencies(_rows(logits, top_p=top_p).ids) - expected).max() < 0.03


def test_a_seeded_row_draws_the_same_token_in_any_batch(logits):
    alone = _rows(logits, seed=11, n=64).ids
    rng = np.random.default_rng(1)
    others = rng.normal(size=(64, V)).astype(np.float32)
    batch = np.concatenate([others[:, None], np.broadcast_to(logits, (64, 1, V))], axis=1).reshape(128, V)
    seeds = np.tile([5, 11], 64).astype(np.int32)
    counters = np.repeat(np.arange(64, dtype=np.int32), 2)
    ones = np.ones(128, np.float32)
    ids = np.asarray(sample(batch, ones, ones, np.zeros(128, np.int32), seeds, counters).ids)
    assert (ids[1::2] == alone).all()
    assert len(set(alone.tolist())) > 3  # the counter moves the key


def test_logprobs_are_the_models_distribution_and_its_top_tokens():
    rng = np.random.default_rng(2)
    logits = rng.normal(0, 3, (6, V)).astype(np.float32)
    logits[0, [3, 7, 9]] = logits[0].max() + 1  # a three-way tie for the top: lower id first
    temperature = np.array([0, 0.7, 1.0, 1.5, 0.7, 0], np.float32)
    top_k = np.array([0, 3, 0, 0, 0, 0], np.int32)
    top_p = np.array([1, 1, 0.5, 1, 1, 1], np.float32)
    seeds, counters = np.arange(6, dtype=np.int32), np.zeros(6, np.int32)
    out = jax.tree.map(np.asarray, sample(logits, temperature, top_p, top_k, seeds, counters, num_logprobs=5))
    assert out.top_ids.shape == out.top_logprobs.shape == (6, 5)
    for r in range(6):
        lp = _log_softmax(logits[r])  # raw logits: neither temperature nor the filters change it
        np.testing.assert_allclose(out.logprobs[r], lp[out.ids[r]], rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(out.top_ids[r], np.argsort(-logits[r], kind="stable")[:5])
        np.testing.assert_allclose(out.top_logprobs[r], lp[out.top_ids[r]], rtol=1e-5, atol=1e-5)
    assert out.top_ids[0, :3].tolist() == [3, 7, 9] and out.ids[0] == 3  # greedy takes the first of a tie
    assert (out.ids[[0, 5]] == out.top_ids[[0, 5], 0]).all()


def test_logprobs_count_is_clamped_to_the_vocabulary(logits):
    out = _rows(logits, n=2, num_logprobs=50)
    assert out.top_ids.shape == (2, V) and sorted(out.top_ids[0].tolist()) == list(range(V))
    np.testing.assert_allclose(np.exp(out.top_logprobs[0]).sum(), 1.0, rtol=1e-5)
    assert _rows(logits, n=2).top_ids.shape == (2, 0)


@pytest.mark.parametrize(
    "temperature,top_k,top_p", [(0.0, 0, 1.0), (1.0, 0, 1.0), (1.0, 3, 1.0), (0.8, 0, 0.6)]
)
def test_banned_tokens_are_never_picked_and_the_rest_renormalise(logits, temperature, top_k, top_p):
    """min_tokens bans EOS / stop ids: the draws follow the distribution with those removed (then
    the filters), while logprobs and top tokens stay the model's own."""
    banned = [int(i) for i in np.argsort(-logits)[:2]]  # the two most likely tokens
    got = _rows(logits, temperature=temperature, top_k=top_k, top_p=top_p, num_logprobs=4, banned=banned)
    rest = logits.copy()
    rest[banned] = -np.inf
    want = _rows(rest, temperature=temperature, top_k=top_k, top_p=top_p, num_logprobs=4)
    np.testing.assert_array_equal(got.ids, want.ids)  # same seeds: the same draws as the masked logits
    assert not np.isin(got.ids, banned).any()
    plain = _rows(logits, temperature=temperature, top_k=top_k, top_p=top_p, num_logprobs=4, n=8)
    np.testing.assert_array_equal(got.top_ids[:8], plain.top_ids)  # the banned tokens lead the top 4
    np.testing.assert_allclose(got.top_logprobs[:8], plain.top_logprobs, rtol=1e-6)
    np.testing.assert_allclose(got.logprobs, _log_softmax(logits)[got.ids], rtol=1e-5, atol=1e-6)


def _vllm_penalties(logits, counts, in_prompt, presence, frequency, repetition, bias):
    """vLLM's logit bias, then its apply_penalties, for one row in float64."""
    x = np.asarray(logits, np.float64) + bias
    seen = in_prompt | (counts > 0)
    x[seen] = np.where(x[seen] > 0, x[seen] / repetition, x[seen] * repetition)
    return x - frequency * counts - presence * (counts > 0)


def test_penalties_follow_vllm_and_leave_logprobs_raw():
    """Rows with penalties and logit biases sample from vLLM's penalized logits (greedy and seeded
    draws), rows with them off come back bit for bit, and logprobs / top tokens stay those of the raw
    logits."""
    rng = np.random.default_rng(5)
    n = 6
    raw = rng.normal(0, 2, (n, V)).astype(np.float32)
    counts = rng.integers(0, 3, (n, V)).astype(np.int32) * (rng.random((n, V)) < 0.4)
    in_prompt = rng.random((n, V)) < 0.3
    presence = np.array([0.0, 0.5, -0.3, 0.0, 1.5, 0.0], np.float32)
    frequency = np.array([0.0, 0.2, 0.0, -0.4, 0.7, 0.0], np.float32)
    repetition = np.array([1.0, 1.3, 0.8, 1.0, 2.0, 1.0], np.float32)
    bias = np.zeros((n, V), np.float32)
    bias[3, [1, 4]] = [-100.0, 7.5]  # a row with only a bias
    bias[4, 2] = 3.0
    on = np.array([False, True, True, True, True, False])
    pen = Penalties(
        counts, in_prompt, bias, np.arange(n, dtype=np.int32), presence, frequency, repetition, on
    )
    want = np.stack(
        [
            _vllm_penalties(
                raw[i], counts[i], in_prompt[i], presence[i], frequency[i], repetition[i], bias[i]
            )
            for i in range(n)
        ]
    )
    got = np.asarray(jax.jit(penalize)(raw, pen))
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    off = [0, 5]
    np.testing.assert_array_equal(got[off], raw[off])
    assert (np.argmax(want, axis=1) != np.argmax(raw, axis=1)).any()  # the penalties change some pick

    args = lambda t: (
        np.full(n, t, np.float32),
        np.ones(n, np.float32),
        np.zeros(n, np.int32),  # noqa: E731
        np.arange(n, dtype=np.int32),
        np.zeros(n, np.int32),
    )
    run = jax.jit(sample, static_argnames="num_logprobs")
    # Rows without penalties (neutral values, not on) whose slots hold an earlier request's
    # counts, prompt flags and bias sample exactly as without any penalties.
    stale = Penalties(
        counts,
        in_prompt,
        bias + 5.0,
        np.arange(n, dtype=np.int32),
        np.zeros(n, np.float32),
        np.zeros(n, np.float32),
        np.ones(n, np.float32),
        np.zeros(n, bool),
    )
    for temperature in (0.0, 0.7):
        with_stale, without = (run(raw, *args(temperature), None, p, num_logprobs=3) for p in (stale, None))
        np.testing.assert_array_equal(with_stale.ids, without.ids)
        np.testing.assert_array_equal(with_stale.top_ids, without.top_ids)
    for temperature in (0.0, 0.7):
        out = run(raw, *args(temperature), None, pen, num_logprobs=3)
        ref = run(want.astype(np.float32), *args(temperature), num_logprobs=3)
        np.testing.assert_array_equal(out.ids, ref.ids)  # the same draws as from the penalized logits
        plain = run(raw, *args(temperature), num_logprobs=3)
        np.testing.assert_array_equal(out.top_ids, plain.top_ids)  # the model's own top tokens
        np.testing.assert_allclose(out.top_logprobs, plain.top_logprobs, rtol=1e-6)
        lp = np.stack([_log_softmax(r) for r in raw])
        np.testing.assert_allclose(out.logprobs, lp[np.arange(n), out.ids], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("top_k,top_p", [(0, 0.5), (3, 1.0), (3, 0.7), (0, 0.97), (8, 1.0), (0, 1.0)])
def test_candidate_filters_equal_full_sort_filters(logits, top_k, top_p):
    """With 4 candidates of 12 tokens the filters keep exactly the tokens a full sort keeps, so the
    seeded draws are the same: inside the candidates (top-k 3, top-p 0.5 or 0.7) and through the
    whole-row fallback (top-k 8 > 4, top-p 0.97 beyond the candidates' mass)."""
    mass = np.sort(np.exp(_log_softmax(logits)))[::-1]
    assert mass[:3].sum() < 0.97  # the 0.97 case needs the fallback
    for banned in (None, [int(np.argmax(logits))]):
        full = _rows(logits, top_k=top_k, top_p=top_p, banned=banned, num_logprobs=3, candidates=12)
        few = _rows(logits, top_k=top_k, top_p=top_p, banned=banned, num_logprobs=3, candidates=4)
        np.testing.assert_array_equal(few.ids, full.ids)
        np.testing.assert_array_equal(few.top_ids, full.top_ids)
        if top_k or top_p < 1:
            assert len(np.unique(full.ids)) < V  # the filter removed some tokens
