"""V4 RoPE: interleaved pairs on the **trailing** rotary dims of every vector (models.md §3.3, §8.10).

Sliding-window-only layers use the main RoPE (``rope_theta``, no YaRN); compressed layers use the
compress RoPE (``compress_rope_theta`` with YaRN, attention factor as configured) for everything
in the layer: queries, window keys, compressed entries and the indexer. The attention output is
rotated back with the conjugate angle at the query position (:func:`rotate_tail` ``inverse``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxdsa.layers.rope import apply_rope, cos_sin
from jaxdsa.models.deepseek_v4.config import SWA, V4Config


def layer_rope_tables(cfg: V4Config, layer: int, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """cos, sin [T, r/2] of a layer's RoPE (main on sliding-only layers, compress otherwise)."""
    rope = cfg.rope if cfg.layer_type(layer) == SWA else cfg.compress_rope
    return cos_sin(positions, rope, cfg.qk_rope_head_dim)


def compress_rope_tables(cfg: V4Config, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    return cos_sin(positions, cfg.compress_rope, cfg.qk_rope_head_dim)


def rotate_tail(x: jax.Array, cos: jax.Array, sin: jax.Array, *, inverse: bool = False) -> jax.Array:
    """Rotate the last ``2 * cos.shape[-1]`` dims of ``x [T, ..., d]`` (interleaved pairs) per token."""
    r = 2 * cos.shape[-1]
    rotated = apply_rope(x[..., -r:], cos, -sin if inverse else sin, interleaved=True)
    return jnp.concatenate([x[..., :-r], rotated], axis=-1)
