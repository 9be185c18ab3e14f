"""Manifold-constrained hyper-connections (mHC, docs/models.md §3.2): the residual is ``hc_mult`` streams.

Each block has two sites (attention, FFN). A site computes from the streams a collapse vector
``pre``, an expansion vector ``post`` and a doubly-stochastic mixing matrix ``comb`` (Sinkhorn),
feeds ``sum_i pre_i X_i`` to its sub-layer and writes ``X'_j = post_j out + sum_i comb_ij X_i``
(:func:`jaxdsa.ops.hc_pre` / :func:`jaxdsa.ops.hc_post`). The HC head collapses the streams once
more, with its own ``pre`` only, before the final norm. Every HC parameter stays float32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxdsa import ops
from jaxdsa.layers.params import ones, zeros
from jaxdsa.models.deepseek_v4.config import V4Config


def expand(h: jax.Array, streams: int) -> jax.Array:
    """[T, D] -> [T, n, D]: every stream starts as the embedding."""
    return jnp.broadcast_to(h[:, None, :], (h.shape[0], streams, h.shape[1]))


class HyperSite(nnx.Module):
    """``fn [n D, (2 + n) n]``, ``base [(2 + n) n]``, ``scale [3]`` (pre, post, comb)."""

    def __init__(self, cfg: V4Config):
        n, mix = cfg.hc_mult, (2 + cfg.hc_mult) * cfg.hc_mult
        self.fn = zeros((n * cfg.hidden_size, mix), jnp.float32, ("hc_flat", "hc_mix"))
        self.base = zeros((mix,), jnp.float32, ("hc_mix",))
        self.scale = ones((3,), jnp.float32, ("hc_mix",))
        self.iters, self.hc_eps, self.norm_eps = cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.rms_norm_eps

    def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Streams [T, n, D] -> (sub-layer input [T, D], post [T, n], comb [T, n, n])."""
        return ops.hc_pre(
            x,
            self.fn[...],
            self.base[...],
            self.scale[...],
            iters=self.iters,
            hc_eps=self.hc_eps,
            norm_eps=self.norm_eps,
        )


class HyperHead(nnx.Module):
    """The HC head: ``sum_i (sigmoid(mix_i * scale + base_i) + hc_eps) X_i`` with ``fn [n D, n]``."""

    def __init__(self, cfg: V4Config):
        n = cfg.hc_mult
        self.fn = zeros((n * cfg.hidden_size, n), jnp.float32, ("hc_flat", "hc_mix"))
        self.base = zeros((n,), jnp.float32, ("hc_mix",))
        self.scale = ones((1,), jnp.float32, ("hc_mix",))
        self.hc_eps, self.norm_eps = cfg.hc_eps, cfg.rms_norm_eps

    def __call__(self, x: jax.Array) -> jax.Array:
        """Streams [T, n, D] -> [T, D]."""
        t, n, d = x.shape
        flat = x.astype(jnp.float32).reshape(t, n * d)
        normed = flat * jax.lax.rsqrt(jnp.mean(flat * flat, axis=-1, keepdims=True) + self.norm_eps)
        mix = jnp.matmul(normed, self.fn[...])
        pre = jax.nn.sigmoid(mix * self.scale[...][0] + self.base[...]) + self.hc_eps
        return jnp.einsum("tn,tnd->td", pre, x.astype(jnp.float32)).astype(x.dtype)


def site_out(x: jax.Array, out: jax.Array, post: jax.Array, comb: jax.Array) -> jax.Array:
    """The streams after a sub-layer that returned ``out [T, D]``."""
    return ops.hc_post(x, out, post, comb)
