"""Manifold-constrained hyper-connections (mHC, models.md §3.2): the residual is ``hc_mult`` streams.

Each block has two sites (attention, FFN). A site computes from the streams a collapse vector
``pre``, an expansion vector ``post`` and a doubly-stochastic mixing matrix ``comb`` (Sinkhorn),
feeds ``sum_i pre_i X_i`` to its sub-layer and writes ``X'_j = post_j out + sum_i comb_ij X_i``
(:func:`jaxdsa.ops.hc_pre` / :func:`jaxdsa.ops.hc_post`). The HC head collapses the streams once
more, with its own ``pre`` only, before the final norm.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxdsa import ops
from jaxdsa.models.deepseek_v4.config import V4Config


def expand(h: jax.Array, cfg: V4Config) -> jax.Array:
    """[T, D] -> [T, n, D]: every stream starts as the embedding."""
    return jnp.broadcast_to(h[:, None, :], (h.shape[0], cfg.hc_mult, h.shape[1]))


def site_in(p: dict, x: jax.Array, cfg: V4Config) -> tuple[jax.Array, jax.Array, jax.Array]:
    """-> (sub-layer input [T, D], post [T, n], comb [T, n, n]) of one HC site."""
    return ops.hc_pre(
        x,
        p["fn"],
        p["base"],
        p["scale"],
        iters=cfg.hc_sinkhorn_iters,
        hc_eps=cfg.hc_eps,
        norm_eps=cfg.rms_norm_eps,
    )


def site_out(x: jax.Array, out: jax.Array, post: jax.Array, comb: jax.Array) -> jax.Array:
    """The streams after a sub-layer that returned ``out [T, D]``."""
    return ops.hc_post(x, out, post, comb)


def head(p: dict, x: jax.Array, cfg: V4Config) -> jax.Array:
    """The HC head: ``sum_i (sigmoid(mix_i * scale + base_i) + hc_eps) X_i`` -> [T, D]."""
    t, n, d = x.shape
    flat = x.astype(jnp.float32).reshape(t, n * d)
    normed = flat * jax.lax.rsqrt(jnp.mean(flat * flat, axis=-1, keepdims=True) + cfg.rms_norm_eps)
    mix = jnp.matmul(normed, p["fn"], precision="highest")
    pre = jax.nn.sigmoid(mix * p["scale"][0] + p["base"]) + cfg.hc_eps
    return jnp.einsum("tn,tnd->td", pre, x.astype(jnp.float32), precision="highest").astype(x.dtype)
