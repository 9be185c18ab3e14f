"""Pure-JAX oracle for sparse MLA (float32 math, chunked over queries to bound memory).

The cache is float rows ``[Z, D]`` or ``fp8_ds_mla`` records ``uint8 [Z, W]``
(:mod:`pallas_kernels.quant.kv_fp8`); records are dequantized after the gather, so only the
selected rows are ever decoded, never the pool.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.quant import kv_fp8

_QUERY_CHUNK = 64


def check_kv(kv: jax.Array, q_dim: int, v_dim: int) -> None:
    """Raise ValueError unless ``kv`` holds rows for ``q_dim``-wide queries: float ``[Z, q_dim]``, or
    ``uint8 [Z, W]`` records with ``W = kv_fp8.record_width(v_dim, q_dim - v_dim)``."""
    if kv.ndim != 2 or not 0 < v_dim <= q_dim:
        raise ValueError(f"sparse_mla: kv {kv.shape} for {q_dim}-wide queries, v_dim {v_dim}")
    if kv.dtype == jnp.uint8:
        width = kv_fp8.record_width(v_dim, q_dim - v_dim)
        if kv.shape[1] != width:
            raise ValueError(
                f"sparse_mla: uint8 kv is fp8_ds_mla records, {width} bytes for {v_dim} latent + "
                f"{q_dim - v_dim} rope values; got {kv.shape[1]}"
            )
    elif kv.shape[1] != q_dim:
        raise ValueError(f"sparse_mla: kv rows are {kv.shape[1]} wide, queries {q_dim}")


def _attend(q, kv, indices, sm_scale, sink, v_dim):
    """q [T,H,Dk], kv [Z,Dk] or records [Z,W], indices [T,K] -> out [T,H,v_dim] f32, lse [T,H] f32."""
    valid = (indices >= 0) & (indices < kv.shape[0])
    rows = jnp.take(kv, jnp.where(valid, indices, 0), axis=0)  # [T,K,Dk] or [T,K,W]
    if kv.dtype == jnp.uint8:
        rows = kv_fp8.dequantize_latent(rows, v_dim, q.shape[-1] - v_dim)
    rows = rows.astype(jnp.float32)
    s = jnp.einsum("thd,tkd->thk", q.astype(jnp.float32), rows, precision="highest") * sm_scale
    s = jnp.where(valid[:, None, :], s, -jnp.inf)
    m = jnp.max(s, axis=-1)
    if sink is not None:
        m = jnp.maximum(m, sink[None, :])
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.exp(s - m[..., None])
    denom = jnp.sum(p, axis=-1)
    if sink is not None:
        denom = denom + jnp.exp(sink[None, :] - m)
    out = jnp.einsum("thk,tkd->thd", p, rows[..., :v_dim], precision="highest")
    out = out / jnp.where(denom > 0, denom, 1.0)[..., None]
    lse = jnp.where(denom > 0, m + jnp.log(jnp.where(denom > 0, denom, 1.0)), -jnp.inf)
    return out, lse


def sparse_mla(q, kv, indices, *, sm_scale: float, sink=None, v_dim: int = 512):
    """See :func:`jaxdsa.ops.sparse_mla`. out has q's dtype, lse is float32 (natural log)."""
    check_kv(kv, q.shape[-1], v_dim)
    sink = None if sink is None else sink.astype(jnp.float32)
    T = q.shape[0]
    if T <= _QUERY_CHUNK:
        out, lse = _attend(q, kv, indices, sm_scale, sink, v_dim)
    else:
        out, lse = jax.lax.map(
            lambda a: _attend(a[0][None], kv, a[1][None], sm_scale, sink, v_dim),
            (q, indices),
            batch_size=_QUERY_CHUNK,
        )
        out, lse = out[:, 0], lse[:, 0]
    return out.astype(q.dtype), lse
