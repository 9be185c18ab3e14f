"""Pallas-Triton sparse MLA: attention of absorbed queries over gathered latent-cache rows.

Math (per query t, head h, over the selected rows r = kv[indices[t, j]]): scores
``sm_scale * q[t,h] . r`` over the full row; values are the first ``v_dim`` columns of the same
rows; online softmax in float32 (base 2, ``log2(e)`` folded into the scale).

Layout. A row is split into its value part (``v_dim`` columns) and its rope part (the rest);
each part is padded to a power of two (Triton tiles must be powers of two) with column masks,
so 576 = 512 + 64 takes the unmasked fast path and e.g. the tiny models' 136 = 128 + 8 works
with masks. Scores are two dots (value part + rope part); the value tile is reused for P.V.

Grid ``(head_groups, splits, T)``, head group fastest so the programs sharing one query's rows
run side by side (the second read of a row hits L2). Each program:

1. loads its ``[block_h, Dv]`` and ``[block_h, Dr]`` query tiles once;
2. walks its chunk of the index list ``block_n`` at a time: loads the indices, masks -1 and
   out-of-range slots, gathers the rows with masked pointer loads (skipped rows cost no
   traffic; duplicates are just two rows), ``S = q.r^T`` (f32 accumulate), online softmax,
   ``acc += P.r[:, :Dv]``;
3. with one split, normalises, folds in the sink and writes ``out``/``lse``; with several, writes
   ``(out, lse)`` partials (outputs in float32, or in the query dtype with ``narrow_partials``:
   half the bytes written and merged at B = 1, where they rival the gathered rows) that
   :func:`pallas_kernels.merge_states.kernel.merge_states` combines (the sink joins there, once).

Split count, head block and tile sizes come from :mod:`.tuning` (per compute capability and
operand dtype: float32 tiles are sized to fit the same shared memory as bf16 ones).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import warnings

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels._triton import compiler_params, pl, pltriton
from pallas_kernels.merge_states.kernel import apply_sink, merge_states
from pallas_kernels.sparse_mla import ref, tuning
from pallas_kernels.sparse_mla.tuning import MlaConfig

_LOG2E = math.log2(math.e)
_LN2 = math.log(2.0)
_MIN_TILE = 16  # MMA operands need every dim >= 16
_MAX_ROW_PAD = 1024  # padded value + rope columns per head; wider q tiles and accumulators spill


def _pad(x: int) -> int:
    return max(_MIN_TILE, pl.next_power_of_2(x))


@dataclasses.dataclass(frozen=True)
class _Geometry:
    """Static shape facts the kernel body specialises on."""

    n_heads: int
    n_keys: int
    n_slots: int
    d_v: int  # value columns (the first d_v of a row)
    d_r: int  # rope columns (the rest of the row); 0 when the whole row is the value
    chunk: int  # indices per split (a multiple of block_n)
    block_h: int
    block_n: int
    prefetch: bool  # load step i+1's indices while step i's rows are gathered

    @property
    def d_v_pad(self) -> int:
        return _pad(self.d_v)

    @property
    def d_r_pad(self) -> int:
        return _pad(self.d_r) if self.d_r else 0


def _load_tile(src, rows, row_ok, col0: int, width: int, width_pad: int):
    """``src[rows, col0:col0+width]`` as a ``[len(rows), width_pad]`` tile, zeros where masked.

    Fully broadcast array indexers: one pointer tensor on GPU, and the form whose masked load the
    interpreter supports. The column mask only appears when the width is padded, so the real
    576-wide rows keep an all-row mask that Triton can vectorise along columns.
    """
    cols = col0 + jnp.arange(width_pad, dtype=jnp.int32)
    mask = row_ok[:, None]
    if width_pad != width:
        mask = mask & (cols < col0 + width)[None, :]
    return pltriton.load(src.at[rows[:, None], cols[None, :]], mask=mask, other=0)


def _kernel(*refs, g: _Geometry, sm_scale: float, has_sink: bool, precision):
    if has_sink:
        idx_ref, q_ref, kv_ref, sink_ref, out_ref, lse_ref = refs
    else:
        idx_ref, q_ref, kv_ref, out_ref, lse_ref = refs
    dtype = q_ref.dtype
    heads = pl.program_id(0) * g.block_h + jnp.arange(g.block_h, dtype=jnp.int32)
    head_ok = heads < g.n_heads
    start = pl.program_id(1) * g.chunk
    dot = functools.partial(lax.dot_general, preferred_element_type=jnp.float32, precision=precision)
    nt = (((1,), (1,)), ((), ()))  # a @ b.T
    nn = (((1,), (0,)), ((), ()))  # a @ b

    q_v = _load_tile(q_ref, heads, head_ok, 0, g.d_v, g.d_v_pad)
    if g.d_r:
        q_r = _load_tile(q_ref, heads, head_ok, g.d_v, g.d_r, g.d_r_pad)

    def load_indices(i):
        pos = start + i * g.block_n + jnp.arange(g.block_n, dtype=jnp.int32)
        return pltriton.load(idx_ref.at[pos], mask=pos < g.n_keys, other=-1)

    def step(i, carry):
        if g.prefetch:  # this step's indices came with the carry; fetch the next step's now
            m, row_sum, acc, idx = carry
            nxt = load_indices(i + 1)
        else:
            m, row_sum, acc = carry
            idx = load_indices(i)
        valid = (idx >= 0) & (idx < g.n_slots)
        safe = jnp.where(valid, idx, 0)
        kv_v = _load_tile(kv_ref, safe, valid, 0, g.d_v, g.d_v_pad).astype(dtype)
        s = dot(q_v, kv_v, nt)
        if g.d_r:
            s = s + dot(q_r, _load_tile(kv_ref, safe, valid, g.d_v, g.d_r, g.d_r_pad).astype(dtype), nt)
        s = jnp.where(valid[None, :], s * (sm_scale * _LOG2E), -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        m_ref = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # no valid key yet: keep exp2 finite
        alpha = jnp.exp2(m - m_ref)
        p = jnp.exp2(s - m_ref[:, None])
        acc = acc * alpha[:, None] + dot(p.astype(dtype), kv_v, nn)
        out = (m_new, row_sum * alpha + jnp.sum(p, axis=1), acc)
        return (*out, nxt) if g.prefetch else out

    init = (
        jnp.full((g.block_h,), -jnp.inf, jnp.float32),
        jnp.zeros((g.block_h,), jnp.float32),
        jnp.zeros((g.block_h, g.d_v_pad), jnp.float32),
    )
    if g.prefetch:
        init = (*init, load_indices(0))
    m, row_sum, acc = lax.fori_loop(0, g.chunk // g.block_n, step, init)[:3]

    row_sum_safe = jnp.where(row_sum > 0, row_sum, 1.0)
    out = acc / row_sum_safe[:, None]
    lse = jnp.where(row_sum > 0, m * _LN2 + jnp.log(row_sum_safe), -jnp.inf)
    if has_sink:  # only compiled in with a single split; otherwise the merge applies it
        out, lse = apply_sink(out, lse, pltriton.load(sink_ref.at[heads], mask=head_ok, other=-jnp.inf))
    out_mask = head_ok[:, None]
    cols = jnp.arange(g.d_v_pad, dtype=jnp.int32)
    if g.d_v_pad != g.d_v:
        out_mask = out_mask & (cols < g.d_v)[None, :]
    pltriton.store(out_ref.at[heads[:, None], cols[None, :]], out.astype(out_ref.dtype), mask=out_mask)
    pltriton.store(lse_ref.at[heads], lse, mask=head_ok)


def _empty(t: int, h: int, v_dim: int, dtype, sink):
    lse = jnp.full((t, h), -jnp.inf, jnp.float32)
    if sink is not None:
        lse = jnp.broadcast_to(sink.astype(jnp.float32)[None, :], (t, h))
    return jnp.zeros((t, h, v_dim), dtype), lse


def sparse_mla(
    q: jax.Array,
    kv: jax.Array,
    indices: jax.Array,
    *,
    sm_scale: float,
    sink: jax.Array | None = None,
    v_dim: int = 512,
    interpret: bool = False,
    config: MlaConfig | None = None,
) -> tuple[jax.Array, jax.Array]:
    """See :func:`jaxdsa.ops.sparse_mla`.

    q [T, H, D], kv [Z, D], indices [T, K] int32 (-1 or >= Z: skipped), sink [H] f32 or None
    -> (out [T, H, v_dim] in q.dtype, lse [T, H] f32, natural log, sink included).
    ``config`` overrides :func:`.tuning.choose` (benchmark sweeps).
    """
    t, h, d = q.shape
    n, d_kv = kv.shape
    k = indices.shape[1]
    if d_kv != d or indices.shape[0] != t or not 0 < v_dim <= d:
        raise ValueError(f"sparse_mla: q {q.shape}, kv {kv.shape}, indices {indices.shape}, v_dim {v_dim}")
    if t == 0 or h == 0 or k == 0 or n == 0:
        return _empty(t, h, v_dim, q.dtype, sink)
    if _pad(v_dim) + (_pad(d - v_dim) if d > v_dim else 0) > _MAX_ROW_PAD:
        warnings.warn(
            f"sparse_mla: a {d}-wide row ({v_dim} value columns) pads past {_MAX_ROW_PAD} columns per head, "
            "more than one program's registers hold; running the pure-JAX reference instead",
            stacklevel=2,
        )
        return ref.sparse_mla(q, kv, indices, sm_scale=sm_scale, sink=sink, v_dim=v_dim)

    itemsize = max(q.dtype.itemsize, kv.dtype.itemsize)  # kv tiles are loaded, then cast to q's dtype
    cfg = config or tuning.choose(t, h, k, d_v=v_dim, d_r=d - v_dim, itemsize=itemsize)
    chunk = pl.cdiv(pl.cdiv(k, cfg.splits), cfg.block_n) * cfg.block_n
    splits = pl.cdiv(k, chunk)
    g = _Geometry(h, k, n, v_dim, d - v_dim, chunk, cfg.block_h, cfg.block_n, cfg.prefetch)

    has_sink = sink is not None and splits == 1
    part_dtype = q.dtype if splits == 1 or cfg.narrow_partials else jnp.float32
    in_specs = [
        pl.BlockSpec((None, k), lambda hg, s, i: (i, 0)),
        pl.BlockSpec((None, h, d), lambda hg, s, i: (i, 0, 0)),
        pl.BlockSpec((n, d), lambda hg, s, i: (0, 0)),
    ]
    args = [indices.astype(jnp.int32), q, kv]
    if has_sink:
        in_specs.append(pl.BlockSpec((h,), lambda hg, s, i: (0,)))
        args.append(sink.astype(jnp.float32))
    precision = lax.Precision.HIGHEST if q.dtype == jnp.float32 else lax.Precision.DEFAULT
    kernel = functools.partial(_kernel, g=g, sm_scale=float(sm_scale), has_sink=has_sink, precision=precision)
    out, lse = pl.pallas_call(
        kernel,
        out_shape=(
            jax.ShapeDtypeStruct((splits, t, h, v_dim), part_dtype),
            jax.ShapeDtypeStruct((splits, t, h), jnp.float32),
        ),
        grid=(pl.cdiv(h, cfg.block_h), splits, t),
        in_specs=in_specs,
        out_specs=(
            pl.BlockSpec((None, None, h, v_dim), lambda hg, s, i: (s, i, 0, 0)),
            pl.BlockSpec((None, None, h), lambda hg, s, i: (s, i, 0)),
        ),
        compiler_params=compiler_params(cfg.num_warps, cfg.num_stages),
        interpret=interpret,
        name="sparse_mla",
    )(*args)
    if splits == 1:
        return out[0], lse[0]
    sink = None if sink is None else sink.astype(jnp.float32)
    return merge_states(out, lse, sink, interpret=interpret, out_dtype=q.dtype)
