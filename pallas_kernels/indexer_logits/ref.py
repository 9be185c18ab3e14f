"""Pure-JAX oracles for the lightning-indexer logits (flat and paged forms)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

_QUERY_CHUNK = 32


def _logits(q, w, k, q_pos):
    """q [T,Hi,D], w [T,Hi], k [T|1,S,D] -> [T,S] f32 with s > q_pos masked to -inf."""
    scores = jnp.einsum("thd,tsd->ths", q.astype(jnp.float32), k.astype(jnp.float32), precision="highest")
    logits = jnp.einsum("th,ths->ts", w.astype(jnp.float32), jax.nn.relu(scores), precision="highest")
    s = jnp.arange(k.shape[1], dtype=jnp.int32)
    return jnp.where(s[None, :] <= q_pos[:, None], logits, -jnp.inf)


def indexer_logits(q, w, k, *, q_pos):
    """See :func:`jaxdsa.ops.indexer_logits`."""
    if q.shape[0] <= _QUERY_CHUNK:
        return _logits(q, w, k[None], q_pos)
    return jax.lax.map(
        lambda a: _logits(a[0][None], a[1][None], k[None], a[2][None])[0],
        (q, w, q_pos),
        batch_size=_QUERY_CHUNK,
    )


def indexer_logits_paged(q, w, k_pages, page_table, seq_ids, q_pos, *, k_scale=None):
    """See :func:`jaxdsa.ops.indexer_logits_paged`: every query reads its own sequence's keys."""
    page_size = k_pages.shape[1]
    keys = k_pages.astype(jnp.float32)
    if k_scale is not None:
        keys = keys * k_scale.astype(jnp.float32)[..., None]
    valid_q = seq_ids >= 0
    q_pos = jnp.where(valid_q, q_pos, -1)
    tables = page_table[jnp.where(valid_q, seq_ids, 0)]  # [T,M]

    def one(q1, w1, table, pos):
        k = keys[table].reshape(1, -1, keys.shape[-1])  # [1, M*page, D]
        return _logits(q1[None], w1[None], k, pos[None])[0]

    del page_size
    return jax.lax.map(lambda a: one(*a), (q, w, tables, q_pos), batch_size=_QUERY_CHUNK)
