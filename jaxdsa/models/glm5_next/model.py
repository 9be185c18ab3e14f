"""The GLM-5.3-Flash decoder as Flax NNX modules (docs/models.md §9.2).

``Glm5NextModel(tokens, positions, cache, meta, sparse=..., absorbed=...) -> (streams [T, n, D], cache)``
runs embedding -> ``hc_mult`` streams -> blocks; :meth:`Glm5NextModel.logits` collapses the streams by
their plain mean, then the final norm and the head. A block is DeepSeek-V4's two hyper-connection sites
(:mod:`jaxdsa.models.deepseek_v4.hyper`) around a KDA layer (:mod:`.kda`) or a NoPE MLA layer with the
pooled indexer (:class:`~jaxdsa.layers.mla.MLAttention` with no RoPE part, :mod:`.indexer`), and around
a dense MLP or the MoE, both with V4's SwiGLU clamp. Layers of one kind are stacked and scanned
(:mod:`jaxdsa.models.layer_groups`); each writes its cache rows at its index among the layers that
keep that entry (KDA layers, DSA layers, full-indexer layers). A shared-indexer DSA layer attends the
lists of the full layer before it, carried through the scan.

Static switches (:class:`~jaxdsa.models.dsa.family.DsaMode`): ``sparse`` once some query sees more
complete pools than it selects (dense causal attention before that); ``absorbed`` latent-space
attention, or the expanded form for single-sequence prefill.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxdsa.cache import Cache, LayerPages, StepMeta
from jaxdsa.layers.indexer import KeyPages
from jaxdsa.layers.linear import Embed, Linear
from jaxdsa.layers.mla import LatentPages, MLAttention
from jaxdsa.layers.mlp import mlp_partials
from jaxdsa.layers.norms import RMSNorm
from jaxdsa.models.deepseek_v4.hyper import HyperSite, expand, site_out
from jaxdsa.models.dsa.model import moe_or_mlp, padded
from jaxdsa.models.glm5_next.config import Glm5NextConfig
from jaxdsa.models.glm5_next.context import Glm5NextContext
from jaxdsa.models.glm5_next.indexer import PooledIndexer
from jaxdsa.models.glm5_next.kda import KdaAttention
from jaxdsa.models.layer_groups import build_groups, take_layer
from jaxdsa.sharding import Parallelism, reduce_partials


class Block(nnx.Module):
    """HC site -> RMSNorm -> KDA or MLA, HC site -> RMSNorm -> MLP or MoE, on the streams."""

    def __init__(
        self, cfg: Glm5NextConfig, layer: int, *, heads: int, index_heads: int, dtype, rngs: nnx.Rngs
    ):
        D, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.hc_attn = HyperSite(cfg)
        self.input_norm = RMSNorm(D, eps, dtype=dtype)
        if cfg.is_kda_layer(layer):
            self.attn = KdaAttention(cfg, dtype=dtype, rngs=rngs)
        else:
            indexer = None
            if cfg.has_indexer(layer):
                indexer = PooledIndexer(cfg, heads=index_heads, dtype=dtype, rngs=rngs)
            self.attn = MLAttention(
                hidden=D,
                heads=heads,
                q_lora=cfg.q_lora_rank,
                kv_lora=cfg.kv_lora_rank,
                nope=cfg.qk_nope_head_dim,
                rope=0,
                v=cfg.v_head_dim,
                softmax_scale=cfg.softmax_scale,
                latent_norm_eps=eps,
                indexer=indexer,
                dtype=dtype,
                rngs=rngs,
            )
        self.hc_ffn = HyperSite(cfg)
        self.post_attn_norm = RMSNorm(D, eps, dtype=dtype)
        self.mlp = moe_or_mlp(cfg, layer, dtype=dtype, rngs=rngs, swiglu_limit=cfg.swiglu_limit)

    def __call__(self, x: jax.Array, ctx: Glm5NextContext, cache: Cache, rows: tuple, topk):
        """Streams [T, n, D] -> (streams, cache, the index lists a shared layer after this one reads).
        ``rows``: this layer's row among the KDA, the DSA and the full-indexer layers."""
        kda_row, dsa_row, index_row = rows
        h, post, comb = self.hc_attn(x)
        h = self.input_norm(h)
        if isinstance(self.attn, KdaAttention):
            a, cache = self.attn(h, ctx, cache, kda_row)
        else:
            index = None
            if self.attn.indexer is not None:
                keys = KeyPages(LayerPages(cache["index_keys"], index_row))
                index = (LayerPages(cache["index_ring"], index_row), keys)
            a, latent, index, lists = self.attn(h, ctx, LatentPages.of(cache, dsa_row), index, topk)
            cache = cache | latent.entries()
            if index is not None:
                cache = cache | {"index_ring": index[0].stacked} | index[1].entries()
                topk = lists
        x = site_out(x, a.astype(x.dtype), post, comb)
        h, post, comb = self.hc_ffn(x)
        f = reduce_partials(mlp_partials(self.mlp, self.post_attn_norm(h), ctx.meta.seq_ids >= 0))
        return site_out(x, f.astype(x.dtype), post, comb), cache, topk


