"""The GLM-5.x / DeepSeek-V3.2 decoder as a pure step over a packed batch and a paged cache.

``step(params, tokens, positions, cache, meta, *, cfg, sparse, absorbed) -> (logits, cache)``

Static switches chosen by the caller from host-side lengths:
- ``sparse``: run the indexer + top-k and attend to the selected keys. When every query's
  context is no longer than ``index_topk`` the indexer selects everything, so callers pass
  ``sparse=False`` (dense causal attention; index keys are still written for later steps).
- ``absorbed``: latent-space attention (decode, and any step with several sequences) versus the
  naive expanded form (single-sequence prefill: ``page_table`` has one row).

Params (see :mod:`checkpoints.names` for the HF mapping): ``embed [V,D]``, ``norm [D]``,
``lm_head [D,V]`` and ``layers``: a list of dicts with ``input_norm``, ``post_attn_norm``,
``attn`` (MLA + optional ``indexer``) and either ``mlp`` (dense) or ``moe``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxdsa import ops, sharding
from jaxdsa.cache import KVCache, StepMeta, slots_for, write_rows
from jaxdsa.config import ModelConfig
from jaxdsa.layers import indexer, mla
from jaxdsa.layers.mlp import moe, swiglu
from jaxdsa.layers.norms import rms_norm
from jaxdsa.layers.rope import cos_sin


def _key_positions(meta: StepMeta, page_size: int) -> jax.Array:
    """Logical key positions 0 .. M*page-1 that a sequence's page-table row can address."""
    return jnp.arange(meta.page_table.shape[1] * page_size, dtype=jnp.int32)


def attention(
    p: dict,
    x: jax.Array,
    positions: jax.Array,
    rope: tuple[jax.Array, jax.Array],
    latent_pages: jax.Array,
    index_pages: jax.Array | None,
    meta: StepMeta,
    prev_topk: jax.Array | None,
    *,
    cfg: ModelConfig,
    sparse: bool,
    absorbed: bool,
):
    """One MLA + DSA attention block. -> (out [T,D], latent_pages, index_pages, topk positions)."""
    cos, sin = rope
    page_size = latent_pages.shape[1]
    slots = slots_for(meta.page_table, meta.seq_ids, positions, page_size)

    q_nope, q_pe, q_lat = mla.queries(p, x, cfg, cos, sin)
    latent_pages = write_rows(latent_pages, slots, mla.latent_rows(p, x, cfg, cos, sin))
    if "indexer" in p:
        index_pages = write_rows(index_pages, slots, indexer.keys(p["indexer"], x, cfg, cos, sin))

    topk = None
    if sparse:
        if "indexer" in p:
            qi, wi = indexer.queries(p["indexer"], x, q_lat, cfg, cos, sin)
            logits = ops.indexer_logits_paged(qi, wi, index_pages, meta.page_table, meta.seq_ids, positions)
            topk = ops.topk_indices(logits, cfg.index_topk)  # [T, K] key positions, -1 = none
        else:
            if prev_topk is None:
                raise ValueError("a shared-indexer layer needs an earlier full layer's top-k")
            topk = prev_topk

    rows = latent_pages.reshape(-1, latent_pages.shape[-1])
    if absorbed:
        if sparse:
            indices = slots_for(meta.page_table, meta.seq_ids[:, None], topk, page_size)
        else:
            keys = _key_positions(meta, page_size)[None, :]
            causal = jnp.where(keys <= positions[:, None], keys, -1)
            indices = slots_for(meta.page_table, meta.seq_ids[:, None], causal, page_size)
        o = mla.absorbed_attention(p, q_nope, q_pe, rows, indices, cfg)
    else:
        if meta.page_table.shape[0] != 1:
            raise ValueError("the naive MLA form runs single-sequence steps (page_table with one row)")
        keys = _key_positions(meta, page_size)
        key_slots = slots_for(meta.page_table, jnp.zeros_like(keys), keys, page_size)
        mask = (keys[None, :] <= positions[:, None]) & (meta.seq_ids[:, None] >= 0)
        if sparse:
            selected = (
                jnp.zeros(mask.shape, bool)
                .at[jnp.arange(mask.shape[0])[:, None], topk]
                .set(True, mode="drop")
            )
            mask &= selected
        o = mla.naive_attention(p, q_nope, q_pe, rows[key_slots], mask, cfg)
    return mla.output(p, o), latent_pages, index_pages, topk


