"""Pure-JAX oracle for sparse MLA (float32 math, chunked over queries to bound memory)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

_QUERY_CHUNK = 64


def _attend(q, kv, indices, sm_scale, sink, v_dim):
    """q [T,H,Dk], kv [Z,Dk], indices [T,K] -> out [T,H,v_dim] f32, lse [T,H] f32."""
    valid = (indices >= 0) & (indices < kv.shape[0])
    rows = jnp.take(kv, jnp.where(valid, indices, 0), axis=0).astype(jnp.float32)  # [T,K,Dk]
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
