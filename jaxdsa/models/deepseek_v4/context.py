"""What every V4 layer of one step shares: tokens, positions, the cache addressing, RoPE angles.

V4 keeps what only recent positions need (the window's K = V rows, the compressors' source rows) in
per-sequence rings (:mod:`jaxdsa.cache`), so a step cannot write its rows first and read them back:
a long prefill chunk would overwrite the rows its own first tokens read. Instead a layer reads
positions before the step from the ring as it was, positions of the step from the step's own rows
(:meth:`V4Context.step_rows`), and then writes the last ``ring`` rows of each segment
(:meth:`V4Context.ring_writes`). This needs each sequence's tokens contiguous and in position order
in the packed step, which is how the runner packs them.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxdsa.cache import StepMeta, slots_for


@dataclasses.dataclass(frozen=True)
class V4Context:
    """Built once per step by the model, read by every layer (only inside a trace).

    ``main`` / ``compress``: (cos, sin) [T, r/2] of the two RoPEs at the step's positions (sliding-
    only layers use the first, compressed layers the second for everything they rotate).
    ``segment_start`` / ``segment_first`` / ``segment_end`` [T]: of each token's segment (its
    sequence's tokens in this step), the first position, that token's index in the step, and the
    last position.
    """

    tokens: jax.Array  # [T] int32: hash-routed layers pick experts by token id
    positions: jax.Array  # [T] int32
    meta: StepMeta
    main: tuple[jax.Array, jax.Array]
    compress: tuple[jax.Array, jax.Array]
    segment_start: jax.Array
    segment_first: jax.Array
    segment_end: jax.Array

    @staticmethod
    def segments(positions: jax.Array, meta: StepMeta) -> tuple[jax.Array, jax.Array, jax.Array]:
        """(segment_start, segment_first, segment_end) of every token (padding: anything)."""
        seq = meta.seq_ids
        B = meta.page_table.shape[0]
        ids = jnp.where(seq >= 0, seq, B)  # padding: out of range, dropped by the segment ops
        index = jnp.arange(seq.shape[0], dtype=jnp.int32)
        start = jax.ops.segment_min(positions, ids, num_segments=B)
        first = jax.ops.segment_min(index, ids, num_segments=B)
        end = jax.ops.segment_max(positions, ids, num_segments=B)
        row = jnp.where(seq >= 0, seq, 0)
        return start[row], first[row], end[row]

    def take(self, at: jax.Array, keep: jax.Array) -> V4Context:
        """The tokens at step indices ``at`` (``keep`` False: padding) as a context of their own."""
        meta = StepMeta(jnp.where(keep, self.meta.seq_ids[at], -1), self.meta.page_table, at)
        pick = lambda pair: tuple(a[at] for a in pair)  # noqa: E731
        return V4Context(
            self.tokens[at],
            self.positions[at],
            meta,
            pick(self.main),
            pick(self.compress),
            self.segment_start[at],
            self.segment_first[at],
            self.segment_end[at],
        )

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


def _ring_slot(valid: jax.Array, seq: jax.Array, positions: jax.Array, ring: int) -> jax.Array:
    """Position t of sequence s sits in row ``t % ring`` of that sequence's ring; -1 where not valid."""
    return jnp.where(valid, seq * ring + positions % ring, -1)
