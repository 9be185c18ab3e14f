"""SwiGLU feed-forward and the DeepSeek noaux_tc MoE block (docs/models.md §2.9)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
from flax import nnx

from jaxdsa import ops
from jaxdsa.layers.linear import Linear, project
from jaxdsa.layers.params import normal, zeros
from jaxdsa.layers.stacks import split_layer
from jaxdsa.sharding import Partial, partial_axes, reduce_partials

if TYPE_CHECKING:
    from jaxdsa.offload.host_experts import HostExperts
    from jaxdsa.offload.stats import ExpertRecorder


class MLP(nnx.Module):
    """down(silu(gate x) * up x): the dense feed-forward and the shared expert.

    ``swiglu_limit`` (DeepSeek-V4): the gate is clamped above and the up projection on both sides
    at the limit before the product (docs/models.md §3.9); None leaves both as they are.
    """

    def __init__(self, hidden: int, inter: int, *, dtype, rngs: nnx.Rngs, swiglu_limit: float | None = None):
        self.gate = Linear((hidden,), (inter,), ("embed", "mlp"), dtype=dtype, rngs=rngs)
        self.up = Linear((hidden,), (inter,), ("embed", "mlp"), dtype=dtype, rngs=rngs)
        self.down = Linear((inter,), (hidden,), ("mlp", "embed"), dtype=dtype, rngs=rngs)
        self.swiglu_limit = swiglu_limit

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down(self._act(x))

    def unreduced(self, x: jax.Array) -> Partial:
        """``self(x)`` before the down projection's all-reduce (:meth:`Linear.unreduced`)."""
        return self.down.unreduced(self._act(x))

    def _act(self, x: jax.Array) -> jax.Array:
        gate, up = project(x, (self.gate, self.up))
        if self.swiglu_limit is not None:
            gate = jnp.minimum(gate, self.swiglu_limit)
            up = jnp.clip(up, -self.swiglu_limit, self.swiglu_limit)
        return jax.nn.silu(gate) * up


class Router(nnx.Module):
    """Sigmoid router with bias-for-selection-only and group-limited top-k, all in float32."""

    def __init__(
        self,
        hidden: int,
        experts: int,
        *,
        top_k: int,
        n_group: int,
        topk_group: int,
        norm_topk_prob: bool,
        scaling: float,
        rngs: nnx.Rngs,
    ):
        # [E, D] as HF stores it: decode logits are row reductions (jaxdsa.checkpoints.spec.as_stored)
        self.weight = normal(rngs, (experts, hidden), hidden, jnp.float32, ("router_experts", "embed"))
        self.bias = zeros((experts,), jnp.float32, ("router_experts",))
        self.top_k, self.n_group, self.topk_group = top_k, n_group, topk_group
        self.norm_topk_prob, self.scaling = norm_topk_prob, scaling

    def stack_reads(self) -> tuple[str, ...]:
        """The bias: the selection kernel reads it in its stack (a slice would be copied out for it,
        a copy that splits the step's CUDA graph)."""
        return ("bias",)

    def __call__(self, x: jax.Array, shared_slot: int | None = None) -> tuple[jax.Array, jax.Array]:
        """-> expert ids [T, k] int32, weights [T, k] float32 (normalized, times the scaling factor);
        with ``shared_slot`` one more column, every token routed to that expert at weight 1."""
        logits = jnp.einsum("td,ed->te", x.astype(jnp.float32), self.weight[...].astype(jnp.float32))
        bias, layer = split_layer(self.bias.get_value())
        return ops.select_experts(
            logits,
            bias.astype(jnp.float32),
            top_k=self.top_k,
            n_group=self.n_group,
            topk_group=self.topk_group,
            norm_topk_prob=self.norm_topk_prob,
            scaling=self.scaling,
            layer=layer,
            shared_slot=shared_slot,
        )


class ExpertSlots(nnx.Variable):
    """A MoE layer's routing-slot table ``[E]`` int32 when its experts are split between the GPUs and
    host RAM (:func:`jaxdsa.offload.placement.slot_table`): made by the placement, not a weight."""


