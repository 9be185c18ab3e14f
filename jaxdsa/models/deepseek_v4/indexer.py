"""The CSA lightning indexer (models.md §3.5, §8.10 as HF computes it: no Hadamard, no FP4 simulation).

It scores its own compressed keys (an overlapping compressor of width ``index_head_dim``) against
per-head queries from the attention's q latent: ``I(p, j) = sum_h w_h relu(q_h . K_j)`` with
``w = weights_proj(x) * index_head_dim^-0.5 * index_n_heads^-0.5``, over the entries complete at
position p (``j < (p + 1) // m``), and keeps the top ``index_topk``; -1 marks empty picks.
The existing :func:`jaxdsa.ops.indexer_logits` computes exactly this when a query's "position" is
its last visible entry, ``(p + 1) // m - 1``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxdsa import ops
from jaxdsa.models.deepseek_v4 import compressor
from jaxdsa.models.deepseek_v4.config import V4Config
from jaxdsa.models.deepseek_v4.rotary import compress_rope_tables, rotate_tail


def queries(p: dict, x: jax.Array, q_lat: jax.Array, positions: jax.Array, cfg: V4Config):
    """-> (q [T, nI, dI] roped at the query positions, head weights w [T, nI] float32)."""
    q = jnp.einsum("tr,rhd->thd", q_lat, p["wq_b"], precision="highest")
    q = rotate_tail(q, *compress_rope_tables(cfg, positions))
    scale = cfg.index_head_dim**-0.5 * cfg.index_n_heads**-0.5
    w = jnp.matmul(x.astype(jnp.float32), p["weights_proj"].astype(jnp.float32), precision="highest") * scale
    return q, w


def select(
    q: jax.Array, w: jax.Array, keys: jax.Array, positions: jax.Array, ratio: int, topk: int
) -> jax.Array:
    """Top ``min(topk, #keys)`` compressed entries per query [T, K] int32, -1 where fewer are complete."""
    last_visible = (positions + 1) // ratio - 1
    logits = ops.indexer_logits(q, w, keys, q_pos=last_visible)
    return ops.topk_indices(logits, min(topk, keys.shape[0]))


def select_for_sequence(p: dict, x: jax.Array, q_lat: jax.Array, cfg: V4Config, ratio: int) -> jax.Array:
    """The indexer of a sequence starting at position 0: its keys, queries and selection."""
    positions = jnp.arange(x.shape[0], dtype=jnp.int32)
    keys = compressor.compress_sequence(p["compressor"], x, cfg)
    q, w = queries(p, x, q_lat, positions, cfg)
    return select(q, w, keys, positions, ratio, cfg.index_topk)
