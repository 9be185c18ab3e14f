"""Rotary position embeddings: default and YaRN frequencies, interleaved or half-split pairs.

Pair layouts (docs/models.md §2.3): *interleaved* rotates dims (2i, 2i+1); *half-split* rotates
(i, i + d/2). Outputs keep the input's layout. (HF writes interleaved results de-interleaved;
dot products are the same because q and k are permuted alike, and our cache holds our layout.)
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxdsa.config import RopeConfig, yarn_attention_factor


def inverse_frequencies(rope: RopeConfig, dim: int) -> np.ndarray:
    """inv_freq [dim/2] in float32, computed like HF's default / yarn initialisers."""
    exponents = np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)
    pos_freqs = np.float32(rope.theta) ** exponents
    inv_freq = (1.0 / pos_freqs).astype(np.float32)
    if rope.type == "default":
        return inv_freq

    def correction_dim(rotations: float) -> float:
        return (
            dim
            * math.log(rope.original_max_position_embeddings / (rotations * 2 * math.pi))
            / (2 * math.log(rope.theta))
        )

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1).astype(np.float32)
    extrapolation = (1 - ramp).astype(np.float32)
    interpolation = (1.0 / (np.float32(rope.factor) * pos_freqs)).astype(np.float32)
    return (interpolation * (1 - extrapolation) + inv_freq * extrapolation).astype(np.float32)


def cos_sin(positions: jax.Array, rope: RopeConfig, dim: int) -> tuple[jax.Array, jax.Array]:
    """cos, sin [T, dim/2] float32 for integer positions, YaRN attention factor applied."""
    inv_freq = jnp.asarray(inverse_frequencies(rope, dim))
    angles = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]
    factor = yarn_attention_factor(rope)
    return jnp.cos(angles) * factor, jnp.sin(angles) * factor


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array, *, interleaved: bool) -> jax.Array:
    """Rotate ``x [T, ..., d]`` by per-token angles; cos/sin are [T, d/2], broadcast over heads."""
    extra = x.ndim - 2
    c = cos.reshape(cos.shape[:1] + (1,) * extra + cos.shape[1:])
    s = sin.reshape(sin.shape[:1] + (1,) * extra + sin.shape[1:])
    x32 = x.astype(jnp.float32)
    if interleaved:
        a, b = x32[..., 0::2], x32[..., 1::2]
        out = jnp.stack([a * c - b * s, b * c + a * s], axis=-1).reshape(x.shape)
    else:
        half = x.shape[-1] // 2
        a, b = x32[..., :half], x32[..., half:]
        out = jnp.concatenate([a * c - b * s, b * c + a * s], axis=-1)
    return out.astype(x.dtype)
