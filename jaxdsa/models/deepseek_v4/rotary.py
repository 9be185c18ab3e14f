"""V4 RoPE: interleaved pairs on the **trailing** rotary dims of every vector (docs/models.md §3.3, §8.10).

Sliding-window-only layers use the main RoPE (``rope_theta``, no YaRN); compressed layers use the
compress RoPE (``compress_rope_theta`` with YaRN, attention factor as configured) for everything
in the layer: queries, window keys, compressed entries and the indexer. The attention output is
rotated back with the conjugate angle at the query position (:func:`rotate_tail` ``inverse``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxdsa.layers.rope import apply_rope


def rotate_tail(x: jax.Array, cos: jax.Array, sin: jax.Array, *, inverse: bool = False) -> jax.Array:
    """Rotate the last ``2 * cos.shape[-1]`` dims of ``x [T, ..., d]`` (interleaved pairs) per token."""
    r = 2 * cos.shape[-1]
    rotated = apply_rope(x[..., -r:], cos, -sin if inverse else sin, interleaved=True)
    return jnp.concatenate([x[..., :-r], rotated], axis=-1)
