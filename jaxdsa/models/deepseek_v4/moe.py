"""V4 MoE (docs/models.md §3.9, as HF computes it): sqrt-softplus scores, top-k on score + bias or a
fixed ``tid2eid[token]`` table on hash layers, weights normalized (+1e-20) and scaled, routed experts
and the one shared expert as SwiGLU with the gate clamped above and the up projection clamped on
both sides at ``swiglu_limit``. Routed outputs are weighted after the down projection.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxdsa import ops
from jaxdsa.layers.mlp import MLP, Experts
from jaxdsa.layers.params import normal, param, zeros
from jaxdsa.models.deepseek_v4.config import V4Config
from jaxdsa.sharding import reduce_partials


class Router(nnx.Module):
    """Score-routed (``bias`` for the choice only) or hash-routed (``tid2eid [V, k]``), in float32."""

    def __init__(self, cfg: V4Config, *, hashed: bool, rngs: nnx.Rngs):
        D, E, k = cfg.hidden_size, cfg.n_routed_experts, cfg.num_experts_per_tok
        # [E, D] as HF stores it: the logits are row reductions (jaxdsa.checkpoints.spec.as_stored)
        self.weight = normal(rngs, (E, D), D, jnp.float32, ("router_experts", "embed"))
        self.bias = None if hashed else zeros((E,), jnp.float32, ("router_experts",))
        table = jnp.arange(cfg.vocab_size * k, dtype=jnp.int32).reshape(-1, k) % E  # k distinct per token
        self.tid2eid = param(table, ("hash_vocab", "experts_per_token")) if hashed else None
        self.top_k, self.scaling = k, cfg.routed_scaling_factor

    def __call__(
        self, x: jax.Array, tokens: jax.Array, shared_slot: int | None = None
    ) -> tuple[jax.Array, jax.Array]:
        """-> (expert ids [T, k] int32, weights [T, k] float32); with ``shared_slot`` one more column,
        every token routed to that expert at weight 1 (:func:`jaxdsa.ops.with_shared_column`)."""
        scores = jnp.sqrt(jax.nn.softplus(jnp.einsum("td,ed->te", x.astype(jnp.float32), self.weight[...])))
        if self.tid2eid is not None:
            ids = self.tid2eid[...][tokens]
        else:
            _, ids = jax.lax.top_k(scores + self.bias[...], self.top_k)
        weights = jnp.take_along_axis(scores, ids, axis=1)
        weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
        return ops.with_shared_column(ids.astype(jnp.int32), weights * self.scaling, shared_slot)


class MoE(nnx.Module):
    def __init__(self, cfg: V4Config, *, hashed: bool, dtype, rngs: nnx.Rngs):
        D, N, limit = cfg.hidden_size, cfg.moe_intermediate_size, cfg.swiglu_limit
        self.router = Router(cfg, hashed=hashed, rngs=rngs)
        self.experts = Experts(cfg.n_routed_experts, D, N, dtype=dtype, rngs=rngs, swiglu_limit=limit)
        self.shared = MLP(D, N, dtype=dtype, rngs=rngs, swiglu_limit=limit)

    def __call__(self, x: jax.Array, tokens: jax.Array, valid: jax.Array | None = None) -> jax.Array:
        """The routed and the shared experts' partial sums meet before one all-reduce
        (:func:`jaxdsa.sharding.reduce_partials`), rounded to x's dtype once. ``valid``: the step's
        real tokens (host experts skip padding)."""
        routed = self.router(x, tokens, shared_slot=self.experts.shared_slot)
        parts = self.experts.partials(x, *routed, shared=self.shared, valid=valid)
        return reduce_partials(parts).astype(x.dtype)
