"""Hyper-connection kernels (hc_pre with Sinkhorn, hc_post) vs the reference (interpret) + CUDA lowering."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels._triton import lower_for_cuda
from pallas_kernels.mhc import kernel, ref, tuning

ITERS, HC_EPS, NORM_EPS = 20, 1e-6, 1e-6


def _inputs(seed, t, n, d, dtype):
    ks = jax.random.split(jax.random.key(seed), 5)
    x = (3.0 * jax.random.normal(ks[0], (t, n, d), jnp.float32)).astype(dtype)
    fn = jax.random.normal(ks[1], (n * d, (2 + n) * n), jnp.float32) * (n * d) ** -0.5
    base = 0.5 * jax.random.normal(ks[2], ((2 + n) * n,), jnp.float32)
    scale = jax.random.uniform(ks[3], (3,), jnp.float32, 0.5, 1.5)
    out = jax.random.normal(ks[4], (t, d), jnp.float32).astype(dtype)
    return x, fn, base, scale, out


def _close(got, want, tol):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert got.shape == want.shape and np.isfinite(got).all()
    assert np.linalg.norm(got - want) <= tol * max(np.linalg.norm(want), 1e-30)


# (T, n, D, dtype): decode (one token) with bf16 streams; a ragged token block whose streams span
# two column tiles of a width that is not a power of two (masked tiles).
CASES = {
    "decode_bf16": (1, 4, 32, jnp.bfloat16),
    "ragged_tokens_odd_width": (37, 4, 40, jnp.float32),
}


# hc_pre's two paths: the table's choice (the fused kernel at these widths: one column step), and
# the mixing columns split 4 ways (3 steps of 16 per split over 10 steps at D = 40: a ragged last
# split) with 16-column collapse blocks (a masked last block at D = 40).
CONFIGS = {
    "table": None,
    "split4": tuning.MhcConfig(block_t=16, block_k=16, block_d=16, num_warps=4, num_stages=2, splits=4),
}


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("name", list(CASES))
def test_matches_reference(name, config):
    t, n, d, dtype = CASES[name]
    x, fn, base, scale, out = _inputs(len(name), t, n, d, dtype)
    kw = dict(iters=ITERS, hc_eps=HC_EPS, norm_eps=NORM_EPS)
    pre = functools.partial(kernel.hc_pre, interpret=True, config=CONFIGS[config], **kw)
    got = jax.jit(pre)(x, fn, base, scale)
    want = jax.jit(functools.partial(ref.hc_pre, **kw))(x, fn, base, scale)
    tol = 1e-2 if dtype == jnp.bfloat16 else 2e-6
    for g, w in zip(got, want):
        _close(g, w, tol)
    comb = np.asarray(got[2])  # doubly stochastic after Sinkhorn
    np.testing.assert_allclose(comb.sum(axis=1), 1.0, atol=1e-4)
    np.testing.assert_allclose(comb.sum(axis=2), 1.0, atol=1e-3)
    _, post, comb = want
    _close(
        jax.jit(functools.partial(kernel.hc_post, interpret=True))(x, out, post, comb),
        ref.hc_post(x, out, post, comb),
        tol,
    )


def test_no_tokens():
    x, fn, base, scale, out = _inputs(0, 0, 4, 32, jnp.float32)
    h, post, comb = kernel.hc_pre(
        x, fn, base, scale, iters=ITERS, hc_eps=HC_EPS, norm_eps=NORM_EPS, interpret=True
    )
    assert h.shape == (0, 32) and post.shape == (0, 4) and comb.shape == (0, 4, 4)
    assert kernel.hc_post(x, out, post, comb, interpret=True).shape == (0, 4, 32)


def test_split_rule():
    """About 4 x SMs mixing programs, at most one column step each; fused from 132 token blocks."""
    tokens = (1, 32, 128, 512, 2048, 4096)
    assert [tuning.split_rule(t, 16384, 16, 128, 132) for t in tokens] == [128, 128, 64, 16, 4, 1]
    assert tuning.split_rule(1, 128, 16, 128, 132) == 1  # one column step: the fused kernel


_TARGET_CC = {"sm_80": 80, "sm_90": 90, "sm_120": 120}


@pytest.mark.parametrize("target", list(_TARGET_CC))
def test_lowers_for_cuda(target, monkeypatch):
    monkeypatch.setattr(tuning, "compute_capability", lambda: _TARGET_CC[target])
    s = jax.ShapeDtypeStruct
    # V4-Flash decode, V4-Pro prefill, the tiny model
    for t, n, d, dtype in [
        (1, 4, 4096, jnp.bfloat16),
        (300, 4, 7168, jnp.bfloat16),
        (37, 4, 32, jnp.float32),
    ]:
        pre = functools.partial(kernel.hc_pre, iters=ITERS, hc_eps=HC_EPS, norm_eps=NORM_EPS)
        args = (
            s((t, n, d), dtype),
            s((n * d, (2 + n) * n), jnp.float32),
            s(((2 + n) * n,), jnp.float32),
            s((3,), jnp.float32),
        )
        assert "__gpu$xla.gpu.triton" in lower_for_cuda(pre, *args, target=target)
        args = (s((t, n, d), dtype), s((t, d), dtype), s((t, n), jnp.float32), s((t, n, n), jnp.float32))
        assert "__gpu$xla.gpu.triton" in lower_for_cuda(kernel.hc_post, *args, target=target)


def test_decode_mixing_dots_are_tf32x3_on_a_gpu_only():
    """One token block on a GPU: TF32x3 tensor-core products; more blocks or the interpreter: IEEE."""
    assert kernel._dot_precision(1, interpret=False) == jax.lax.DotAlgorithmPreset.TF32_TF32_F32_X3
    assert kernel._dot_precision(2, interpret=False) == jax.lax.Precision.HIGHEST
    assert kernel._dot_precision(1, interpret=True) == jax.lax.Precision.HIGHEST
