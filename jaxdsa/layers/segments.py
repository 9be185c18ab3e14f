"""A packed step's segments: each sequence's tokens of the step, and the per-sequence rings they read.

State that only the last positions need (DeepSeek-V4's window and compressor rows, GLM-5.3-Flash's
short-convolution inputs and open index pool) lives in per-sequence rings (:mod:`jaxdsa.cache`), so a
step cannot write its rows first and read them back: a long prefill chunk would overwrite the rows its
own first tokens read. Instead a layer reads positions before the step from the ring as it was,
positions of the step from the step's own rows (:meth:`Segments.step_rows`), and then writes the last
``ring`` rows of each segment (:meth:`Segments.ring_writes`). This needs each sequence's tokens
contiguous and in position order in the packed step, which is how the runner packs them.

:class:`Segments` is a mixin for a family's step context: a frozen dataclass with ``positions``,
``meta`` and the three ``segment_*`` arrays of :func:`segments`, whose ``per_token`` fields are the
other arrays (or tuples of arrays) with one row per token.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp

from jaxdsa.cache import StepMeta, slots_for


def sequence_starts(positions: jax.Array, meta: StepMeta) -> jax.Array:
    """[B] each sequence's first position in this step (int32 max for a sequence with no token in it):
    what :func:`segments` hands each token, and what tells a family that a sequence starts afresh."""
    B = meta.page_table.shape[0]
    return jax.ops.segment_min(positions, _segment_ids(meta), num_segments=B)


def segments(positions: jax.Array, meta: StepMeta) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Of every token's segment (its sequence's tokens in this step): the first position, that
    token's index in the step and the last position, each [T] (padding: anything)."""
    seq = meta.seq_ids
    B = meta.page_table.shape[0]
    ids = _segment_ids(meta)
    index = jnp.arange(seq.shape[0], dtype=jnp.int32)
    start = sequence_starts(positions, meta)
    first = jax.ops.segment_min(index, ids, num_segments=B)
    end = jax.ops.segment_max(positions, ids, num_segments=B)
    row = jnp.where(seq >= 0, seq, 0)
    return start[row], first[row], end[row]


def _segment_ids(meta: StepMeta) -> jax.Array:
    """[T] each token's sequence, padding out of range (B), where the segment ops drop it."""
    return jnp.where(meta.seq_ids >= 0, meta.seq_ids, meta.page_table.shape[0])


class Segments:
    """Addressing by segment, for a dataclass with ``positions``, ``meta``, ``segment_start``,
    ``segment_first`` and ``segment_end`` (see the module docstring)."""

    per_token: ClassVar[tuple[str, ...]] = ()  # further fields with a row per token (``take`` picks them)
    positions: jax.Array  # [T] int32
    meta: StepMeta
    segment_start: jax.Array
    segment_first: jax.Array
    segment_end: jax.Array

    def take(self, at: jax.Array, keep: jax.Array):
        """The tokens at step indices ``at`` (``keep`` False: padding) as a context of their own."""
        meta = StepMeta(jnp.where(keep, self.meta.seq_ids[at], -1), self.meta.page_table, at)
        pick = lambda a: jax.tree.map(lambda x: x[at], a)  # noqa: E731
        fields = ("positions", "segment_start", "segment_first", "segment_end", *self.per_token)
        return dataclasses.replace(self, meta=meta, **{f: pick(getattr(self, f)) for f in fields})

    def _per_token(self, a: jax.Array, like: jax.Array) -> jax.Array:
        return a if like.ndim == 1 else a[:, None]

    def slots(self, positions: jax.Array, page_size: int) -> jax.Array:
        """Flat paged-cache slots of positions (or entry indices) of each token's own sequence:
        ``positions`` [T] or [T, K] (-1 where the position or the token's sequence is negative)."""
        return slots_for(
            self.meta.page_table, self._per_token(self.meta.seq_ids, positions), positions, page_size
        )

    def ring_slots(self, positions: jax.Array, ring: int) -> jax.Array:
        """Flat slots in a ring of ``ring`` rows per sequence of positions before each token's
        segment (-1 for positions of the step, negative positions and padding)."""
        seq = self._per_token(self.meta.seq_ids, positions)
        before = (seq >= 0) & (positions >= 0) & (positions < self._per_token(self.segment_start, positions))
        return _ring_slot(before, seq, positions, ring)

    def step_rows(self, positions: jax.Array) -> jax.Array:
        """Step indices of positions of each token's own segment (-1 for positions before it)."""
        start = self._per_token(self.segment_start, positions)
        inside = (self._per_token(self.meta.seq_ids, positions) >= 0) & (positions >= start)
        return jnp.where(inside, self._per_token(self.segment_first, positions) + positions - start, -1)

    def ring_writes(self, ring: int) -> jax.Array:
        """[T] ring slots the step's tokens write: the last ``ring`` positions of each segment (a
        longer segment's earlier tokens would share rows with them), -1 for the rest."""
        seq, p = self.meta.seq_ids, self.positions
        keep = (seq >= 0) & (p > self.segment_end - ring)
        return _ring_slot(keep, seq, p, ring)

    def gather_rows(self, positions: jax.Array, step_rows: jax.Array, ring: jax.Array) -> jax.Array:
        """Rows of ``positions [n, k]`` of each token's sequence: the step's own (``step_rows [T, w]``)
        for positions of its segment, else the ring's (``ring``: a :class:`~jaxdsa.cache.LayerPages`
        ring); zeros for negative positions. -> [n, k, w]"""
        flat, at = ring.rows(self.ring_slots(positions, ring.page_size))
        step_at = self.step_rows(positions)
        got = jnp.where(
            (step_at >= 0)[..., None], step_rows[jnp.maximum(step_at, 0)], flat[jnp.maximum(at, 0)]
        )
        return jnp.where((positions >= 0)[..., None], got, 0)


def _ring_slot(valid: jax.Array, seq: jax.Array, positions: jax.Array, ring: int) -> jax.Array:
    """Position t of sequence s sits in row ``t % ring`` of that sequence's ring; -1 where not valid."""
    return jnp.where(valid, seq * ring + positions % ring, -1)
