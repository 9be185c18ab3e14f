"""The GLM-5.x / DeepSeek-V3.2 decoder as Flax NNX modules.

``DsaModel(tokens, positions, cache, meta, sparse=..., absorbed=...) -> (hidden, cache)`` runs one
step over a packed batch and the paged cache (every token's hidden state before the final norm);
:meth:`DsaModel.logits` applies the LM head. Layers
of one kind are stacked and scanned (:mod:`jaxdsa.models.layer_groups`), so compile time does not
grow with depth. Every layer writes its cache rows at its model-layer index: ``latent`` for every
layer, ``index_keys`` for the layers that run their own indexer (GLM-5.2's shared layers reuse the
top-k of the last full layer, carried through the scan).

Static switches chosen by the caller from host-side lengths (:class:`DsaMode`):
- ``sparse``: run the indexer + top-k and attend to the selected keys. When every query's
  context is no longer than ``index_topk`` the indexer selects everything, so callers pass
  ``sparse=False`` (dense causal attention; index keys are still written for later steps).
- ``absorbed``: latent-space attention (decode, and any step with several sequences) versus the
  naive expanded form (single-sequence prefill: ``page_table`` has one row).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
from flax import nnx

from jaxdsa import sharding
from jaxdsa.cache import Cache, StepMeta
from jaxdsa.layers.context import StepContext
from jaxdsa.layers.indexer import Indexer, KeyPages
from jaxdsa.layers.linear import Embed, Linear
from jaxdsa.layers.mla import LatentPages, MLAttention
from jaxdsa.layers.mlp import MLP, Experts, MoE, Router, mlp_partials
from jaxdsa.layers.norms import ResidualRMSNorm, RMSNorm, add_residual
from jaxdsa.layers.rope import cos_sin
from jaxdsa.models.dsa.config import HF_LATENT_NORM_EPS, INDEXER_K_NORM_EPS, DsaConfig
from jaxdsa.models.layer_groups import build_groups, take_layer
from jaxdsa.sharding import Parallelism

if TYPE_CHECKING:
    from jaxdsa.models.glm5_next.config import Glm5NextConfig


def padded(n: int, shards: int) -> int:
    """``n`` rounded up to a multiple of ``shards``: heads are zero-padded to split evenly (a zero
    head adds exactly nothing: its query and output rows are 0)."""
    return -(-n // shards) * shards


def moe_or_mlp(
    cfg: DsaConfig | Glm5NextConfig, layer: int, *, dtype, rngs: nnx.Rngs, swiglu_limit: float | None = None
) -> MoE | MLP:
    """Layer ``layer``'s feed-forward: the noaux_tc MoE (its shared experts as one MLP) on a MoE layer,
    else the dense MLP. GLM-5.3-Flash's blocks build theirs here too, so the two families' FFNs stay
    one design; ``swiglu_limit``: its clamp (:class:`~jaxdsa.layers.mlp.MLP`)."""
    D = cfg.hidden_size
    if not cfg.is_moe_layer(layer):
        return MLP(D, cfg.intermediate_size, dtype=dtype, rngs=rngs, swiglu_limit=swiglu_limit)
    E, N = cfg.n_routed_experts, cfg.moe_intermediate_size
    router = Router(
        D,
        E,
        top_k=cfg.num_experts_per_tok,
        n_group=cfg.n_group,
        topk_group=cfg.topk_group,
        norm_topk_prob=cfg.norm_topk_prob,
        scaling=cfg.routed_scaling_factor,
        rngs=rngs,
    )
    shared = MLP(D, N * cfg.n_shared_experts, dtype=dtype, rngs=rngs, swiglu_limit=swiglu_limit)
    return MoE(router, Experts(E, D, N, dtype=dtype, rngs=rngs, swiglu_limit=swiglu_limit), shared)


class DecoderLayer(nnx.Module):
    """Pre-norm MLA (+ indexer) and a dense MLP or the MoE, with residuals."""

    def __init__(
        self,
        cfg: DsaConfig,
        layer: int,
        *,
        heads: int,
        index_heads: int,
        dtype,
        rngs: nnx.Rngs,
        dense_kv_b: bool = True,
    ):
        D = cfg.hidden_size
        indexer = None
        if cfg.has_indexer(layer):
            indexer = Indexer(
                hidden=D,
                q_lora=cfg.q_lora_rank,
                heads=index_heads,
                head_dim=cfg.index_head_dim,
                rope_dim=cfg.qk_rope_head_dim,
                interleaved=cfg.indexer_rope_interleave,
                topk=cfg.index_topk,
                score_scale=cfg.index_n_heads**-0.5 * cfg.index_head_dim**-0.5,
                k_norm_eps=INDEXER_K_NORM_EPS,
                dtype=dtype,
                rngs=rngs,
            )
        self.input_norm = ResidualRMSNorm(D, cfg.rms_norm_eps, dtype=dtype)
        self.attn = MLAttention(
            hidden=D,
            heads=heads,
            q_lora=cfg.q_lora_rank,
            kv_lora=cfg.kv_lora_rank,
            nope=cfg.qk_nope_head_dim,
            rope=cfg.qk_rope_head_dim,
            v=cfg.v_head_dim,
            softmax_scale=cfg.softmax_scale,
            latent_norm_eps=HF_LATENT_NORM_EPS,
            indexer=indexer,
            dtype=dtype,
            rngs=rngs,
            dense_kv_b=dense_kv_b,
        )
        self.post_attn_norm = ResidualRMSNorm(D, cfg.rms_norm_eps, dtype=dtype)
        self.mlp = moe_or_mlp(cfg, layer, dtype=dtype, rngs=rngs)

    def __call__(self, stream: tuple, ctx: StepContext, cache: Cache, rows: tuple, topk):
        """-> (stream, cache, topk). ``stream`` = (h, delta): the residual stream is ``h + delta``, the
        last sublayer's output (float32, as its all-reduce leaves it) not added yet, so that the add
        runs in the next norm's kernel (:class:`ResidualRMSNorm`); the first layer gets a zero
        delta. The MLP's partial sums (the routed and shared experts') meet in one all-reduce
        (:func:`jaxdsa.sharding.reduce_partials`). ``rows`` = (latent row,
        index-key row) of this layer in the cache."""
        latent = LatentPages.of(cache, rows[0])
        index = KeyPages.of(cache, rows[1]) if self.attn.indexer is not None else None
        x, h = self.input_norm(*stream)
        a, latent, index, topk = self.attn(x, ctx, latent, index, topk)
        cache = cache | latent.entries() | (index.entries() if index else {})
        x, h = self.post_attn_norm(h, a)
        stream = (h, sharding.reduce_partials(mlp_partials(self.mlp, x, ctx.meta.seq_ids >= 0)))
        return tuple(sharding.constrain(v, ("batch", "embed")) for v in stream), cache, topk


class MtpLayer(nnx.Module):
    """The next-n layer: e = enorm(E[x_{t+1}]), g = hnorm(h_t), u = eh_proj [e ; g] (embedding first,
    as vLLM), one full decoder layer with its own cache, then shared_head.norm (docs/models.md §2.12).
    ``attention``: the decoder layer's head counts and ``dense_kv_b``."""

    def __init__(self, cfg: DsaConfig, layer: int, *, dtype, rngs: nnx.Rngs, **attention):
        D = cfg.hidden_size
        self.enorm = RMSNorm(D, cfg.rms_norm_eps, dtype=dtype)
        self.hnorm = RMSNorm(D, cfg.rms_norm_eps, dtype=dtype)
        self.eh_proj = Linear((2 * D,), (D,), ("embed_pair", "embed"), dtype=dtype, rngs=rngs)
        self.layer = DecoderLayer(cfg, layer, dtype=dtype, rngs=rngs, **attention)
        self.shared_head_norm = RMSNorm(D, cfg.rms_norm_eps, dtype=dtype)


