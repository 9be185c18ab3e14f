"""The DSA lightning indexer: per-token index keys and per-query weighted ReLU scores.

I(p, t) = sum_h w_h * relu(d^-1/2 * qI_h . kI_t), w = weights_proj(x) * n^-1/2 (models.md §2.7).
Both positive scales are folded into w, so the score kernels compute sum_h w_h relu(q_h . k).
RoPE goes on the *first* rope-dim channels, interleaved (GLM) or half-split (DeepSeek-V3.2).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxdsa.config import INDEXER_K_NORM_EPS, ModelConfig
from jaxdsa.layers.norms import layer_norm
from jaxdsa.layers.rope import apply_rope


def _rope_front(x: jax.Array, cfg: ModelConfig, cos, sin) -> jax.Array:
    r = cfg.qk_rope_head_dim
    rot = apply_rope(x[..., :r], cos, sin, interleaved=cfg.indexer_rope_interleave)
    return jnp.concatenate([rot, x[..., r:]], axis=-1)


def keys(p: dict, x: jax.Array, cfg: ModelConfig, cos, sin) -> jax.Array:
    """Index keys [T, index_head_dim]: LayerNorm(wk x), roped; cached per token."""
    k = layer_norm(x @ p["wk"], p["k_norm_w"], p["k_norm_b"], INDEXER_K_NORM_EPS)
    return _rope_front(k, cfg, cos, sin)


def queries(p: dict, x: jax.Array, q_lat: jax.Array, cfg: ModelConfig, cos, sin):
    """-> index queries [T, n, d] and float32 head weights [T, n] with both scales folded in."""
    q = jnp.einsum("tr,rhd->thd", q_lat, p["wq_b"])
    w = x.astype(jnp.float32) @ p["weights_proj"].astype(jnp.float32)
    w = w * (cfg.index_n_heads**-0.5 * cfg.index_head_dim**-0.5)
    return _rope_front(q, cfg, cos, sin), w
