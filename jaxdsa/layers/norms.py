"""RMSNorm and LayerNorm with HF transformers' casting order (normalize in float32), and the norm of a
decoder layer's residual stream, which adds the sublayer's output first (one kernel)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxdsa import ops
from jaxdsa.layers.params import ones, zeros
from jaxdsa.layers.stacks import layer_value, split_layer


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


class StackedRMSNorm(RMSNorm):
    """An RMSNorm whose weight a kernel may read in its layer stack (MLA's latent norms,
    :func:`jaxdsa.ops.mla_latent`): scanned, the weight reaches the layer whole
    (:meth:`stack_reads`); XLA's own norm takes the layer's slice."""

    def stack_reads(self) -> tuple[str, ...]:
        return ("weight",)

    def __call__(self, x: jax.Array) -> jax.Array:
        return rms_norm(x, layer_value(self.weight.get_value()), self.eps)


def add_residual(h: jax.Array, delta: jax.Array) -> jax.Array:
    """``h + delta`` rounded once to h's dtype: :class:`ResidualRMSNorm`'s sum without the norm
    (``delta`` may be a float32 sublayer output)."""
    return (h.astype(jnp.float32) + delta.astype(jnp.float32)).astype(h.dtype)


class ResidualRMSNorm(RMSNorm):
    """The RMSNorm in front of a decoder sublayer, which first adds the residual: ``norm(x, residual)
    -> (rms_norm(x + residual), x + residual)``, vLLM's fused-add convention, in one kernel
    (:func:`jaxdsa.ops.add_rms_norm`). At decode XLA makes the add, the mean square and the scaling
    two or three launches, and an add that follows an all-reduce falls outside the CUDA graphs.
    ``residual`` (the sublayer's output) may be float32, as an all-reduce leaves it: the kernel
    rounds the sum once, so no cast of its own runs in between. Scanned, the weight reaches the
    layer as its stack (:meth:`stack_reads`), read in place."""

    def stack_reads(self) -> tuple[str, ...]:
        return ("weight",)

    def __call__(self, x: jax.Array, residual: jax.Array) -> tuple[jax.Array, jax.Array]:
        stack, layer = split_layer(self.weight.get_value())
        rows = lambda a: a.reshape(-1, a.shape[-1])  # noqa: E731
        normed, summed = ops.add_rms_norm(rows(x), stack, eps=self.eps, residual=rows(residual), layer=layer)
        return normed.reshape(x.shape), summed.reshape(x.shape)


class LayerNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, *, axis: str, dtype):
        self.weight = ones((dim,), dtype, (axis,))
        self.bias = zeros((dim,), dtype, (axis,))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        return layer_norm(x, self.weight[...], self.bias[...], self.eps)
