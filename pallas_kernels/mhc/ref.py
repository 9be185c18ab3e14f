"""Pure-JAX oracle for DeepSeek-V4's hyper-connection sites (docs/models.md §3.2, HF's formulas)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def sinkhorn(logits: jax.Array, *, iters: int, eps: float) -> jax.Array:
    """Row softmax + eps, then normalize columns first, then (rows, columns) ``iters - 1`` times."""
    c = jax.nn.softmax(logits, axis=-1) + eps
    c = c / (jnp.sum(c, axis=-2, keepdims=True) + eps)

    def step(_, c):
        c = c / (jnp.sum(c, axis=-1, keepdims=True) + eps)
        return c / (jnp.sum(c, axis=-2, keepdims=True) + eps)

    return jax.lax.fori_loop(0, iters - 1, step, c)


def hc_pre(x, fn, base, scale, *, iters: int, hc_eps: float, norm_eps: float):
    """x [T, n, D] streams; fn [n D, (2 + n) n], base [(2 + n) n], scale [3] (float32).

    -> (collapsed [T, D] in x.dtype, post [T, n] f32, comb [T, n, n] f32). With the streams flattened
    and RMS-normalized (no weight): mix = x_hat @ fn; pre = sigmoid(mix_pre * s0 + b) + hc_eps;
    post = 2 sigmoid(mix_post * s1 + b); comb = Sinkhorn(mix_comb * s2 + b) with rows i (input stream)
    and columns j (output stream); collapsed = sum_i pre_i x_i.
    """
    t, n, d = x.shape
    x32 = x.astype(jnp.float32)
    flat = x32.reshape(t, n * d)
    normed = flat * jax.lax.rsqrt(jnp.mean(flat * flat, axis=-1, keepdims=True) + norm_eps)
    mix = jnp.matmul(normed, fn.astype(jnp.float32), precision="highest")
    base, scale = base.astype(jnp.float32), scale.astype(jnp.float32)
    pre = jax.nn.sigmoid(mix[:, :n] * scale[0] + base[:n]) + hc_eps
    post = 2.0 * jax.nn.sigmoid(mix[:, n : 2 * n] * scale[1] + base[n : 2 * n])
    comb_logits = (mix[:, 2 * n :] * scale[2] + base[2 * n :]).reshape(t, n, n)
    comb = sinkhorn(comb_logits, iters=iters, eps=hc_eps)
    collapsed = jnp.einsum("tn,tnd->td", pre, x32, precision="highest").astype(x.dtype)
    return collapsed, post, comb


def hc_post(x, out, post, comb):
    """x [T, n, D] streams, out [T, D] the block's output -> new streams [T, n, D] in x.dtype:
    ``x'_j = post_j * out + sum_i comb[i, j] x_i`` (comb consumed transposed, as HF)."""
    mixed = jnp.einsum("tij,tid->tjd", comb.astype(jnp.float32), x.astype(jnp.float32), precision="highest")
    return (post[:, :, None] * out.astype(jnp.float32)[:, None, :] + mixed).astype(x.dtype)