class DsaModel(nnx.Module):
    """Embedding, scanned layer groups, final norm, LM head and (optionally) the MTP layers.

    ``parallelism``: attention and indexer heads are zero-padded to split evenly over its TP shards.
    ``scan_layers=False``: one module per layer, run unrolled (compile time grows with depth).
    """

    def __init__(
        self,
        cfg: DsaConfig,
        *,
        dtype,
        rngs: nnx.Rngs,
        parallelism: Parallelism | None = None,
        mtp: int = 0,
        scan_layers: bool = True,
    ):
        tp = parallelism.shards("heads") if parallelism else 1
        heads = dict(
            heads=padded(cfg.num_attention_heads, tp),
            index_heads=padded(cfg.index_n_heads, tp),
            # with dp attention every device holds every head's kv_b: it stays quantized there
            dense_kv_b=not (parallelism and parallelism.dp_attention),
        )
        make_layer = lambda layer, rngs: DecoderLayer(cfg, layer, **heads, dtype=dtype, rngs=rngs)
        kinds = [(cfg.is_moe_layer(i), cfg.has_indexer(i)) for i in range(cfg.num_hidden_layers)]
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
        layers = range(cfg.num_hidden_layers, cfg.num_hidden_layers + mtp)
        self.mtp = nnx.List([MtpLayer(cfg, i, **heads, dtype=dtype, rngs=rngs) for i in layers])
        self.cfg = cfg
        # cache row of each layer's index keys (-1: the layer reuses another layer's top-k)
        full = cfg.indexer_layers
        self.index_rows = tuple(full.index(i) if i in full else -1 for i in range(cfg.num_hidden_layers))

    def context(self, positions, meta: StepMeta, *, sparse: bool, absorbed: bool) -> StepContext:
        """What every layer of a step over these positions shares."""
        cos, sin = cos_sin(positions, self.cfg.rope, self.cfg.qk_rope_head_dim)
        return StepContext(positions, cos, sin, meta, sparse, absorbed)

    def __call__(self, tokens, positions, cache: Cache, meta: StepMeta, *, sparse: bool, absorbed: bool):
        """Run all decoder layers -> (hidden [T, D] of every token before the final norm, new cache)."""
        ctx = self.context(positions, meta, sparse=sparse, absorbed=absorbed)
        index_rows = jnp.asarray(self.index_rows, jnp.int32)

        def run_layer(layer, carry, i):
            stream, cache, topk = carry
            return layer(stream, ctx, cache, (i, index_rows[i]), topk)

        # the top-k of the last full indexer layer, read by shared layers (carried through the scans)
        topk = jnp.full((tokens.shape[0], self.cfg.index_topk), -1, jnp.int32) if sparse else None
        h = self.embed(tokens)
        carry = ((h, jnp.zeros(h.shape, jnp.float32)), cache, topk)
        for group in self.groups:
            carry = group(carry, run_layer)
        (h, delta), cache, _ = carry
        return add_residual(h, delta), cache

    def logits(self, hidden: jax.Array) -> jax.Array:
        """Float32 logits [R, vocab] of final hidden states."""
        return self.lm_head(hidden)

    def draft(
        self,
        hidden,
        next_tokens,
        positions,
        cache: Cache,
        meta: StepMeta,
        *,
        sparse: bool,
        absorbed: bool,
        layer: int = 0,
    ):
        """MTP layer ``layer``: logits for token t+2 from the main model's final-normed hidden state at t
        (or, drafting further, the MTP layer's own output there) and token t+1; ``cache`` is the MTP
        layers' own. -> (logits [R, V], the layer's output [R, D] (pre-norm), cache), both at
        meta.logits_indices."""
        mtp = self.mtp[layer]
        ctx = self.context(positions, meta, sparse=sparse, absorbed=absorbed)
        e = mtp.enorm(self.embed(next_tokens))
        g = mtp.hnorm(hidden.astype(e.dtype))
        u = mtp.eh_proj(jnp.concatenate([e, g], axis=-1))
        (u, delta), cache, _ = mtp.layer(
            (u, jnp.zeros(u.shape, jnp.float32)), ctx, cache, (layer, layer), None
        )
        u = add_residual(u, delta)[meta.logits_indices]
        return self.logits(mtp.shared_head_norm(u)), u, cache

    def layer(self, i: int) -> DecoderLayer:
        """Decoder layer ``i`` as a module of its own (taken out of its stack): a notebook can read it,
        call it, or replace its submodules, and the model runs with the change."""
        if not 0 <= i < self.cfg.num_hidden_layers:
            raise IndexError(f"layer {i} out of range (the model has {self.cfg.num_hidden_layers})")
        self.groups, layer = take_layer(self.groups, i)
        return layer
