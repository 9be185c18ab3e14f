"""Pure-JAX oracle for the MoE router's expert selection (DeepSeek-V3 ``noaux_tc``, docs/models.md §2.9)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def select_experts(
    logits,
    bias,
    *,
    top_k: int,
    n_group: int,
    topk_group: int,
    norm_topk_prob: bool,
    scaling: float,
    layer=None,
    shared_slot: int | None = None,
):
    """logits [T,E] f32, bias [E] f32 (or a stack [L, E] at ``layer``) -> (ids [T,k] int32,
    weights [T,k] f32); k = top_k, and one more column with ``shared_slot``: that id at weight 1
    (a shared expert held as one more routed expert, :mod:`jaxdsa.shared_experts`).

    ``scores = sigmoid(logits)``; experts are chosen on ``scores + bias`` (the bias only selects).
    With ``n_group > 1`` the E experts form ``n_group`` groups of consecutive ones, each scored by
    the sum of its two largest biased scores; only the ``topk_group`` best groups stay eligible.
    The ``top_k`` largest biased scores win (ties: lower index first, as ``lax.top_k``); their
    weights are the unbiased scores, normalized to sum 1 if ``norm_topk_prob``, times ``scaling``.
    """
    bias = bias if layer is None else bias[layer]
    scores = jax.nn.sigmoid(logits.astype(jnp.float32))
    choice = scores + bias.astype(jnp.float32)
    if n_group > 1:
        T, E = choice.shape
        grouped = choice.reshape(T, n_group, E // n_group)
        group_scores = jax.lax.top_k(grouped, 2)[0].sum(-1)  # sum of the top-2 biased scores
        _, keep = jax.lax.top_k(group_scores, topk_group)
        group_mask = jnp.zeros((T, n_group), bool).at[jnp.arange(T)[:, None], keep].set(True)
        choice = jnp.where(jnp.repeat(group_mask, E // n_group, axis=1), choice, -jnp.inf)
    _, ids = jax.lax.top_k(choice, top_k)
    weights = jnp.take_along_axis(scores, ids, axis=1)
    if norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdims=True) + 1e-20)
    return with_shared_column(ids.astype(jnp.int32), weights * scaling, shared_slot)


def with_shared_column(ids, weights, slot: int | None):
    """``ids`` / ``weights`` ``[T, k]`` and, with a shared expert held at ``slot`` of the expert stacks
    (:mod:`jaxdsa.shared_experts`), one more column routing every token to it at weight 1: what
    every router returns when its shared expert runs as one more routed expert."""
    if slot is None:
        return ids, weights
    column = lambda value, like: jnp.full((like.shape[0], 1), value, like.dtype)  # noqa: E731
    return (
        jnp.concatenate([ids, column(slot, ids)], axis=1),
        jnp.concatenate([weights, column(1.0, weights)], axis=1),
    )
