"""The one linear layer every projection goes through, and the vocabulary embedding."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxdsa import sharding
from jaxdsa.layers.params import fan_in, normal
from jaxdsa.sharding import Axes


class Linear(nnx.Module):
    """``y = x . W`` contracting x's trailing ``in_shape`` dims with W's leading ones.

    ``weight [*in_shape, *out_shape]`` carries ``axes`` (one logical name per dim), so a
    head-split projection (``[q_lora, H, d]``) or a head-merging one (``[H, v, D]``) is one
    layer. ``compute_dtype`` casts both operands first (routers and the indexer's head weights run
    in float32); ``out_dtype`` asks the dot for a wider result (logits).
    """

    def __init__(
        self,
        in_shape: tuple[int, ...],
        out_shape: tuple[int, ...],
        axes: Axes,
        *,
        dtype,
        rngs: nnx.Rngs,
        compute_dtype=None,
        out_dtype=None,
    ):
        shape = (*in_shape, *out_shape)
        self.weight = normal(rngs, shape, fan_in(shape, len(in_shape)), dtype, axes)
        self.in_ndim = len(in_shape)
        self.compute_dtype = compute_dtype
        self.out_dtype = out_dtype

    def __call__(self, x: jax.Array) -> jax.Array:
        w = self.weight[...]
        if self.compute_dtype is not None:
            x, w = x.astype(self.compute_dtype), w.astype(self.compute_dtype)
        return jnp.tensordot(x, w, axes=self.in_ndim, preferred_element_type=self.out_dtype)


class Embed(nnx.Module):
    """Token embedding ``[V, D]``, vocabulary split over TP (looked up shard-locally, one psum)."""

    def __init__(self, vocab: int, dim: int, *, dtype, rngs: nnx.Rngs):
        self.weight = normal(rngs, (vocab, dim), 1, dtype, ("vocab", "embed"))

    def __call__(self, ids: jax.Array) -> jax.Array:
        return sharding.embed_lookup(self.weight[...], ids)
