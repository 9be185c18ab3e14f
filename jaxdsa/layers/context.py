"""What every attention layer of one step shares: positions, RoPE angles, cache addressing, mode."""

from __future__ import annotations

import dataclasses

import jax

from jaxdsa.cache import StepMeta


@dataclasses.dataclass(frozen=True)
class StepContext:
    """Built once per step by the model, read by every layer (only inside a trace).

    ``sparse``: attend to the indexer's top-k keys (else every causal key). ``absorbed``: latent-
    space attention through the sparse-MLA op (decode, batched steps) rather than the expanded
    per-head form (single-sequence prefill).
    """

    positions: jax.Array  # [T] int32
    cos: jax.Array  # [T, rope/2] float32
    sin: jax.Array
    meta: StepMeta
    sparse: bool
    absorbed: bool
