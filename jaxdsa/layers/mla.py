"""Multi-head latent attention (MLA) in its two equivalent forms (models.md §2.4, §2.5).

- naive ("MHA"): expand each cached latent through W_UK / W_UV into per-head keys and values;
  cheaper for long prefills, used for single-sequence prefill steps.
- absorbed ("MQA"): fold W_UK into the query (q_nope . W_UK) and attend over the 576-wide latent
  rows directly through :func:`jaxdsa.ops.sparse_mla`, then apply W_UV; used for decode and for
  every sparse (top-k) step.

Parameter shapes (H heads, R kv_lora_rank, P rope dim, N nope dim, V value dim, D model dim):
q_a [D, q_lora], q_b [q_lora, H, N+P], kv_a [D, R+P], w_uk [H, N, R], w_uv [H, V, R], o [H, V, D].
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxdsa import ops
from jaxdsa.config import HF_LATENT_NORM_EPS, ModelConfig
from jaxdsa.layers.norms import rms_norm
from jaxdsa.layers.rope import apply_rope


def queries(p: dict, x: jax.Array, cfg: ModelConfig, cos: jax.Array, sin: jax.Array):
    """-> q_nope [T,H,N], q_pe [T,H,P] (roped), q_lat [T, q_lora] (also the indexer's input)."""
    q_lat = rms_norm(x @ p["q_a"], p["q_a_norm"], HF_LATENT_NORM_EPS)
    q = jnp.einsum("tr,rhd->thd", q_lat, p["q_b"])
    q_nope, q_pe = q[..., : cfg.qk_nope_head_dim], q[..., cfg.qk_nope_head_dim :]
    return q_nope, apply_rope(q_pe, cos, sin, interleaved=True), q_lat


def latent_rows(p: dict, x: jax.Array, cfg: ModelConfig, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """The cached row of each token: [normed latent (R) | roped shared key (P)] -> [T, R+P]."""
    kv = x @ p["kv_a"]
    latent = rms_norm(kv[:, : cfg.kv_lora_rank], p["kv_a_norm"], HF_LATENT_NORM_EPS)
    k_pe = apply_rope(kv[:, cfg.kv_lora_rank :], cos, sin, interleaved=True)
    return jnp.concatenate([latent, k_pe], axis=-1)


def naive_attention(p: dict, q_nope, q_pe, keys: jax.Array, mask: jax.Array, cfg: ModelConfig) -> jax.Array:
    """Expanded-KV attention. keys [S, R+P] latent rows, mask [T, S] bool -> o [T, H, V]."""
    r = cfg.kv_lora_rank
    latent, k_pe = keys[:, :r], keys[:, r:]
    k_nope = jnp.einsum("sc,hnc->shn", latent, p["w_uk"])
    v = jnp.einsum("sc,hvc->shv", latent, p["w_uv"])
    k = jnp.concatenate(
        [k_nope, jnp.broadcast_to(k_pe[:, None, :], k_nope.shape[:2] + k_pe.shape[-1:])], axis=-1
    )
    q = jnp.concatenate([q_nope, q_pe], axis=-1)
    # jax.nn.dot_product_attention needs equal q/k and v widths: zero-pad the narrower side.
    width = max(q.shape[-1], v.shape[-1])
    pad = lambda a: jnp.pad(a, ((0, 0), (0, 0), (0, width - a.shape[-1])))  # noqa: E731
    o = jax.nn.dot_product_attention(
        pad(q)[None], pad(k)[None], pad(v)[None], mask=mask[None, None], scale=cfg.softmax_scale
    )
    return o[0, ..., : v.shape[-1]]


def absorbed_attention(
    p: dict, q_nope, q_pe, kv_rows: jax.Array, indices: jax.Array, cfg: ModelConfig
) -> jax.Array:
    """Latent-space attention over cache slots. kv_rows [N, R+P], indices [T, K] (-1 skip) -> o [T,H,V]."""
    q_abs = jnp.einsum("thn,hnc->thc", q_nope, p["w_uk"])
    q = jnp.concatenate([q_abs, q_pe.astype(q_abs.dtype)], axis=-1)
    out, _ = ops.sparse_mla(q, kv_rows, indices, sm_scale=cfg.softmax_scale, v_dim=cfg.kv_lora_rank)
    return jnp.einsum("thc,hvc->thv", out, p["w_uv"])


def output(p: dict, o: jax.Array) -> jax.Array:
    return jnp.einsum("thv,hvd->td", o, p["o"])
