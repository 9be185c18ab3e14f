"""Compressor pooling kernel vs the reference (interpret mode) + CUDA lowering."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels._triton import lower_for_cuda
from pallas_kernels.compress_pool import kernel, ref, tuning

EPS = 1e-6


def _inputs(seed, w, m, d, c, dtype, prev):
    ks = jax.random.split(jax.random.key(seed), 5)
    kv = jax.random.normal(ks[0], (w, m, c * d), jnp.float32).astype(dtype)
    score = (2.0 * jax.random.normal(ks[1], (w, m, c * d), jnp.float32)).astype(dtype)
    norm = 1.0 + 0.1 * jax.random.normal(ks[2], (d,), jnp.float32)
    prev_kv = jax.random.normal(ks[3], (m, d), jnp.float32) if prev else None
    prev_score = jax.random.normal(ks[4], (m, d), jnp.float32) if prev else None
    return kv, score, norm, prev_kv, prev_score


# (W windows, m, d, c, dtype, carried previous window): CSA from a sequence start; CSA mid-sequence
# (a carried half window) at a width that is not a power of two; HCA with eight slot tiles (m = 128);
# HCA with bf16 rows.
CASES = {
    "csa_first_chunk": (5, 4, 32, 2, jnp.float32, False),
    "csa_carried_window_odd_width": (3, 4, 24, 2, jnp.float32, True),
    "hca_many_slot_tiles": (2, 128, 64, 1, jnp.float32, False),
    "hca_bf16": (4, 8, 32, 1, jnp.bfloat16, False),
}


@pytest.mark.parametrize("name", list(CASES))
def test_matches_reference(name):
    w, m, d, c, dtype, prev = CASES[name]
    kv, score, norm, prev_kv, prev_score = _inputs(len(name), w, m, d, c, dtype, prev)
    call = jax.jit(functools.partial(kernel.compress_pool, eps=EPS, interpret=True))
    got = np.asarray(call(kv, score, norm, prev_kv=prev_kv, prev_score=prev_score), np.float32)
    want = np.asarray(
        ref.compress_pool(kv, score, norm, eps=EPS, prev_kv=prev_kv, prev_score=prev_score), np.float32
    )
    tol = 1e-2 if dtype == jnp.bfloat16 else 2e-6
    assert np.isfinite(got).all()
    assert np.linalg.norm(got - want) <= tol * np.linalg.norm(want)


def test_sequence_shorter_than_one_window():
    kv, score, norm, _, _ = _inputs(0, 0, 4, 32, 2, jnp.float32, False)
    assert kernel.compress_pool(kv, score, norm, eps=EPS, interpret=True).shape == (0, 32)
    assert ref.compress_pool(kv, score, norm, eps=EPS).shape == (0, 32)


def test_first_window_ignores_the_missing_previous_one():
    """Without a carried window the previous slots weigh 0: entry 0 pools its own second halves only."""
    kv, score, norm, _, _ = _inputs(3, 1, 4, 16, 2, jnp.float32, False)
    got = kernel.compress_pool(kv, score, norm, eps=EPS, interpret=True)
    alone = ref.compress_pool(kv[:, :, 16:], score[:, :, 16:], norm, eps=EPS)
    np.testing.assert_allclose(np.asarray(got), np.asarray(alone), rtol=2e-6, atol=2e-6)


_TARGET_CC = {"sm_80": 80, "sm_90": 90, "sm_120": 120}


@pytest.mark.parametrize("target", list(_TARGET_CC))
def test_lowers_for_cuda(target, monkeypatch):
    monkeypatch.setattr(tuning, "compute_capability", lambda: _TARGET_CC[target])
    s = jax.ShapeDtypeStruct
    # CSA decode (one window, carried half), HCA prefill (m = 128, d = 512), CSA indexer (d = 128), tiny
    for w, m, d, c, prev in [
        (1, 4, 512, 2, True),
        (1000, 128, 512, 1, False),
        (7, 4, 128, 2, False),
        (3, 8, 32, 1, False),
    ]:
        args = [s((w, m, c * d), jnp.float32), s((w, m, c * d), jnp.float32), s((d,), jnp.bfloat16)]
        if prev:
            args += [s((m, d), jnp.float32), s((m, d), jnp.float32)]
            fn = lambda kv, sc, nw, pk, ps: kernel.compress_pool(
                kv, sc, nw, eps=EPS, prev_kv=pk, prev_score=ps
            )  # noqa: E731
        else:
            fn = functools.partial(kernel.compress_pool, eps=EPS)
        assert "__gpu$xla.gpu.triton" in lower_for_cuda(fn, *args, target=target)
