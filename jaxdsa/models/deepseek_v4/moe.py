"""V4 MoE (models.md §3.9, as HF computes it): sqrt-softplus scores, top-k on score + bias or a
fixed ``tid2eid[token]`` table on hash layers, weights normalized (+1e-20) and scaled, routed experts
and the one shared expert as SwiGLU with the gate clamped above and the up projection clamped on
both sides at ``swiglu_limit``. Routed outputs are weighted after the down projection.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxdsa import ops
from jaxdsa.models.deepseek_v4.config import V4Config


def route(p: dict, x: jax.Array, ids: jax.Array, cfg: V4Config, *, hashed: bool):
    """-> (expert ids [T, k] int32, weights [T, k] float32)."""
    logits = jnp.matmul(x.astype(jnp.float32), p["gate"].astype(jnp.float32), precision="highest")
    scores = jnp.sqrt(jax.nn.softplus(logits))
    if hashed:
        experts = p["tid2eid"][ids]
    else:
        _, experts = jax.lax.top_k(scores + p["bias"], cfg.num_experts_per_tok)
    weights = jnp.take_along_axis(scores, experts, axis=1)
    weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
    return experts.astype(jnp.int32), weights * cfg.routed_scaling_factor


def shared_expert(p: dict, x: jax.Array, limit: float) -> jax.Array:
    gate = jnp.minimum(jnp.matmul(x, p["w1"], precision="highest"), limit)
    up = jnp.clip(jnp.matmul(x, p["w3"], precision="highest"), -limit, limit)
    return jnp.matmul(jax.nn.silu(gate) * up, p["w2"], precision="highest")


def moe(p: dict, x: jax.Array, ids: jax.Array, cfg: V4Config, *, hashed: bool) -> jax.Array:
    experts, weights = route(p, x, ids, cfg, hashed=hashed)
    routed = ops.moe_experts(x, experts, weights, p["experts"], swiglu_limit=cfg.swiglu_limit)
    return routed + shared_expert(p["shared"], x, cfg.swiglu_limit)