class Experts(nnx.Module):
    """Routed experts packed for :func:`jaxdsa.ops.moe_experts`: gate_up [E, D, 2N], down [E, N, D]
    (``swiglu_limit`` as in :class:`MLP`).

    A loader may replace either by a :class:`~jaxdsa.quantized_weight.QuantizedWeight`
    stack of the same shape and logical axes (the op's kernels dequantize experts in their K loop).
    Scanned, both reach the module as :class:`~jaxdsa.layers.stacks.LayerSlice` s of the layers'
    stacks (:meth:`stack_reads`), which the op's kernels read in place.

    Split between the GPUs and host RAM (:mod:`jaxdsa.offload`), the stacks hold the GPU experts,
    ``host`` the others and ``slots`` the table that maps routing ids to either side. ``recorder``
    counts the routing ids for ``--record-expert-stats``. ``shared_slot``: the stacks' position of
    the layer's shared expert when it is held as one more expert (:mod:`jaxdsa.shared_experts`);
    every token is routed to it at weight 1.
    """

    quantizable = True
    host: HostExperts | None = None
    slots: ExpertSlots | None = None
    recorder: ExpertRecorder | None = None  # --record-expert-stats (jaxdsa.offload.stats)
    shared_slot: int | None = None

    def __init__(
        self, num: int, hidden: int, inter: int, *, dtype, rngs: nnx.Rngs, swiglu_limit: float | None = None
    ):
        self.gate_up = normal(
            rngs, (num, hidden, 2 * inter), hidden, dtype, ("experts", "embed", "expert_mlp")
        )
        self.down = normal(rngs, (num, inter, hidden), inter, dtype, ("experts", "expert_mlp", "embed"))
        self.swiglu_limit = swiglu_limit

    def stack_reads(self) -> tuple[str, ...]:
        """Both weights: only the op's kernels read them."""
        return ("gate_up", "down")

    def __call__(self, x: jax.Array, ids: jax.Array, weights: jax.Array) -> jax.Array:
        return reduce_partials(self.partials(x, ids, weights)).astype(x.dtype)

    def partials(
        self,
        x: jax.Array,
        ids: jax.Array,
        weights: jax.Array,
        shared: MLP | None = None,
        valid: jax.Array | None = None,
    ) -> list[Partial]:
        """The routed experts' output (and the ``shared`` expert's) as partial sums, before their
        all-reduces (float32; :func:`jaxdsa.sharding.reduce_partials` adds them).

        With host experts, the CPU computes its slots while the GPU computes its own and the shared
        expert (:mod:`jaxdsa.offload.host_experts`): the barriers keep the callbacks on either side
        of that work. ``valid [T]``: the step's real tokens; the CPU skips padding rows, whose
        experts it would otherwise read. With ``shared_slot``, ``ids`` / ``weights`` end with the
        shared expert's column (its router's: :class:`Router`, :func:`jaxdsa.ops.with_shared_column`)."""
        if self.recorder is not None:
            routed = ids if self.shared_slot is None else ids[:, :-1]
            self.recorder.record(routed, valid, split_layer(self.down.get_value())[1])
        if self.host is None:
            return [self._run(x, ids, weights), *([shared.unreduced(x)] if shared is not None else [])]
        slots = jnp.take(self.slots[...], ids)
        _, layer = split_layer(self.down.get_value())
        axes = partial_axes(*ops.OPS["moe_experts"].sharding.reduce)  # the routed experts' partial sums
        host_slots = slots if valid is None else jnp.where(valid[:, None], slots, -1)
        tickets = self.host.submit(x, host_slots, weights, layer, axes)
        x_gpu, tickets = jax.lax.optimization_barrier((x, tickets))
        parts = [self._run(x_gpu, slots, weights)] if self.host.gpu else []
        parts += [shared.unreduced(x_gpu)] if shared is not None else []
        tickets, values = jax.lax.optimization_barrier((tickets, [p.value for p in parts]))
        parts = [Partial(v, p.axes) for v, p in zip(values, parts)]
        return [*parts, self.host.collect(tickets, x, axes)]

    def _run(self, x, ids, weights) -> Partial:
        gate_up, layer = split_layer(self.gate_up.get_value())
        down, _ = split_layer(self.down.get_value())  # the same layer: both come from one scan
        experts = {"gate_up": gate_up, "down": down}
        return ops.moe_experts(
            x, ids, weights, experts, swiglu_limit=self.swiglu_limit, layer=layer, unreduced=True
        )


class MoE(nnx.Module):
    """Routed experts (grouped GEMM through ops.moe_experts) plus the shared expert."""

    def __init__(self, router: Router, experts: Experts, shared: MLP):
        self.router, self.experts, self.shared = router, experts, shared

    def __call__(self, x: jax.Array) -> jax.Array:
        return reduce_partials(self.unreduced(x)).astype(x.dtype)

    def unreduced(self, x: jax.Array, valid: jax.Array | None = None) -> list[Partial]:
        """The routed and the shared experts' outputs before their all-reduces: added before one
        (:func:`jaxdsa.sharding.reduce_partials`) where both split over the same devices (TP).
        ``valid``: the step's real tokens (:meth:`Experts.partials`)."""
        ids, weights = self.router(x, shared_slot=self.experts.shared_slot)  # the column in its kernel
        return self.experts.partials(x, ids, weights, shared=self.shared, valid=valid)


def mlp_partials(mlp: nnx.Module, x: jax.Array, valid: jax.Array) -> list[Partial] | Partial:
    """The MLP's output as partial sums (:meth:`MoE.unreduced`, :meth:`MLP.unreduced`); a module that
    only maps ``[T, D] -> [T, D]`` (a notebook's replacement) gives its output, taken as complete.
    ``valid``: the step's real tokens (a MoE's host experts skip padding)."""
    if isinstance(mlp, MoE):
        return mlp.unreduced(x, valid)
    if hasattr(mlp, "unreduced"):
        return mlp.unreduced(x)
    return Partial.whole(mlp(x))
