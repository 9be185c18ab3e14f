"""Pure-JAX oracle of :func:`pallas_kernels.mla_latent.kernel.mla_latent`: the layer input's projections
through ``q_a``, ``kv_a`` (and the indexer's ``wk``), then what MLA does with them before attention
(docs/models.md §2.4): ``q_lat = RMSNorm(x q_a)``, and the token's cached row ``[RMSNorm(latent) |
RoPE(k_pe)]`` (interleaved pairs), each norm in HF's casting order.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.quant_matmul import ref as quant_matmul_ref


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """weight * (x / sqrt(mean(x^2) + eps)), the normalized value cast back before the weight."""
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return weight * y.astype(x.dtype)


def rope_interleaved(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate the pairs (2i, 2i + 1) of ``x [T, d]`` by per-token angles (cos, sin ``[T, d/2]``)."""
    x32 = x.astype(jnp.float32)
    a, b = x32[:, 0::2], x32[:, 1::2]
    return jnp.stack([a * cos - b * sin, b * cos + a * sin], axis=-1).reshape(x.shape).astype(x.dtype)


def mla_latent(x, ws, q_norm, kv_norm, cos, sin, *, eps: float, layer=None):
    """x [T, D]; ws = (q_a [D, Q], kv_a [D, C + P], optionally wk [D, d]) quantized (or stacks of them
    read at ``layer``); q_norm [Q], kv_norm [C] (stacks [L, .] at ``layer``); cos, sin [T, P / 2]
    float32 -> (q_lat [T, Q], row [T, C + P], and wk's product [T, d] when given), x's dtype."""
    q_a, kv, *wk = quant_matmul_ref.quant_matmul_many(x, tuple(ws), layer=layer)
    if layer is not None:
        q_norm, kv_norm = q_norm[layer], kv_norm[layer]
    c = kv_norm.shape[-1]
    row = jnp.concatenate([rms_norm(kv[:, :c], kv_norm, eps), rope_interleaved(kv[:, c:], cos, sin)], axis=-1)
    return (rms_norm(q_a, q_norm, eps), row, *wk)
