"""What every V4 layer of one step shares: tokens, positions, the cache addressing, RoPE angles."""

from __future__ import annotations

import dataclasses

import jax

from jaxdsa.cache import StepMeta, slots_for


@dataclasses.dataclass(frozen=True)
class V4Context:
    """Built once per step by the model, read by every layer (only inside a trace).

    ``main`` / ``compress``: (cos, sin) [T, r/2] of the two RoPEs at the step's positions (sliding-
    only layers use the first, compressed layers the second for everything they rotate).
    """

    tokens: jax.Array  # [T] int32: hash-routed layers pick experts by token id
    positions: jax.Array  # [T] int32
    meta: StepMeta
    main: tuple[jax.Array, jax.Array]
    compress: tuple[jax.Array, jax.Array]

    def slots(self, positions: jax.Array, page_size: int) -> jax.Array:
        """Flat cache slots of positions of each token's own sequence: ``positions`` [T] or [T, K]
        (-1 where the position or the token's sequence is negative)."""
        seq = self.meta.seq_ids if positions.ndim == 1 else self.meta.seq_ids[:, None]
        return slots_for(self.meta.page_table, seq, positions, page_size)