def decoder_layer(
    lp: dict, h, positions, rope, latent_pages, index_pages, meta, prev_topk, *, cfg, sparse, absorbed
):
    x = rms_norm(h, lp["input_norm"], cfg.rms_norm_eps)
    a, latent_pages, index_pages, topk = attention(
        lp["attn"],
        x,
        positions,
        rope,
        latent_pages,
        index_pages,
        meta,
        prev_topk,
        cfg=cfg,
        sparse=sparse,
        absorbed=absorbed,
    )
    h = h + a
    x = rms_norm(h, lp["post_attn_norm"], cfg.rms_norm_eps)
    h = h + (moe(lp["moe"], x, cfg) if "moe" in lp else swiglu(lp["mlp"], x))
    return sharding.constrain(h, ("batch", "embed")), latent_pages, index_pages, topk


def forward(
    params: dict,
    tokens,
    positions,
    cache: KVCache,
    meta: StepMeta,
    *,
    cfg: ModelConfig,
    sparse: bool,
    absorbed: bool,
):
    """Run all decoder layers. -> (final-normed hidden [R, D] at meta.logits_indices, new cache)."""
    rope = cos_sin(positions, cfg.rope, cfg.qk_rope_head_dim)
    h = sharding.embed_lookup(params["embed"], tokens)
    latent, index = list(cache.latent), list(cache.index_keys)
    topk = None
    for i, lp in enumerate(params["layers"]):
        h, latent[i], index[i], topk = decoder_layer(
            lp, h, positions, rope, latent[i], index[i], meta, topk, cfg=cfg, sparse=sparse, absorbed=absorbed
        )
    hidden = rms_norm(h[meta.logits_indices], params["norm"], cfg.rms_norm_eps)
    return hidden, KVCache(latent=tuple(latent), index_keys=tuple(index))


def lm_head(params: dict, hidden: jax.Array) -> jax.Array:
    return jnp.matmul(hidden, params["lm_head"], preferred_element_type=jnp.float32)


def step(
    params: dict,
    tokens,
    positions,
    cache: KVCache,
    meta: StepMeta,
    *,
    cfg: ModelConfig,
    sparse: bool,
    absorbed: bool,
):
    """The model step: logits [R, vocab] float32 at ``meta.logits_indices`` and the updated cache."""
    hidden, cache = forward(params, tokens, positions, cache, meta, cfg=cfg, sparse=sparse, absorbed=absorbed)
    return lm_head(params, hidden), cache


def mtp_step(
    params: dict, hidden, next_tokens, positions, cache: KVCache, meta: StepMeta, *, cfg, sparse, absorbed
):
    """The next-n (MTP) layer: predict token t+2 from the main model's final hidden at t and token t+1.

    e = enorm(E[x_{t+1}]), g = hnorm(h_t), u = eh_proj [e ; g] (embedding first, as vLLM), one full
    decoder block with its own cache, then shared_head.norm and the shared lm_head (models.md §2.12).
    ``hidden`` [T, D] is the main model's post-final-norm hidden state of the same tokens.
    """
    mp = params["mtp"][0]
    rope = cos_sin(positions, cfg.rope, cfg.qk_rope_head_dim)
    e = rms_norm(sharding.embed_lookup(params["embed"], next_tokens), mp["enorm"], cfg.rms_norm_eps)
    g = rms_norm(hidden.astype(e.dtype), mp["hnorm"], cfg.rms_norm_eps)
    u = jnp.concatenate([e, g], axis=-1) @ mp["eh_proj"]
    u, latent, index, _ = decoder_layer(
        mp,
        u,
        positions,
        rope,
        cache.latent[0],
        cache.index_keys[0],
        meta,
        None,
        cfg=cfg,
        sparse=sparse,
        absorbed=absorbed,
    )
    out = rms_norm(u[meta.logits_indices], mp["shared_head_norm"], cfg.rms_norm_eps)
    return lm_head(params, out), KVCache(latent=(latent,), index_keys=(index,))


@functools.cache
def jitted_step(cfg: ModelConfig, sparse: bool, absorbed: bool, mesh=None):
    """The jitted step for one (cfg, mode[, mesh]); the cache argument is donated.

    On a mesh the step runs per data-parallel group (:func:`jaxdsa.sharding.data_parallel`):
    tokens, positions, cache pages and metadata are split over ``dp`` with group-local indices.
    """
    return sharding.jit_step(
        functools.partial(step, cfg=cfg, sparse=sparse, absorbed=absorbed), mesh, donate_argnums=(3,)
    )
