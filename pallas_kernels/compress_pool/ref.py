"""Pure-JAX oracle for the V4 compressor's pooling (docs/models.md §3.4, HF's CSA / HCA compressors)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def compress_pool(kv, score, norm, *, eps: float, prev_kv=None, prev_score=None):
    """Pool W complete windows of m source rows into W entries, then RMSNorm them.

    kv, score [W, m, c d] float (score = gate logits + ape, already added); norm [d]; c = 2 means
    overlapping windows (CSA): entry w pools 2m slots per channel, the first d channels of window
    w - 1's rows and the last d channels of window w's rows; ``prev_kv`` / ``prev_score`` [m, d]
    stand in for window -1 (carried from an earlier chunk; None = no such window, weight 0). c = 1
    (HCA): entry w pools window w's m rows. The softmax runs over slots separately per channel.
    Returns [W, d] in kv.dtype.
    """
    w, m, cd = kv.shape
    d = norm.shape[0]
    if cd not in (d, 2 * d):
        raise ValueError(f"compress_pool: kv width {cd} is neither {d} nor {2 * d} (norm width {d})")
    if w == 0:
        return jnp.zeros((0, d), kv.dtype)
    kv32, sc32 = kv.astype(jnp.float32), score.astype(jnp.float32)
    if cd == 2 * d:
        if prev_kv is None:
            prev_kv = jnp.zeros((m, d), jnp.float32)
            prev_score = jnp.full((m, d), -jnp.inf, jnp.float32)
        before_kv = jnp.concatenate([prev_kv.astype(jnp.float32)[None], kv32[:-1, :, :d]], axis=0)
        before_sc = jnp.concatenate([prev_score.astype(jnp.float32)[None], sc32[:-1, :, :d]], axis=0)
        kv32 = jnp.concatenate([before_kv, kv32[:, :, d:]], axis=1)  # [W, 2m, d]
        sc32 = jnp.concatenate([before_sc, sc32[:, :, d:]], axis=1)
    pooled = jnp.sum(jax.nn.softmax(sc32, axis=1) * kv32, axis=1)
    normed = pooled * jax.lax.rsqrt(jnp.mean(pooled * pooled, axis=-1, keepdims=True) + eps)
    return (normed * norm.astype(jnp.float32)).astype(kv.dtype)
