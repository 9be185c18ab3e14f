"""Pure-JAX oracle for top-k selection (``jax.lax.top_k``)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def topk_indices(logits, k: int):
    """logits [T,S] -> [T,k] int32 indices of the k largest finite values; -1 pads short rows."""
    T, S = logits.shape
    if S < k:
        logits = jnp.pad(logits, ((0, 0), (0, k - S)), constant_values=-jnp.inf)
    values, idx = jax.lax.top_k(logits, k)
    return jnp.where(jnp.isfinite(values), idx, -1).astype(jnp.int32)
