"""The CSA lightning indexer (docs/models.md §3.5, §8.10 as HF computes it: no Hadamard, no FP4 simulation).

It scores its own compressed keys (an overlapping compressor of width ``index_head_dim``) against
per-head queries from the attention's q latent: ``I(p, j) = sum_h w_h relu(q_h . K_j)`` with
``w = weights_proj(x) * index_head_dim^-0.5 * index_n_heads^-0.5``, over the entries complete at
position p, and keeps the top ``index_topk``; -1 marks empty picks.

Key j is row j of the sequence's key pages (one row per m tokens, :mod:`.compressor`), so the
paged indexer op scores the keys ``j <= (p + 1) // m - 1`` (the complete ones) and the selection is
returned as entry indices, which address the compressed entries the same way. With an FP8 cache the
keys are kept as the engines' FP8 variant (132 bytes a key at the released 128: Hadamard-rotated
e4m3 and a float32 scale, :class:`~jaxdsa.layers.indexer.KeyPages`), not DeepSeek's MXFP4 one.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxdsa import ops
from jaxdsa.cache import LayerPages
from jaxdsa.layers.indexer import KeyPages
from jaxdsa.layers.linear import Linear
from jaxdsa.models.deepseek_v4.compressor import Compressor
from jaxdsa.models.deepseek_v4.config import V4Config
from jaxdsa.models.deepseek_v4.context import V4Context
from jaxdsa.models.deepseek_v4.rotary import rotate_tail


class Indexer(nnx.Module):
    def __init__(self, cfg: V4Config, ratio: int, *, dtype, rngs: nnx.Rngs):
        n, d = cfg.index_n_heads, cfg.index_head_dim
        self.wq_b = Linear(
            (cfg.q_lora_rank,), (n, d), ("q_lora", "index_heads", "index_head_dim"), dtype=dtype, rngs=rngs
        )
        self.weights_proj = Linear(
            (cfg.hidden_size,),
            (n,),
            ("embed", "index_heads"),
            dtype=dtype,
            rngs=rngs,
            compute_dtype=jnp.float32,
        )
        self.compressor = Compressor(
            cfg.hidden_size,
            d,
            ratio,
            overlap=True,
            rope=cfg.compress_rope,
            rope_dims=cfg.qk_rope_head_dim,
            eps=cfg.rms_norm_eps,
            width_axis="index_head_dim",
            dtype=dtype,
            rngs=rngs,
        )
        self.scale = d**-0.5 * n**-0.5
        self.ratio, self.topk = ratio, cfg.index_topk

    def __call__(
        self, x: jax.Array, q_lat: jax.Array, ctx: V4Context, state: LayerPages, keys: KeyPages
    ) -> tuple[jax.Array, LayerPages, KeyPages]:
        """-> (selected entries [T, K] int32, -1 = none; the indexer's state ring and key pages;
        FP8 keys are rotated and quantized as written, the queries rotated alike)."""
        state, keys = self.compressor(x, ctx, state, keys)
        q = rotate_tail(self.wq_b(q_lat), *ctx.compress)
        w = self.weights_proj(x) * self.scale
        q, k_pages, table, k_scale = keys.scored(q, ctx.meta.page_table)
        last = (ctx.positions + 1) // self.ratio - 1  # the last complete key
        logits = ops.indexer_logits_paged(q, w, k_pages, table, ctx.meta.seq_ids, last, k_scale=k_scale)
        k = max(1, min(self.topk, logits.shape[1]))
        return ops.topk_indices(logits, k), state, keys
