"""Pure-JAX MoE experts: token slots sorted by expert, two ``jax.lax.ragged_dot`` GEMMs."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.quant.layout import QuantizedWeight, concat_n, dequantize, take_layer


def pack_experts(gate, up, down):
    """HF per-expert [out, in] matrices -> {'gate_up': [E, D, 2N], 'down': [E, N, D]}.

    Quantized experts are passed as :class:`QuantizedWeight` stacks already in the ``[E, in, out]``
    layout (``pallas_kernels.quant.layout.pack_*``); gate and up are joined along N."""
    if isinstance(gate, QuantizedWeight):
        return {"gate_up": concat_n(gate, up), "down": down}
    gate_up = jnp.concatenate([jnp.swapaxes(gate, 1, 2), jnp.swapaxes(up, 1, 2)], axis=-1)
    return {"gate_up": gate_up, "down": jnp.swapaxes(down, 1, 2)}


def _weights(w, dtype):
    """Dense experts as they are; quantized ones dequantized (their format's values) to ``dtype``."""
    return dequantize(w, dtype) if isinstance(w, QuantizedWeight) else w


def moe_experts(
    x,
    topk_ids,
    topk_weights,
    experts,
    *,
    swiglu_limit: float | None = None,
    layer: jax.Array | None = None,
    out_dtype=None,
):
    """out[t] = sum_j w[t,j] * down_e(silu(gate_e x_t) * up_e x_t), e = topk_ids[t,j].

    Ids outside [0, E) contribute nothing, so an expert-parallel shard can pass global routing
    shifted to its local range. Quantized experts are dequantized to x's dtype. ``layer``: the
    experts are stacks over layers (``gate_up [L, E, D, 2N]``, ``down [L, E, N, D]``) and layer
    ``layer``'s are used. ``out_dtype``: the float32 sum over the slots is rounded to it (x's dtype
    unless given).
    """
    if layer is not None:
        experts = take_layer(experts, layer)
    T, k = topk_ids.shape
    E, _, two_n = experts["gate_up"].shape
    n = two_n // 2
    ids = topk_ids.reshape(-1)
    in_range = (ids >= 0) & (ids < E)
    sort_key = jnp.where(in_range, ids, E)  # out-of-range slots go last, into no group
    order = jnp.argsort(sort_key, stable=True)
    group_sizes = jnp.bincount(jnp.where(in_range, ids, 0), weights=in_range.astype(jnp.int32), length=E)
    xs = jnp.take(x, order // k, axis=0)
    gate_up, down = _weights(experts["gate_up"], x.dtype), _weights(experts["down"], x.dtype)
    h = jax.lax.ragged_dot(xs, gate_up, group_sizes, preferred_element_type=jnp.float32)
    gate, up = h[:, :n], h[:, n:]
    if swiglu_limit is not None:
        gate = jnp.minimum(gate, swiglu_limit)
        up = jnp.clip(up, -swiglu_limit, swiglu_limit)
    act = (jax.nn.silu(gate) * up).astype(x.dtype)
    y = jax.lax.ragged_dot(act, down, group_sizes, preferred_element_type=jnp.float32)
    w = jnp.where(in_range, topk_weights.reshape(-1), 0.0)[order]
    y = y * w[:, None]
    out = jnp.zeros((T * k, x.shape[1]), jnp.float32).at[order].set(y)
    return out.reshape(T, k, -1).sum(axis=1).astype(out_dtype or x.dtype)
