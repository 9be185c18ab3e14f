"""RMSNorm and LayerNorm with HF transformers' casting order (normalize in float32)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxdsa.layers.params import ones, zeros


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """weight * (x / sqrt(mean(x^2) + eps)); the normalized value is cast back before the weight."""
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return weight * y.astype(x.dtype)


def layer_norm(x: jax.Array, weight: jax.Array, bias: jax.Array, eps: float) -> jax.Array:
    x32 = x.astype(jnp.float32)
    mean = jnp.mean(x32, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
    y = (x32 - mean) * jax.lax.rsqrt(var + eps)
    return (y * weight.astype(jnp.float32) + bias.astype(jnp.float32)).astype(x.dtype)


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, *, axis: str = "embed", dtype):
        self.weight = ones((dim,), dtype, (axis,))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        return rms_norm(x, self.weight[...], self.eps)


class LayerNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, *, axis: str, dtype):
        self.weight = ones((dim,), dtype, (axis,))
        self.bias = zeros((dim,), dtype, (axis,))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        return layer_norm(x, self.weight[...], self.bias[...], self.eps)
