"""What every GLM-5.3-Flash layer of one step shares: MLA's step context plus the step's segments.

The DSA layers read :class:`~jaxdsa.layers.context.StepContext` (positions, cache addressing, the
sparse / absorbed switches; the RoPE angles are ``[T, 0]``: the model has no position encoding). The
KDA layers and the pooled indexer keep per-sequence rings and states, read and written by segment
(:mod:`jaxdsa.layers.segments`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxdsa.cache import StepMeta
from jaxdsa.layers.context import StepContext
from jaxdsa.layers.segments import Segments, segments, sequence_starts


@dataclasses.dataclass(frozen=True)
class Glm5NextContext(StepContext, Segments):
    """``fresh [B]``: sequence b's tokens in this step begin at position 0 (its recurrent state starts
    from zeros, whatever its cache row held before)."""

    per_token = ("cos", "sin")
    segment_start: jax.Array
    segment_first: jax.Array
    segment_end: jax.Array
    fresh: jax.Array

    @classmethod
    def build(cls, positions: jax.Array, meta: StepMeta, *, sparse: bool, absorbed: bool) -> Glm5NextContext:
        none = jnp.zeros((positions.shape[0], 0), jnp.float32)
        start, first, end = segments(positions, meta)
        fresh = sequence_starts(positions, meta) == 0
        return cls(positions, none, none, meta, sparse, absorbed, start, first, end, fresh)