def kind_rows(flags: list[bool]) -> tuple[int, ...]:
    """Each layer's row among the layers whose flag is set (0 for the others: never read)."""
    return tuple(sum(flags[:i]) if flag else 0 for i, flag in enumerate(flags))


class Glm5NextModel(nnx.Module):
    """Embedding, scanned blocks, the streams' mean, final norm and head.

    ``parallelism``: MLA and indexer heads are zero-padded to split evenly over its TP shards; KDA
    heads are split as they are (the family refuses a tp they do not divide).
    ``scan_layers=False``: one module per layer, run unrolled (compile time grows with depth).
    """

    def __init__(
        self,
        cfg: Glm5NextConfig,
        *,
        dtype,
        rngs: nnx.Rngs,
        parallelism: Parallelism | None = None,
        scan_layers: bool = True,
    ):
        tp = parallelism.shards("heads") if parallelism else 1
        heads = dict(heads=padded(cfg.num_attention_heads, tp), index_heads=padded(cfg.index_n_heads, tp))
        make_layer = lambda layer, rngs: Block(cfg, layer, **heads, dtype=dtype, rngs=rngs)  # noqa: E731
        L = cfg.num_hidden_layers
        kinds = [(cfg.layer_types[i], cfg.is_moe_layer(i), cfg.has_indexer(i)) for i in range(L)]
        self.embed = Embed(cfg.vocab_size, cfg.hidden_size, dtype=dtype, rngs=rngs)
        self.groups = build_groups(kinds, make_layer, rngs, scan=scan_layers)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        self.lm_head = Linear(
            (cfg.hidden_size,),
            (cfg.vocab_size,),
            ("embed", "vocab"),
            dtype=dtype,
            out_dtype=jnp.float32,
            rngs=rngs,
        )
        self.cfg = cfg.architecture()  # static in the graph: checkpoints of one architecture share compiles
        self.rows = tuple(
            zip(
                kind_rows([cfg.is_kda_layer(i) for i in range(L)]),
                kind_rows([not cfg.is_kda_layer(i) for i in range(L)]),
                kind_rows([cfg.has_indexer(i) for i in range(L)]),
            )
        )

    def __call__(self, tokens, positions, cache: Cache, meta: StepMeta, *, sparse: bool, absorbed: bool):
        """Run every block -> (the final streams [T, n, D] of every token, the new cache)."""
        ctx = Glm5NextContext.build(positions, meta, sparse=sparse, absorbed=absorbed)
        rows = jnp.asarray(self.rows, jnp.int32)

        def run_layer(layer, carry, i):
            x, cache, topk = carry
            return layer(x, ctx, cache, tuple(rows[i]), topk)

        lists = jnp.full((tokens.shape[0], self.cfg.index_width), -1, jnp.int32) if sparse else None
        carry = (expand(self.embed(tokens), self.cfg.hc_mult), cache, lists)
        for group in self.groups:
            carry = group(carry, run_layer)
        x, cache, _ = carry
        return x, cache

    def logits(self, x: jax.Array) -> jax.Array:
        """Float32 logits [R, vocab] of final streams [R, n, D]: their mean (HF's ``Glm5NextTextHyperHead``),
        the final norm, the head."""
        mean = jnp.mean(x.astype(jnp.float32), axis=1).astype(x.dtype)
        return self.lm_head(self.norm(mean))

    def layer(self, i: int) -> Block:
        """Block ``i`` as a module of its own (taken out of its stack): a notebook can read it, call
        it, or replace its submodules, and the model runs with the change."""
        if not 0 <= i < self.cfg.num_hidden_layers:
            raise IndexError(f"layer {i} out of range (the model has {self.cfg.num_hidden_layers})")
        self.groups, layer = take_layer(self.groups, i)
        return layer
