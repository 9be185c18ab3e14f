"""Pallas-Triton log-sum-exp merge of partial attention states, with an optional per-head sink.

Each part ``i`` holds an output normalised within its own key set and that set's natural-log
LSE. The merged state over the union of the sets (plus a sink logit that only enlarges the
denominator) is, with ``M = max(max_i lse_i, sink)``::

    w_i = exp(lse_i - M),   d = sum_i w_i + exp(sink - M)
    out = sum_i w_i * out_i / d,   lse = M + log(d)

Empty parts (lse = -inf) weigh 0; if everything is empty the output is 0 and the LSE is -inf
(or the sink). :func:`apply_sink` is the same formula for one part and is used in-kernel by
sparse MLA when it needs no K split.

Grid: ``(row_blocks, col_blocks)`` over the flattened ``[T*H, D]`` output. When all parts fit
one ``[block_rows, block_parts, block_d]`` tile (n <= 64, decode's K splits) a program loads its
rows' LSEs and that tile together and reduces over the parts axis: one memory round trip, which
is what B = 1 latency needs. More parts go in chunks: a pass over the LSEs for the maximum, then
one over the tiles. Loads are masked at the row/part/column edges (explicit masks and ``other``,
so JAX 0.11.2, which does not mask edge blocks, and 0.12 agree).

Design notes and measurements: the kernel notes (docs/kernels.md §1).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels._triton import compiler_params, pl, pltriton
from pallas_kernels.merge_states import tuning


def _finite_or_zero(x: jax.Array) -> jax.Array:
    return jnp.where(jnp.abs(x) < jnp.inf, x, 0.0)


def apply_sink(out: jax.Array, lse: jax.Array, sink: jax.Array) -> tuple[jax.Array, jax.Array]:
    """In-kernel: fold ``exp(sink)`` into the denominator of one normalised state.

    out [R, D] f32, lse [R] f32, sink [R] f32 -> (out, lse) with the sink included. Matches the
    reference bit for bit in the edge cases: lse = -inf gives out 0 and lse = sink; sink = -inf
    is a no-op; sink = +inf gives out 0 and lse = +inf.
    """
    m = _finite_or_zero(jnp.maximum(lse, sink))
    w = jnp.exp(lse - m)
    d = w + jnp.exp(sink - m)
    safe = jnp.where(d > 0, d, 1.0)
    return out * (w / safe)[:, None], jnp.where(d > 0, m + jnp.log(safe), -jnp.inf)


def _merge_kernel(*refs, n_parts, n_rows, d, n_heads, has_sink, cfg):
    if has_sink:
        lse_ref, outs_ref, sink_ref, o_ref, lse_o_ref = refs
    else:
        lse_ref, outs_ref, o_ref, lse_o_ref = refs
    br, bp, bd = cfg.block_rows, cfg.block_parts, cfg.block_d
    rows = pl.program_id(0) * br + jnp.arange(br, dtype=jnp.int32)
    cols = pl.program_id(1) * bd + jnp.arange(bd, dtype=jnp.int32)
    row_ok = rows < n_rows
    col_ok = None if d % bd == 0 else (cols < d)[None, :]  # only padded widths need a column mask

    def chunk_lse(c):  # [br, bp] LSEs of parts c*bp ... c*bp + bp - 1
        parts = c * bp + jnp.arange(bp, dtype=jnp.int32)
        ok = row_ok[:, None] & (parts < n_parts)[None, :]
        return parts, ok, pltriton.load(lse_ref.at[parts[None, :], rows[:, None]], mask=ok, other=-jnp.inf)

    def chunk_tile(parts, ok):  # [br, bp, bd] outputs of those parts
        mask = ok[:, :, None] if col_ok is None else ok[:, :, None] & col_ok[:, None, :]
        view = outs_ref.at[parts[None, :, None], rows[:, None, None], cols[None, None, :]]
        return pltriton.load(view, mask=mask, other=0.0).astype(jnp.float32)

    def weigh(lse, tile, m, acc, den):
        w = jnp.exp(lse - m[:, None])  # [br, bp]; empty parts and padding weigh exp(-inf) = 0
        return acc + jnp.sum(w[:, :, None] * tile, axis=1), den + jnp.sum(w, axis=1)

    def finite_max(lse_max):
        if has_sink:
            sink = pltriton.load(sink_ref.at[rows % n_heads], mask=row_ok, other=-jnp.inf)
            return _finite_or_zero(jnp.maximum(lse_max, sink)), sink
        return _finite_or_zero(lse_max), None

    n_chunks = pl.cdiv(n_parts, bp)
    init = (jnp.zeros((br, bd), jnp.float32), jnp.zeros((br,), jnp.float32))
    if n_chunks == 1:
        # All parts in one tile (decode's usual case): the LSE and output loads are issued together,
        # one memory round trip instead of two.
        parts, ok, lse = chunk_lse(0)
        tile = chunk_tile(parts, ok)
        m, sink = finite_max(jnp.max(lse, axis=1))
        acc, den = weigh(lse, tile, m, *init)
    else:
        neg_inf = jnp.full((br,), -jnp.inf, jnp.float32)
        m = lax.fori_loop(0, n_chunks, lambda c, m: jnp.maximum(m, jnp.max(chunk_lse(c)[2], axis=1)), neg_inf)
        m, sink = finite_max(m)

        def accumulate(c, carry):
            parts, ok, lse = chunk_lse(c)
            return weigh(lse, chunk_tile(parts, ok), m, *carry)

        acc, den = lax.fori_loop(0, n_chunks, accumulate, init)
    if has_sink:
        den = den + jnp.exp(sink - m)
    safe = jnp.where(den > 0, den, 1.0)
    out_mask = row_ok[:, None] if col_ok is None else row_ok[:, None] & col_ok
    pltriton.store(
        o_ref.at[rows[:, None], cols[None, :]], (acc / safe[:, None]).astype(o_ref.dtype), mask=out_mask
    )
    lse = jnp.where(den > 0, m + jnp.log(safe), -jnp.inf)
    pltriton.store(lse_o_ref.at[rows], lse, mask=row_ok & (pl.program_id(1) == 0))


def merge_states(
    outs: jax.Array,
    lses: jax.Array,
    sink: jax.Array | None = None,
    interpret: bool = False,
    *,
    out_dtype: jnp.dtype | None = None,
) -> tuple[jax.Array, jax.Array]:
    """See :func:`jaxdsa.ops.merge_states`.

    outs [n, T, H, D] (each normalised within its part), lses [n, T, H], sink [H] or None
    -> (out [T, H, D] in ``out_dtype`` (default outs.dtype), lse [T, H] f32).
    ``out_dtype`` lets sparse MLA merge float32 partials straight into the query dtype.
    """
    n, t, h, d = outs.shape
    if lses.shape != (n, t, h):
        raise ValueError(f"lses {lses.shape} does not match outs {outs.shape}")
    out_dtype = jnp.dtype(outs.dtype if out_dtype is None else out_dtype)
    if n == 0 or t * h * d == 0:
        empty_lse = jnp.full((t, h), -jnp.inf, jnp.float32)
        if sink is not None:
            empty_lse = jnp.broadcast_to(sink.astype(jnp.float32), (t, h))
        return jnp.zeros((t, h, d), out_dtype), empty_lse
    rows = t * h
    cfg = tuning.choose(n, rows, d)
    args = [lses.astype(jnp.float32).reshape(n, rows), outs.reshape(n, rows, d)]
    if sink is not None:
        args.append(sink.astype(jnp.float32))
    kernel = functools.partial(
        _merge_kernel, n_parts=n, n_rows=rows, d=d, n_heads=h, has_sink=sink is not None, cfg=cfg
    )
    out, lse = pl.pallas_call(
        kernel,
        out_shape=(jax.ShapeDtypeStruct((rows, d), out_dtype), jax.ShapeDtypeStruct((rows,), jnp.float32)),
        grid=(pl.cdiv(rows, cfg.block_rows), pl.cdiv(d, cfg.block_d)),
        compiler_params=compiler_params(cfg.num_warps, cfg.num_stages),
        interpret=interpret,
        name="merge_states",
    )(*args)
    return out.reshape(t, h, d), lse.reshape(t, h)
