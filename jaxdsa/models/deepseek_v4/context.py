"""What every V4 layer of one step shares: tokens, positions, the cache addressing, RoPE angles.

V4 keeps what only recent positions need (the window's K = V rows, the compressors' source rows) in
per-sequence rings: a layer reads and writes them by segment (:mod:`jaxdsa.layers.segments`).
"""

from __future__ import annotations

import dataclasses

import jax

from jaxdsa.cache import StepMeta
from jaxdsa.layers.segments import Segments


@dataclasses.dataclass(frozen=True)
class V4Context(Segments):
    """Built once per step by the model, read by every layer (only inside a trace).

    ``main`` / ``compress``: (cos, sin) [T, r/2] of the two RoPEs at the step's positions (sliding-
    only layers use the first, compressed layers the second for everything they rotate).
    ``segment_start`` / ``segment_first`` / ``segment_end`` [T]: of each token's segment (its
    sequence's tokens in this step), the first position, that token's index in the step, and the
    last position (:func:`jaxdsa.layers.segments.segments`).
    """

    per_token = ("tokens", "main", "compress")
    tokens: jax.Array  # [T] int32: hash-routed layers pick experts by token id
    positions: jax.Array  # [T] int32
    meta: StepMeta
    main: tuple[jax.Array, jax.Array]
    compress: tuple[jax.Array, jax.Array]
    segment_start: jax.Array
    segment_first: jax.Array
    segment_end: jax.Array
