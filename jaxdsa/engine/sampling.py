"""On-device sampling: greedy, temperature, top-k and top-p, with per-request seeds.

Each request's key is fold_in(key(seed), n) where n counts its generated tokens, so a seeded
request samples the same tokens whatever else shares its batch, and after a preemption.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def sample(logits, temperature, top_p, top_k, seeds, counters):
    """logits [R, V] float32; per-row temperature/top_p (f32), top_k/seeds/counters (i32) -> ids [R]."""
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    z = logits / jnp.where(temperature > 0, temperature, 1.0)[:, None]
    ordered = -jnp.sort(-z, axis=-1)
    V = logits.shape[-1]
    kth = jnp.take_along_axis(ordered, jnp.clip(top_k - 1, 0, V - 1)[:, None], axis=-1)
    z = jnp.where((top_k[:, None] > 0) & (z < kth), -jnp.inf, z)
    ordered = jnp.where((top_k[:, None] > 0) & (ordered < kth), -jnp.inf, ordered)
    probs = jax.nn.softmax(ordered, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # mass strictly above each sorted token
    cutoff = jnp.min(jnp.where(before < top_p[:, None], ordered, jnp.inf), axis=-1, keepdims=True)
    z = jnp.where(z < cutoff, -jnp.inf, z)
    keys = jax.vmap(lambda s, c: jax.random.fold_in(jax.random.key(s), c))(seeds, counters)
    drawn = jax.vmap(jax.random.categorical)(keys, z).astype(jnp.int32)
    return jnp.where(temperature > 0, drawn, greedy)
