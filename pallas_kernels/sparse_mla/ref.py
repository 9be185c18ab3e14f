"""Pure-JAX oracle for sparse MLA (float32 math, chunked over queries to bound memory).

The cache is float rows ``[Z, D]``, or FP8 latent parts (:mod:`pallas_kernels.quant.kv_fp8`): e4m3
values ``[Z, C]``, scales ``[Z, S]`` (float32, or ue8m0 bytes as uint8; one per ``C / S`` values) and
bf16 rope ``[Z, D - C]``. The parts are gathered at the selected indices and dequantized there
(:func:`pallas_kernels.quant.kv_fp8.dequantize_latent`), so only the selected rows are ever decoded,
never the pool; the values are the dequantized row's first ``v_dim`` columns (``C``: GLM's ``V = c``;
``D``: DeepSeek-V4's ``V = K``, rope included).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.quant import kv_fp8

_QUERY_CHUNK = 64


def _describe(a: jax.Array | None) -> str:
    return "None" if a is None else f"{a.dtype} {tuple(a.shape)}"


def check_kv(
    kv: jax.Array, q_dim: int, v_dim: int, kv_scale: jax.Array | None = None, kv_rope: jax.Array | None = None
) -> None:
    """Raise ValueError unless the cache holds rows for ``q_dim``-wide queries whose first ``v_dim``
    columns are the value: float rows ``kv [Z, q_dim]`` (no ``kv_scale`` / ``kv_rope``), or with
    ``kv_scale`` the FP8 latent parts ``kv`` float8_e4m3fn ``[Z, C]``, ``kv_scale`` float32 or uint8
    (ue8m0) ``[Z, S]`` with S dividing C (one scale per ``C / S`` values), ``kv_rope`` bfloat16
    ``[Z, q_dim - C]`` (None when ``C == q_dim``), and ``v_dim`` either ``C`` (the value is the e4m3
    part: GLM, DS_MLA) or ``q_dim`` (the whole row: DeepSeek-V4, MODEL1)."""
    where = (
        f"sparse_mla: kv {_describe(kv)}, kv_scale {_describe(kv_scale)}, kv_rope {_describe(kv_rope)} "
        f"for {q_dim}-wide queries, v_dim {v_dim}"
    )
    if kv.ndim != 2 or not 0 < v_dim <= q_dim:
        raise ValueError(where)
    if kv_scale is None:
        if kv_rope is not None:
            raise ValueError(f"{where}: kv_rope is the rope part of FP8 rows, which come with kv_scale")
        if not jnp.issubdtype(kv.dtype, jnp.floating) or kv.dtype.itemsize < 2:
            raise ValueError(
                f"{where}: without kv_scale, kv is float rows (bf16 / f16 / f32); FP8 rows are kv "
                "float8_e4m3fn values with kv_scale and kv_rope"
            )
        if kv.shape[1] != q_dim:
            raise ValueError(f"{where}: the rows are {kv.shape[1]} wide, the queries {q_dim}")
        return
    z, c = kv.shape
    if kv.dtype != jnp.float8_e4m3fn or not 0 < c <= q_dim:
        raise ValueError(
            f"{where}: with kv_scale, kv is the float8_e4m3fn latent values [Z, C], C at most the query width"
        )
    if v_dim not in (c, q_dim):
        raise ValueError(
            f"{where}: v_dim must be the {c} e4m3 columns (V = the nope part) or the query width {q_dim} "
            "(V = the whole row, rope included)"
        )
    if (
        kv_scale.dtype not in (jnp.float32, jnp.uint8)
        or kv_scale.ndim != 2
        or kv_scale.shape[0] != z
        or not 0 < kv_scale.shape[1] <= c
        or c % kv_scale.shape[1]
    ):
        raise ValueError(
            f"{where}: kv_scale must be float32 or uint8 (ue8m0 exponents) [{z}, S], one scale per C / S "
            f"values (S dividing {c})"
        )
    rope_dim = q_dim - c
    if rope_dim == 0:
        if kv_rope is not None:
            raise ValueError(f"{where}: the row is all e4m3 values, so kv_rope must be None")
    elif kv_rope is None or kv_rope.dtype != jnp.bfloat16 or kv_rope.shape != (z, rope_dim):
        raise ValueError(f"{where}: kv_rope must be bfloat16 [{z}, {rope_dim}]")


def _attend(q, kv, kv_scale, kv_rope, indices, sm_scale, sink, v_dim):
    """q [T,H,Dk], kv [Z,Dk] (or FP8 parts), indices [T,K] -> out [T,H,v_dim] f32, lse [T,H] f32: the
    values are the first v_dim columns of the (dequantized) rows."""
    valid = (indices >= 0) & (indices < kv.shape[0])
    gather = lambda a: jnp.take(a, jnp.where(valid, indices, 0), axis=0)  # noqa: E731  [T,K,...]
    rows = gather(kv)
    if kv_scale is not None:
        rope = gather(kv_rope) if kv_rope is not None else jnp.zeros((*indices.shape, 0), jnp.bfloat16)
        rows = kv_fp8.dequantize_latent(rows, gather(kv_scale), rope)
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


def sparse_mla(q, kv, indices, *, sm_scale: float, sink=None, v_dim: int = 512, kv_scale=None, kv_rope=None):
    """See :func:`jaxdsa.ops.sparse_mla`. out has q's dtype, lse is float32 (natural log)."""
    check_kv(kv, q.shape[-1], v_dim, kv_scale, kv_rope)
    sink = None if sink is None else sink.astype(jnp.float32)
    attend = lambda q, indices: _attend(q, kv, kv_scale, kv_rope, indices, sm_scale, sink, v_dim)  # noqa: E731
    if q.shape[0] <= _QUERY_CHUNK:
        out, lse = attend(q, indices)
    else:
        out, lse = jax.lax.map(
            lambda a: attend(a[0][None], a[1][None]), (q, indices), batch_size=_QUERY_CHUNK
        )
        out, lse = out[:, 0], lse[:, 0]
    return out.astype(q.dtype), lse
