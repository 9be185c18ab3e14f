"""The DSA lightning indexer: per-token index keys and per-query weighted ReLU scores, top-k.

I(p, t) = sum_h w_h * relu(d^-1/2 * qI_h . kI_t), w = weights_proj(x) * n^-1/2 (docs/models.md §2.7).
Both positive scales are folded into w, so the score kernels compute sum_h w_h relu(q_h . k).
RoPE goes on the *first* rope-dim channels, interleaved (GLM) or half-split (DeepSeek-V3.2).

With an FP8 cache the keys are stored as the released engines keep them (docs/models.md §5.8):
rotated by the normalized Hadamard matrix, then e4m3 with one float32 scale per key
(:mod:`pallas_kernels.quant.kv_fp8`). The queries get the same rotation and stay in the model's
dtype, so the scores are the plain formula's up to the keys' rounding.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from jaxdsa import ops
from jaxdsa.cache import Cache, LayerPages, kv_fp8
from jaxdsa.layers.context import StepContext
from jaxdsa.layers.linear import Linear
from jaxdsa.layers.norms import LayerNorm
from jaxdsa.layers.rope import apply_rope


@dataclasses.dataclass
class KeyPages:
    """One layer's index keys in the cache: the key rows and, for FP8 keys, their scales (one
    float32 per key, ``[L, P, page, 1]``); None for keys in the model's dtype."""

    keys: LayerPages
    scales: LayerPages | None = None

    @classmethod
    def of(cls, cache: Cache, layer) -> KeyPages:
        scales = LayerPages(cache["index_scales"], layer) if "index_scales" in cache else None
        return cls(LayerPages(cache["index_keys"], layer), scales)

    @property
    def page_size(self) -> int:
        return self.keys.page_size

    def write(self, slots: jax.Array, keys: jax.Array) -> KeyPages:
        """Store ``keys [T, D]`` at ``slots`` (-1 dropped): as they are, or rotated and quantized."""
        if self.scales is None:
            return KeyPages(self.keys.write(slots, keys))
        values, scales = kv_fp8.quantize_keys(kv_fp8.hadamard_rotate(keys))
        return KeyPages(self.keys.write(slots, values), self.scales.write(slots, scales[:, None]))

    def scored(
        self, q: jax.Array, page_table: jax.Array
    ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array | None]:
        """What :func:`jaxdsa.ops.indexer_logits_paged` reads for queries ``q [T, n, D]``: (queries,
        rotated like the keys when FP8; every layer's key pages; ``page_table`` moved into this
        layer; the keys' float32 scales ``[L*P, page]`` or None)."""
        pages, table = self.keys.pages(page_table)
        if self.scales is None:
            return q, pages, table, None
        return kv_fp8.hadamard_rotate(q), pages, table, self.scales.pages(page_table)[0][..., 0]

    def entries(self) -> Cache:
        """The cache entries these pages update."""
        out = {"index_keys": self.keys.stacked}
        return out | ({"index_scales": self.scales.stacked} if self.scales is not None else {})


class Indexer(nnx.Module):
    """``heads`` may include zero-padded heads (a multiple of the TP shards); ``score_scale`` is
    n^-1/2 d^-1/2 of the real model."""

    def __init__(
        self,
        *,
        hidden: int,
        q_lora: int,
        heads: int,
        head_dim: int,
        rope_dim: int,
        interleaved: bool,
        topk: int,
        score_scale: float,
        k_norm_eps: float,
        dtype,
        rngs: nnx.Rngs,
    ):
        self.wq_b = Linear(
            (q_lora,), (heads, head_dim), ("q_lora", "index_heads", "index_head_dim"), dtype=dtype, rngs=rngs
        )
        self.wk = Linear((hidden,), (head_dim,), ("embed", "index_head_dim"), dtype=dtype, rngs=rngs)
        self.k_norm = LayerNorm(head_dim, k_norm_eps, axis="index_head_dim", dtype=dtype)
        self.weights_proj = Linear(
            (hidden,),
            (heads,),
            ("embed", "index_heads"),
            dtype=jnp.float32,
            compute_dtype=jnp.float32,
            rngs=rngs,
        )
        self.rope_dim, self.interleaved = rope_dim, interleaved
        self.topk, self.score_scale = topk, score_scale

    def _rope_front(self, x: jax.Array, cos, sin) -> jax.Array:
        r = self.rope_dim
        rot = apply_rope(x[..., :r], cos, sin, interleaved=self.interleaved)
        return jnp.concatenate([rot, x[..., r:]], axis=-1)

    def keys(self, wk_x: jax.Array, cos, sin) -> jax.Array:
        """Index keys [T, index_head_dim] from the tokens' ``wk`` projection: LayerNorm, roped; cached
        per token. The caller projects (``wk`` takes the layer input, as MLA's ``q_a`` and ``kv_a``
        do, so the three share one kernel launch: :func:`jaxdsa.layers.linear.project`)."""
        return self._rope_front(self.k_norm(wk_x), cos, sin)

    def queries(self, x: jax.Array, q_lat: jax.Array, cos, sin) -> tuple[jax.Array, jax.Array]:
        """-> index queries [T, n, d] and float32 head weights [T, n] with both scales folded in."""
        return self._rope_front(self.wq_b(q_lat), cos, sin), self.weights_proj(x) * self.score_scale

    def projections(self) -> tuple[Linear, ...]:
        """The projections of the layer input that run with MLA's (one launch where quantized alike)."""
        return (self.wk,)

    def update(
        self, x: jax.Array, q_lat: jax.Array, projected: list, ctx: StepContext, keys: KeyPages, slots
    ) -> tuple[KeyPages, jax.Array | None]:
        """Write the step's keys (from ``projected``: :meth:`projections` of ``x``) at ``slots``, then, in a
        sparse step, select -> (keys, top-k key positions [T, topk] or None)."""
        keys = keys.write(slots, self.keys(projected[0], ctx.cos, ctx.sin))
        return keys, self.select(x, q_lat, ctx, keys) if ctx.sparse else None

    def select(self, x: jax.Array, q_lat: jax.Array, ctx: StepContext, keys: KeyPages) -> jax.Array:
        """Top-k key positions [T, topk] of each query over its sequence's cached keys (-1 = none)."""
        q, w = self.queries(x, q_lat, ctx.cos, ctx.sin)
        q, pages, table, scale = keys.scored(q, ctx.meta.page_table)
        logits = ops.indexer_logits_paged(q, w, pages, table, ctx.meta.seq_ids, ctx.positions, k_scale=scale)
        return ops.topk_indices(logits, self.topk)
