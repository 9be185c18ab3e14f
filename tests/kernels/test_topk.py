"""Top-k select kernel vs ``jax.lax.top_k`` (CPU, interpret mode) + CUDA lowering.

Without ties at the cutoff the index set must equal the reference's exactly; with ties any choice
of tied indices is valid, so those tests compare the selected *values* as multisets. Small chunk
sizes (``config``) force the multi-stage path on CPU-sized rows.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxdsa import ops
from pallas_kernels._triton import lower_for_cuda
from pallas_kernels.topk import kernel, ref, tuning
from pallas_kernels.topk.tuning import TopkConfig

SMALL = TopkConfig(chunk=256, elems_per_thread=4)


def _select(logits, k, config=None):
    logits = jnp.asarray(logits, jnp.float32)
    if config is None:  # the production path: dispatch as the model does
        return np.asarray(ops._impl("topk_indices", "interpret")(logits, k))
    return np.asarray(kernel.topk_indices(logits, k, interpret=True, config=config))


def _check_valid(got, logits, k):
    """Shape, -1 padding after exactly min(k, #finite) distinct finite indices per row; returns the
    selected values per row."""
    assert got.shape == (logits.shape[0], k) and got.dtype == np.int32
    values = []
    for row, idx in zip(logits, got):
        n = min(k, int(np.isfinite(row).sum()))
        chosen = idx[idx >= 0]
        assert len(chosen) == n and len(set(chosen.tolist())) == n
        assert (idx < 0).sum() == k - n
        assert np.isfinite(row[chosen]).all()
        values.append(np.sort(row[chosen]))
    return values


def _check_exact(logits, k, config=None):
    got = _select(logits, k, config)
    _check_valid(got, logits, k)
    want = np.asarray(ref.topk_indices(jnp.asarray(logits), k))
    for g, w in zip(got, want):
        assert set(g.tolist()) == set(w.tolist())


def _random_rows(rng, t, s):
    """Distinct random values (no ties), with ragged -inf tails, an all -inf row and a short row."""
    x = rng.standard_normal((t, s)).astype(np.float32) * 10
    for row in range(t):
        x[row, int(rng.integers(s // 2, s + 1)) :] = -np.inf
    x[0] = -np.inf
    x[-1, 5:] = -np.inf
    return x


@pytest.mark.parametrize(
    "t, s, k, config",
    [
        (6, 1000, 64, None),  # one stage, production config
        (5, 2000, 64, SMALL),  # three stages: 2000 -> 8 chunks x 64 -> 2 chunks x 64 -> final
        (4, 1000, 100, SMALL),  # k not a power of two
        (3, 300, 2048, None),  # S < k: everything finite is selected, -1 padded
        (1, 5000, 2048, None),  # T = 1, k = 2048 as in production
    ],
)
def test_exact_set_without_ties(t, s, k, config):
    rng = np.random.default_rng(t * s + k)
    _check_exact(_random_rows(rng, t, s), k, config)


def test_thousands_of_rows():
    rng = np.random.default_rng(7)
    _check_exact(_random_rows(rng, 1024, 48), 16, SMALL)


@pytest.mark.parametrize("config", [None, SMALL])
def test_ties_at_the_cutoff(config):
    """Few distinct values: many ties at the cutoff; any tied index may be chosen, but the selected
    values must be exactly the k largest (as a multiset). Includes -0.0 / +0.0 and negatives."""
    rng = np.random.default_rng(3)
    x = rng.integers(-3, 4, (4, 1500)).astype(np.float32)
    x[1, ::2] = -0.0
    x[2, 60:] = -np.inf
    k = 100  # <= SMALL.chunk / 2, so SMALL runs four stages over the 1500 columns
    got = _select(x, k, config)
    want = np.asarray(ref.topk_indices(jnp.asarray(x), k))
    for row, values, w in zip(x, _check_valid(got, x, k), want):
        np.testing.assert_array_equal(values, np.sort(row[w[w >= 0]]))


def test_non_finite_values_are_never_selected():
    """+inf and NaN count as "not finite" like -inf (lax.top_k would rank them first)."""
    rng = np.random.default_rng(4)
    x = rng.standard_normal((3, 500)).astype(np.float32)
    x[:, :50] = np.inf
    x[:, 50:100] = np.nan
    got = _select(x, 64, SMALL)
    finite = np.where(np.isfinite(x), x, -np.inf)
    want = np.asarray(ref.topk_indices(jnp.asarray(finite), 64))
    _check_valid(got, x, 64)
    for g, w in zip(got, want):
        assert set(g.tolist()) == set(w.tolist())


def test_large_k_on_long_rows_falls_back_to_lax_top_k():
    rng = np.random.default_rng(5)
    _check_exact(_random_rows(rng, 2, 600), 200, SMALL)  # k > chunk / 2 with S > chunk


# --- CUDA lowering at production shapes (no GPU needed) ------------------------------------


@pytest.mark.parametrize("search", ["bisect", "secant", "table"])
@pytest.mark.parametrize("target", ["sm_80", "sm_90", "sm_120"])
def test_lowers_for_cuda(target, search):
    """Decode [32, 8192] (one stage) and prefill [4096, 131072] (candidate stages + final), each
    Triton module through the MLIR verifier; "table": the target's own configs per shape."""
    config = None if search == "table" else TopkConfig(search=search)
    for shape in ((32, 8192), (4096, 131072)):
        spec = jax.ShapeDtypeStruct(shape, jnp.float32)
        text = lower_for_cuda(kernel.topk_indices, spec, target=target, k=2048, config=config)
        assert "__gpu$xla.gpu.triton" in text


SECANT = TopkConfig(chunk=256, elems_per_thread=4, search="secant")


@pytest.mark.parametrize(
    "make",
    [
        lambda rng: _random_rows(rng, 5, 2000),  # distinct values, ragged -inf tails, an empty row
        lambda rng: rng.standard_exponential((4, 1500)).astype(np.float32) ** 4,  # heavy tail
        lambda rng: np.concatenate([rng.standard_normal((3, 900)), np.full((3, 100), 3e38)], 1).astype(
            np.float32
        ),
    ],
    ids=["normal_ragged", "heavy_tail", "near_float_max"],
)
def test_secant_search_selects_the_same_set(make):
    """False position on the values finds the same cutoff as bisection (multi-stage rows, k = 64)."""
    rng = np.random.default_rng(11)
    x = make(rng)
    got = _select(x, 64, SECANT)
    values = _check_valid(got, x, 64)
    want = np.asarray(ref.topk_indices(jnp.asarray(x), 64))
    for row, v, w in zip(x, values, want):
        np.testing.assert_array_equal(v, np.sort(row[w[w >= 0]]))


def test_unknown_search_is_an_error():
    with pytest.raises(ValueError, match="secant"):
        TopkConfig(search="secnt")


def test_secant_search_with_ties_and_signed_zeros():
    rng = np.random.default_rng(12)
    x = rng.integers(-3, 4, (4, 1500)).astype(np.float32)
    x[1, ::2] = -0.0
    x[2, 60:] = -np.inf
    x[3, :] = 1.0  # one value only: every probe ties
    got = _select(x, 100, SECANT)
    want = np.asarray(ref.topk_indices(jnp.asarray(x), 100))
    for row, values, w in zip(x, _check_valid(got, x, 100), want):
        np.testing.assert_array_equal(values, np.sort(row[w[w >= 0]]))


def test_h100_table_follows_the_sweep():
    """16384-key chunks once the first stage has a program per SM, 8192-key ones below, and the
    secant search when each of many rows fits one chunk."""
    small, large = TopkConfig(chunk=8192, elems_per_thread=16), TopkConfig(chunk=16384, elems_per_thread=32)
    single = TopkConfig(chunk=8192, elems_per_thread=32, search="secant")
    want = {
        (32, 8192): small,
        (32, 32768): small,
        (32, 131072): large,
        (32, 262144): large,
        (4096, 8192): single,
        (4096, 32768): large,
        (4096, 131072): large,
    }
    for (rows, keys), config in want.items():
        assert tuning.config_for(90, rows=rows, keys=keys) == config, (rows, keys)
    assert tuning.config_for(80, rows=32, keys=8192) == tuning.config_for(80)


@pytest.mark.parametrize(
    "search", [kernel._cutoff, lambda key, kk: kernel._cutoff_secant(key, key > -(2**31), kk)]
)
def test_cutoff_reports_an_exact_count(search):
    """Tie-free keys: the search ends on a probe with exactly kk keys at or above it, so the kernel
    selects ``key >= cutoff`` without the tie prefix sum; ties at the cutoff: not exact."""
    rng = np.random.default_rng(13)
    key = kernel._ordered_key(jnp.asarray(rng.standard_normal(4096), jnp.float32))
    cutoff, exact = search(key, jnp.int32(100))
    assert bool(exact) and int(jnp.sum(key >= cutoff)) == 100
    tied = kernel._ordered_key(jnp.asarray(rng.integers(0, 5, 4096), jnp.float32))
    cutoff, exact = search(tied, jnp.int32(100))
    assert not bool(exact) and int(jnp.sum(tied > cutoff)) < 100 <= int(jnp.sum(tied >= cutoff))
