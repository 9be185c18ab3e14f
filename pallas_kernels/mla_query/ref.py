"""Pure-JAX oracle of :func:`pallas_kernels.mla_query.kernel.mla_query`: MLA's absorbed query
(docs/models.md §2.5) from the normed ``q_a`` projection, as :class:`jaxdsa.layers.mla.MLAttention`
builds it: ``q = q_lat q_b`` split per head into ``q_nope | q_pe``, ``q_nope`` folded through each
head's ``W_UK`` slice into the latent space, ``q_pe`` rotated (interleaved pairs), side by side.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.mla_latent.ref import rope_interleaved
from pallas_kernels.quant.layout import QuantizedWeight, take_layer
from pallas_kernels.quant_matmul import ref as quant_matmul_ref


def mla_query(
    q_lat: jax.Array,
    q_b: QuantizedWeight,
    w_uk: jax.Array,
    cos: jax.Array,
    sin: jax.Array,
    *,
    nope: int,
    layer: jax.Array | None = None,
) -> jax.Array:
    """q_lat [T, Q]; q_b [Q, H * (nope + P)] quantized, w_uk [C, H, nope] dense (stacks ``[L, ...]``
    of both read at ``layer``); cos, sin [T, P / 2] float32 -> q [T, H, C + P] in q_lat's dtype:
    ``[einsum("thn,chn->thc", q_nope, w_uk) | RoPE(q_pe)]``, the products accumulated in float32
    (full float32 precision for float32 activations) and each part rounded to the dtype."""
    if layer is not None:
        w_uk = take_layer(w_uk, layer)
    t, dtype = q_lat.shape[0], q_lat.dtype
    q = quant_matmul_ref.quant_matmul(q_lat, q_b, layer=layer).reshape(t, w_uk.shape[1], -1)
    precision = jax.lax.Precision.HIGHEST if dtype == jnp.float32 else None
    q_abs = jnp.einsum(
        "thn,chn->thc",
        q[..., :nope],
        w_uk.astype(dtype),
        preferred_element_type=jnp.float32,
        precision=precision,
    ).astype(dtype)
    return jnp.concatenate([q_abs, rope_interleaved(q[..., nope:], cos, sin)], axis=-1)
