"""Residual add + RMSNorm Pallas kernel vs the reference (CPU, interpret mode) + CUDA lowering."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxdsa.layers.norms import rms_norm
from pallas_kernels._triton import LOWERING_TARGETS, lower_for_cuda
from pallas_kernels.rms_norm import kernel, ref


def _inputs(seed: int, t: int, d: int, dtype, layers: int = 3):
    kx, kr, kw = jax.random.split(jax.random.key(seed), 3)
    x = (4.0 * jax.random.normal(kx, (t, d), jnp.float32)).astype(dtype)
    r = jax.random.normal(kr, (t, d), jnp.float32).astype(dtype)
    w = (1.0 + 0.2 * jax.random.normal(kw, (layers, d), jnp.float32)).astype(dtype)
    return x, r, w


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("t, d", [(1, 6144), (3, 7168), (5, 100), (17, 64)])
@pytest.mark.parametrize("with_residual", [True, False])
@pytest.mark.parametrize("stacked", [True, False])
def test_kernel_matches_the_reference(dtype, t, d, with_residual, stacked):
    """Widths that are and are not a power of two (masked tails), one and many rows, a weight
    alone or read from a layer stack at a traced index; the sum is exact, the norm within float32
    rounding of the sum of squares (bf16: at most one unit in the last place)."""
    x, r, w = _inputs(t * d, t, d, dtype)
    residual = r if with_residual else None
    weight, layer = (w, jnp.int32(2)) if stacked else (w[2], None)
    got = jax.jit(lambda x, w, r, i: kernel.add_rms_norm(x, w, eps=1e-5, residual=r, layer=i, interpret=True))
    want = jax.jit(lambda x, w, r, i: ref.add_rms_norm(x, w, eps=1e-5, residual=r, layer=i))
    out, s = got(x, weight, residual, layer)
    want_out, want_s = want(x, weight, residual, layer)
    assert out.dtype == want_out.dtype == dtype and s.dtype == dtype
    np.testing.assert_array_equal(np.asarray(s, np.float32), np.asarray(want_s, np.float32))
    tol = 1e-6 if dtype == jnp.float32 else 1e-2
    got_out, want_out = np.asarray(out, np.float32), np.asarray(want_out, np.float32)
    np.testing.assert_allclose(got_out, want_out, rtol=tol, atol=tol)


def test_reference_is_the_layers_rms_norm_of_the_sum():
    """The oracle is the model's own norm of ``x + residual`` (bit for bit), so switching a layer
    to the fused op changes nothing on the reference backend."""
    x, r, w = _inputs(0, 4, 96, jnp.bfloat16)
    out, s = ref.add_rms_norm(x, w, eps=1e-6, residual=r, layer=jnp.int32(1))
    np.testing.assert_array_equal(np.asarray(s), np.asarray(x + r))
    np.testing.assert_array_equal(np.asarray(out), np.asarray(rms_norm(x + r, w[1], 1e-6)))


def test_bad_shapes_are_named():
    x, r, w = _inputs(0, 2, 64, jnp.float32)
    with pytest.raises(ValueError, match="residual"):
        kernel.add_rms_norm(x, w[0], eps=1e-6, residual=r[:1], interpret=True)
    with pytest.raises(ValueError, match="weight"):
        kernel.add_rms_norm(x, w, eps=1e-6, interpret=True)  # a stack without its layer


@pytest.mark.parametrize("target", sorted(LOWERING_TARGETS))
def test_lowers_for_cuda(target):
    for dtype, d in ((jnp.bfloat16, 6144), (jnp.float32, 7168)):
        args = (
            jax.ShapeDtypeStruct((8, d), dtype),
            jax.ShapeDtypeStruct((3, d), dtype),
            jax.ShapeDtypeStruct((8, d), dtype),
            jax.ShapeDtypeStruct((), jnp.int32),
        )

        def fn(x, w, r, layer):
            return kernel.add_rms_norm(x, w, eps=1e-6, residual=r, layer=layer)

        assert "__gpu$xla.gpu.triton" in lower_for_cuda(fn, *args, target=target)
