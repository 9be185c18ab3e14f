"""LSE-merge Pallas kernel vs the reference (CPU, interpret mode) + CUDA lowering."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels._triton import lower_for_cuda
from pallas_kernels.merge_states import kernel, ref, tuning


@functools.partial(jax.jit, static_argnames=("out_dtype",))
def _kernel(outs, lses, sink, out_dtype=None):
    return kernel.merge_states(outs, lses, sink, interpret=True, out_dtype=out_dtype)


_reference = jax.jit(ref.merge_states)


def _inputs(seed, n, t, h, d, dtype, sink):
    """Random parts; some parts empty (lse = -inf), one row empty in every part."""
    ko, kl, ke, ks = jax.random.split(jax.random.key(seed), 4)
    outs = jax.random.normal(ko, (n, t, h, d), jnp.float32).astype(dtype)
    lses = 4.0 * jax.random.normal(kl, (n, t, h), jnp.float32)
    lses = jnp.where(jax.random.bernoulli(ke, 0.25, (n, t, h)), -jnp.inf, lses)
    lses = lses.at[:, 0, 0].set(-jnp.inf)
    s = jax.random.normal(ks, (h,), jnp.float32) if sink else None
    return outs, lses, s


def _check(outs, lses, s, out_dtype=None):
    out, lse = _kernel(outs, lses, s, out_dtype)
    want_out, want_lse = _reference(outs.astype(jnp.float32), lses, s)
    assert out.dtype == (out_dtype or outs.dtype) and lse.dtype == jnp.float32
    out, lse, want_out, want_lse = (np.asarray(a, np.float32) for a in (out, lse, want_out, want_lse))
    assert not np.isnan(out).any() and not np.isnan(lse).any()
    tol = 1e-2 if out_dtype == jnp.bfloat16 or outs.dtype == jnp.bfloat16 else 1e-6
    assert np.linalg.norm(out - want_out) <= tol * np.linalg.norm(want_out)
    np.testing.assert_array_equal(np.isfinite(lse), np.isfinite(want_lse))
    finite = np.isfinite(want_lse)
    np.testing.assert_allclose(lse[finite], want_lse[finite], rtol=1e-6, atol=1e-5)
    empty = ~np.isfinite(np.asarray(lses)).any(axis=0)
    assert (out[empty] == 0).all()
    if s is not None:
        np.testing.assert_array_equal(lse[empty], np.broadcast_to(np.asarray(s), lse.shape)[empty])


# (n parts, T, H, D, dtype, sink)
CASES = {
    "single_part_bf16": (1, 2, 4, 24, jnp.bfloat16, False),  # D = 24 is padded to 32 with masks
    "decode_splits_h128": (8, 1, 128, 512, jnp.bfloat16, True),  # B = 1 decode: one row per program
    "odd_rows_f32": (3, 37, 4, 136, jnp.float32, True),  # T*H = 148 rows: ragged last row block
    "parts_over_64": (80, 1, 4, 32, jnp.float32, False),  # more parts than one tile: chunked loop
}


@pytest.mark.parametrize("name", list(CASES))
def test_matches_reference(name):
    n, t, h, d, dtype, sink = CASES[name]
    _check(*_inputs(len(name), n, t, h, d, dtype, sink))


def test_float32_parts_into_bf16_and_extreme_sinks():
    """sparse MLA's use: f32 partials merged straight into bf16; sink -inf is a no-op, +inf zeroes."""
    outs, lses, _ = _inputs(3, 4, 3, 16, 512, jnp.float32, False)
    sink = jnp.linspace(-1.0, 1.0, 16).at[2].set(-jnp.inf).at[5].set(jnp.inf)
    _check(outs, lses, sink, out_dtype=jnp.bfloat16)


_TARGET_CC = {"sm_80": 80, "sm_90": 90, "sm_120": 120}


@pytest.mark.parametrize("target", list(_TARGET_CC))
def test_lowers_for_cuda(target, monkeypatch):
    monkeypatch.setattr(tuning, "compute_capability", lambda: _TARGET_CC[target])
    # B = 1 splits, B = 128 two splits, tiny-model width (column masks), more parts than one tile.
    shapes = [
        (16, 1, 128, 512, True),
        (2, 128, 128, 512, False),
        (3, 4096, 4, 136, True),
        (80, 1, 4, 32, False),
    ]
    for n, t, h, d, with_sink in shapes:
        args = [jax.ShapeDtypeStruct((n, t, h, d), jnp.float32), jax.ShapeDtypeStruct((n, t, h), jnp.float32)]
        if with_sink:
            args.append(jax.ShapeDtypeStruct((h,), jnp.float32))
        text = lower_for_cuda(
            functools.partial(kernel.merge_states, out_dtype=jnp.bfloat16), *args, target=target
        )
        assert "__gpu$xla.gpu.triton" in text, (n, t, h, d)
