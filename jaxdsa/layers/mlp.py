"""SwiGLU feed-forward and the DeepSeek noaux_tc MoE block (models.md §2.9)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxdsa import ops
from jaxdsa.config import ModelConfig


def swiglu(p: dict, x: jax.Array) -> jax.Array:
    """down(silu(gate x) * up x); p has gate [D, I], up [D, I], down [I, D]."""
    return (jax.nn.silu(x @ p["gate"]) * (x @ p["up"])) @ p["down"]


def route(p: dict, x: jax.Array, cfg: ModelConfig) -> tuple[jax.Array, jax.Array]:
    """Sigmoid router with bias-for-selection-only and group-limited top-k, all in float32.

    -> expert ids [T, k] int32, weights [T, k] float32 (normalized, times routed_scaling_factor).
    """
    logits = x.astype(jnp.float32) @ p["router"].astype(jnp.float32)
    scores = jax.nn.sigmoid(logits)
    choice = scores + p["bias"].astype(jnp.float32)
    if cfg.n_group > 1:
        T, E = choice.shape
        grouped = choice.reshape(T, cfg.n_group, E // cfg.n_group)
        group_scores = jax.lax.top_k(grouped, 2)[0].sum(-1)  # sum of the top-2 biased scores
        _, keep = jax.lax.top_k(group_scores, cfg.topk_group)
        group_mask = jnp.zeros((T, cfg.n_group), bool).at[jnp.arange(T)[:, None], keep].set(True)
        choice = jnp.where(jnp.repeat(group_mask, E // cfg.n_group, axis=1), choice, -jnp.inf)
    _, ids = jax.lax.top_k(choice, cfg.num_experts_per_tok)
    weights = jnp.take_along_axis(scores, ids, axis=1)
    if cfg.norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdims=True) + 1e-20)
    return ids.astype(jnp.int32), weights * cfg.routed_scaling_factor


def moe(p: dict, x: jax.Array, cfg: ModelConfig) -> jax.Array:
    """Routed experts (grouped GEMM through ops.moe_experts) plus the shared expert."""
    ids, weights = route(p, x, cfg)
    return ops.moe_experts(x, ids, weights, p["experts"]) + swiglu(p["shared"], x)
