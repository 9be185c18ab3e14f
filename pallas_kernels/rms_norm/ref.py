"""Pure-JAX oracle for the residual add + RMSNorm: exactly :func:`jaxdsa.layers.norms.rms_norm` of
the sum, the sum rounded to the activations' dtype first (as HF adds ``residual + hidden``)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def add_rms_norm(
    x: jax.Array,
    weight: jax.Array,
    *,
    eps: float,
    residual: jax.Array | None = None,
    layer: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """x [T, D] (+ residual [T, D]) -> (weight * rms_normalized(sum) [T, D], sum [T, D]).

    The sum is rounded once to x's dtype (``residual`` may be wider: a float32 all-reduce result);
    it is normalized in float32 and cast back before the weight (HF's order). ``weight`` is ``[D]``,
    or a stack ``[L, D]`` read at ``layer`` (int32 scalar)."""
    s = x if residual is None else (x.astype(jnp.float32) + residual.astype(jnp.float32)).astype(x.dtype)
    w = weight if layer is None else weight[layer]
    s32 = s.astype(jnp.float32)
    y = s32 * jax.lax.rsqrt(jnp.mean(s32 * s32, axis=-1, keepdims=True) + eps)
    return w * y.astype(s.dtype), s
