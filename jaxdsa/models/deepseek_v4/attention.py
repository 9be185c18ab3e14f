"""V4 attention (models.md §3.3-§3.8): one shared K = V head, a sliding window and compressed entries.

Per query at position p the keys are the window's tokens ``(p - W, p]`` and, on compressed
layers, compressed entries: the indexer's top-k (CSA) or all complete ones (HCA). Each key subset
is attended separately through :func:`jaxdsa.ops.sparse_mla` (the value is the whole 512-wide key
row), and :func:`jaxdsa.ops.merge_states` joins the subsets' normalized outputs by their
log-sum-exps with the per-head sink in the denominator, once:

    o = (e^{L_win} o_win + e^{L_cmp} o_cmp) / (e^{L_win} + e^{L_cmp} + e^{sink})

which is the single softmax over window + compressed keys + sink that HF computes. The output's
rotary dims are rotated back at the query position, then the grouped low-rank projection
(``wo_a`` per group of heads, ``wo_b`` over the concatenation) maps to the hidden size.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxdsa import ops
from jaxdsa.layers.norms import rms_norm
from jaxdsa.models.deepseek_v4 import compressor, indexer
from jaxdsa.models.deepseek_v4.config import CSA, SWA, V4Config
from jaxdsa.models.deepseek_v4.rotary import layer_rope_tables, rotate_tail


def queries(p: dict, x: jax.Array, cos: jax.Array, sin: jax.Array, cfg: V4Config):
    """-> (q [T, H, d]: per-head RMS-normalized (no weight) and roped, q latent [T, q_lora])."""
    q_lat = rms_norm(jnp.matmul(x, p["wq_a"], precision="highest"), p["q_norm"], cfg.rms_norm_eps)
    q = jnp.einsum("tr,rhd->thd", q_lat, p["wq_b"], precision="highest")
    q32 = q.astype(jnp.float32)
    q = (q32 * jax.lax.rsqrt(jnp.mean(q32 * q32, axis=-1, keepdims=True) + cfg.rms_norm_eps)).astype(q.dtype)
    return rotate_tail(q, cos, sin), q_lat


def window_keys(p: dict, x: jax.Array, cos: jax.Array, sin: jax.Array, cfg: V4Config) -> jax.Array:
    """The shared K = V row of each token [T, d]: RMSNorm(x wkv), rotary dims roped."""
    kv = rms_norm(jnp.matmul(x, p["wkv"], precision="highest"), p["kv_norm"], cfg.rms_norm_eps)
    return rotate_tail(kv, cos, sin)


def window_positions(positions: jax.Array, window: int) -> jax.Array:
    """[T, W] key positions ``p - W + 1 .. p`` of each query's window; -1 before position 0."""
    keys = positions[:, None] - (window - 1) + jnp.arange(window, dtype=jnp.int32)[None, :]
    return jnp.where(keys >= 0, keys, -1)


def complete_entries(positions: jax.Array, n_entries: int, ratio: int) -> jax.Array:
    """[T, E] every compressed entry a query may see (HCA): j < (p + 1) // m, else -1."""
    j = jnp.arange(n_entries, dtype=jnp.int32)[None, :]
    return jnp.where(j < ((positions + 1) // ratio)[:, None], j, -1)


def output(p: dict, o: jax.Array, cos: jax.Array, sin: jax.Array, cfg: V4Config) -> jax.Array:
    """Undo the value rows' RoPE at the query position, then the grouped low-rank projection."""
    o = rotate_tail(o, cos, sin, inverse=True)
    t, g = o.shape[0], cfg.o_groups
    z = jnp.einsum("tgi,gir->tgr", o.reshape(t, g, -1), p["wo_a"], precision="highest")
    return jnp.matmul(z.reshape(t, -1), p["wo_b"], precision="highest")


def attention_sequence(p: dict, x: jax.Array, cfg: V4Config, layer: int) -> jax.Array:
    """Attention of a whole sequence starting at position 0 (no cache): [T, D] -> [T, D]."""
    positions = jnp.arange(x.shape[0], dtype=jnp.int32)
    cos, sin = layer_rope_tables(cfg, layer, positions)
    q, q_lat = queries(p, x, cos, sin, cfg)
    kv = window_keys(p, x, cos, sin, cfg)
    scale, d = cfg.softmax_scale, cfg.head_dim
    # Window keys are the token rows themselves: key position == row.
    parts = [ops.sparse_mla(q, kv, window_positions(positions, cfg.sliding_window), sm_scale=scale, v_dim=d)]
    kind, ratio = cfg.layer_type(layer), cfg.compress_ratio(layer)
    if kind != SWA and x.shape[0] >= ratio:
        entries = compressor.compress_sequence(p["compressor"], x, cfg)
        if kind == CSA:
            picked = indexer.select_for_sequence(p["indexer"], x, q_lat, cfg, ratio)
        else:
            picked = complete_entries(positions, entries.shape[0], ratio)
        parts.append(ops.sparse_mla(q, entries, picked, sm_scale=scale, v_dim=d))
    outs, lses = zip(*parts)
    o, _ = ops.merge_states(jnp.stack(outs), jnp.stack(lses), sink=p["sink"])
    return output(p, o, cos, sin, cfg)
