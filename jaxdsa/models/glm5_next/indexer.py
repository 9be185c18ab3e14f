"""GLM-5.3-Flash's pooled DSA indexer (docs/models.md §9.5): it scores pools of ``m`` keys, not keys.

Per token: a key ``kI = LayerNorm(wk x)`` and pooling logits ``z = gate x`` (d_I channels each). Pool j
(tokens ``[j m, (j + 1) m)``) has the key ``K_j[c] = sum_o softmax_o(z[c] + ape[o][c]) kI[c]``; a query at
position p scores the complete pools ``j <= (p + 1) // m - 1`` with ``sum_h w_h relu(qI_h . K_j)`` (the
lightning indexer's form, :func:`jaxdsa.ops.indexer_logits_paged`), keeps the best ``index_topk / m``,
and attends their tokens plus its own open pool ``[m floor((p + 1) / m), p]`` (the tail rule).

The cache holds each complete pool's key once (``index_keys``: a paged entry with one row per m tokens,
:class:`~jaxdsa.layers.indexer.KeyPages`) and, per sequence, the raw ``[kI | z]`` rows of the open pool
(``index_ring``, float32, a ring of m rows). The token completing a pool pools its rows, those of
earlier steps from the ring and those of this step from the step's own (like DeepSeek-V4's
compressors); HF instead re-pools every token's cached row at every step, with the same result.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxdsa import ops
from jaxdsa.cache import LayerPages
from jaxdsa.layers.indexer import KeyPages
from jaxdsa.layers.linear import Linear
from jaxdsa.layers.norms import LayerNorm
from jaxdsa.layers.params import zeros
from jaxdsa.models.glm5_next.config import Glm5NextConfig
from jaxdsa.models.glm5_next.context import Glm5NextContext

F32 = jnp.float32
K_NORM_EPS = 1e-6  # HF's nn.LayerNorm(index_head_dim, eps=1e-6)


class PooledIndexer(nnx.Module):
    """``heads`` may include zero-padded heads (a multiple of the TP shards)."""

    def __init__(self, cfg: Glm5NextConfig, *, heads: int, dtype, rngs: nnx.Rngs):
        D, d, m = cfg.hidden_size, cfg.index_head_dim, cfg.index_kpool
        self.wq_b = Linear(
            (cfg.q_lora_rank,),
            (heads, d),
            ("q_lora", "index_heads", "index_head_dim"),
            dtype=dtype,
            rngs=rngs,
        )
        self.wk = Linear((D,), (d,), ("embed", "index_head_dim"), dtype=dtype, rngs=rngs)
        self.k_norm = LayerNorm(d, K_NORM_EPS, axis="index_head_dim", dtype=dtype)
        self.weights_proj = Linear((D,), (heads,), ("embed", "index_heads"), dtype=dtype, rngs=rngs)
        self.gate = Linear((D,), (d,), ("embed", "index_head_dim"), dtype=dtype, rngs=rngs)
        self.ape = zeros((m, d), dtype, ("compress_window", "index_head_dim"))
        self.pool, self.topk, self.tail = m, cfg.index_topk, cfg.index_kpool_always_select_tail
        self.score_scale = cfg.index_n_heads**-0.5 * d**-0.5

    def projections(self) -> tuple[Linear, ...]:
        """The projections of the layer input that run with MLA's."""
        return (self.wk, self.gate)

    def update(
        self,
        x: jax.Array,
        q_lat: jax.Array,
        projected: list,
        ctx: Glm5NextContext,
        index: tuple[LayerPages, KeyPages],
        slots,
    ) -> tuple[tuple[LayerPages, KeyPages], jax.Array | None]:
        """Pool every pool a token of the step completes, keep the step's rows for the open pools ->
        ((ring, pool keys), in a sparse step the key positions [T, width] each query attends)."""
        ring, keys = index
        m, d = self.pool, self.ape.shape[-1]
        k = self.k_norm(projected[0])
        rows = jnp.concatenate([k.astype(F32), projected[1].astype(F32)], axis=-1)  # [T, 2 d]
        T, B = ctx.positions.shape[0], ctx.meta.page_table.shape[0]
        complete = (ctx.meta.seq_ids >= 0) & (ctx.positions % m == m - 1)
        n = min(T, T // m + B)
        (at,) = jnp.nonzero(complete, size=n, fill_value=0)
        done = ctx.take(at, jnp.arange(n) < jnp.sum(complete))
        source = (done.positions // m * m)[:, None] + jnp.arange(m, dtype=jnp.int32)[None, :]
        got = done.gather_rows(source, rows, ring)  # [n, m, 2 d]
        weight = jax.nn.softmax(got[..., d:] + self.ape[...].astype(F32), axis=1).astype(k.dtype)
        pooled = jnp.sum(weight * got[..., :d].astype(k.dtype), axis=1, dtype=F32).astype(k.dtype)
        keys = keys.write(done.slots(done.positions // m, keys.page_size), pooled)
        ring = ring.write(ctx.ring_writes(ring.page_size), rows)
        return (ring, keys), self.select(x, q_lat, ctx, keys) if ctx.sparse else None

    def select(self, x: jax.Array, q_lat: jax.Array, ctx: Glm5NextContext, keys: KeyPages) -> jax.Array:
        """The key positions [T, width] each query attends (-1: none): the tokens of its best complete
        pools, then its open pool's."""
        m, p = self.pool, ctx.positions
        w = self.weights_proj(x).astype(F32) * self.score_scale
        q, pages, table, scale = keys.scored(self.wq_b(q_lat), ctx.meta.page_table)
        last = (p + 1) // m - 1  # the query's last complete pool
        logits = ops.indexer_logits_paged(q, w, pages, table, ctx.meta.seq_ids, last, k_scale=scale)
        chosen = ops.topk_indices(logits, min(self.topk // m, logits.shape[1]))  # pool ids, -1: none
        offsets = jnp.arange(m, dtype=jnp.int32)
        tokens = jnp.where(chosen[..., None] >= 0, chosen[..., None] * m + offsets, -1).reshape(
            p.shape[0], -1
        )
        parts = [tokens, jnp.full((p.shape[0], self.topk - tokens.shape[1]), -1, jnp.int32)]
        if self.tail:
            count = (p + 1) % m
            tail = (p + 1 - count)[:, None] + offsets[None, : m - 1]
            parts.append(jnp.where(offsets[None, : m - 1] < count[:, None], tail, -1))
        return jnp.concatenate(parts, axis=-1)
