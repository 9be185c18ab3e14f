"""Pure-JAX oracle of :func:`pallas_kernels.mla_latent.kernel.mla_latent`: the layer input's projections
through ``q_a``, ``kv_a`` (and the indexer's ``wk``), then what MLA does with them before attention
(docs/models.md §2.4): ``q_lat = RMSNorm(x q_a)``, and the token's cached row ``[RMSNorm(latent) |
RoPE(k_pe)]`` (interleaved pairs), each norm in HF's casting order.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.quant_matmul import ref as quant_matmul_ref
from pallas_kernels.rms_norm.ref import add_rms_norm


def rope_interleaved(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate the pairs (2i, 2i + 1) of ``x [T, ..., d]`` by per-token angles (cos, sin ``[T, d/2]``,
    broadcast over the dims between: a query's heads)."""
    angles = (x.shape[0],) + (1,) * (x.ndim - 2) + (-1,)
    cos, sin = cos.reshape(angles), sin.reshape(angles)
    x32 = x.astype(jnp.float32)
    a, b = x32[..., 0::2], x32[..., 1::2]
    return jnp.stack([a * cos - b * sin, b * cos + a * sin], axis=-1).reshape(x.shape).astype(x.dtype)


def mla_latent(x, ws, q_norm, kv_norm, cos, sin, *, eps: float, layer=None):
    """x [T, D]; ws = (q_a [D, Q], kv_a [D, C + P], optionally wk [D, d]) quantized (or stacks of them
    read at ``layer``); q_norm [Q], kv_norm [C] (stacks [L, .] at ``layer``); cos, sin [T, P / 2]
    float32 -> (q_lat [T, Q], row [T, C + P], and wk's product [T, d] when given), x's dtype."""
    q_a, kv, *wk = quant_matmul_ref.quant_matmul_many(x, tuple(ws), layer=layer)
    c = kv_norm.shape[-1]
    normed = lambda v, w: add_rms_norm(v, w, eps=eps, layer=layer)[0]  # noqa: E731
    row = jnp.concatenate([normed(kv[:, :c], kv_norm), rope_interleaved(kv[:, c:], cos, sin)], axis=-1)
    return (normed(q_a, q_norm), row, *wk)
