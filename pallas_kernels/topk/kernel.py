"""Pallas-Triton top-k selection: indices of the k largest finite values of each row, any order.

Sort-free and exact (the Triton backend lowers no sort/top_k, and has no shared-memory atomics
for a radix histogram):

1. Every f32 maps to an order-preserving int32 key (the non-sign bits of negatives flipped);
   non-finite values map to INT32_MIN and are never selected.
2. One program holds a chunk of ``chunk`` keys of one row in registers and finds the cutoff of its
   ``kk = min(k, #finite)`` largest keys by MSB-first bisection on the key bits: each probe is a
   compare-and-count over the registers (a block reduction, no memory traffic), at most 32 probes,
   and the search stops as soon as a probe has exactly ``kk`` keys at or above it (usual for
   tie-free data, well before the last bit). ``TopkConfig(search="secant")`` finds the same
   cutoff by false position on the values instead: about half the probes on normal-like rows,
   and each probe is a block reduction, which bounds this kernel on H100. When the search ended
   on an exact count the keys at or above the cutoff are the selection; otherwise the keys above
   it plus the first ``kk - #above`` keys equal to it (a prefix sum over the ties). The selection
   is compacted with one more prefix sum and written, so the cost is one read of the chunk plus
   register work.
3. A row longer than one chunk is reduced in stages: each chunk writes its own top k (keys and
   original indices), which contains the row's top k (a key above the row's cutoff is above its
   chunk's cutoff, and a chunk holding the row's cutoff value keeps at least as many of those ties
   as the row needs), so the ``ceil(S / chunk) * k`` candidates go through the same kernel again
   until one chunk holds the whole row.

The index set equals ``jax.lax.top_k``'s whenever the k-th and (k+1)-th largest values differ;
with ties at the cutoff any of the tied indices may be chosen. Rows with fewer than k finite values
are padded with -1. ``k > chunk / 2`` on rows longer than one chunk (no shrinking stage exists)
falls back to ``jax.lax.top_k``.

Design notes and measurements: the kernel notes (docs/kernels.md §3).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels._triton import compiler_params, pl, pltriton
from pallas_kernels.topk import ref, tuning

_INT32_MIN = -(2**31)
_INT32_MAX = 2**31 - 1


@functools.partial(jax.jit, static_argnames=("k", "interpret", "config"))
def topk_indices(
    logits: jax.Array, k: int, *, interpret: bool = False, config: tuning.TopkConfig | None = None
) -> jax.Array:
    """logits [T,S] -> [T,k] int32 indices of the k largest finite values (any order, -1 padding).

    See :func:`jaxdsa.ops.topk_indices`. ``config`` overrides the tuning table (benchmarks, tests).
    """
    T, S = logits.shape
    cfg = config or tuning.config_for(rows=T, keys=S)
    if S > cfg.chunk and k > cfg.chunk // 2:
        return ref.topk_indices(logits, k)
    keys, idx = logits.astype(jnp.float32), None
    while keys.shape[1] > cfg.chunk:
        keys, idx = _select(keys, idx, k, cfg.chunk, cfg, final=False, interpret=interpret)
    chunk = pl.next_power_of_2(max(keys.shape[1], 16))
    (out,) = _select(keys, idx, k, chunk, cfg, final=True, interpret=interpret)
    return out


def _select(keys, idx, k: int, chunk: int, cfg: tuning.TopkConfig, *, final: bool, interpret: bool):
    """One stage. ``keys`` is the f32 logits (first stage, ``idx`` None) or the int32 keys of the
    previous stage's candidates with their original indices ``idx``. Returns ``(indices [T,k],)``
    when ``final``, else ``(keys, indices)`` of each chunk's top k, ``[T, n_chunks * k]`` each."""
    T, n = keys.shape
    n_chunks = pl.cdiv(n, chunk)
    width = k if final else n_chunks * k
    out_shape = [jax.ShapeDtypeStruct((T, width), jnp.int32)]
    if not final:
        out_shape.insert(0, jax.ShapeDtypeStruct((T, width), jnp.int32))
    inputs = (keys,) if idx is None else (keys, idx)
    kernel = functools.partial(
        _select_kernel, n=n, k=k, chunk=chunk, first=idx is None, final=final, secant=cfg.search == "secant"
    )
    return pl.pallas_call(
        kernel,
        out_shape=tuple(out_shape),
        grid=(T, n_chunks),
        compiler_params=compiler_params(cfg.num_warps(chunk), 1),
        interpret=interpret,
        name="topk_select",
    )(*inputs)


def _select_kernel(*refs, n: int, k: int, chunk: int, first: bool, final: bool, secant: bool) -> None:
    in_refs, out_refs = (refs[:1], refs[1:]) if first else (refs[:2], refs[2:])
    row = pl.program_id(0)
    start = pl.program_id(1) * chunk
    pos = start + jnp.arange(chunk, dtype=jnp.int32)
    in_row = pos < n
    if first:
        x = pltriton.load(in_refs[0].at[row, pl.ds(start, chunk)], mask=in_row, other=float("-inf"))
        key, idx = _ordered_key(x), pos
    else:
        key = pltriton.load(in_refs[0].at[row, pl.ds(start, chunk)], mask=in_row, other=_INT32_MIN)
        idx = pltriton.load(in_refs[1].at[row, pl.ds(start, chunk)], mask=in_row, other=-1)

    valid = key > _INT32_MIN
    kk = jnp.minimum(k, jnp.sum(valid.astype(jnp.int32)))
    cutoff, exact = _cutoff_secant(key, valid, kk) if secant else _cutoff(key, kk)

    def with_ties():
        above = valid & (key > cutoff)
        tie = (valid & (key == cutoff)).astype(jnp.int32)
        need = kk - jnp.sum(above.astype(jnp.int32))
        return above | ((tie == 1) & (jnp.cumsum(tie) - tie < need))

    # Exactly kk keys at or above the cutoff (tie-free rows): no tie to break, so no prefix sum over
    # the ties and no counts of them (H100, kernels_indexer-h100.md 2026-11-23: 12-18 % faster at
    # every shape, [4096, 131072] 5529 vs 6643 us).
    sel = lax.cond(exact, lambda: valid & (key >= cutoff), with_ties)
    sel_i = sel.astype(jnp.int32)
    slot = jnp.cumsum(sel_i) - sel_i

    base = 0 if final else pl.program_id(1) * k
    width = out_refs[0].shape[1]
    dest = jnp.where(sel, base + slot, width)  # masked lanes point past the row
    j = jnp.arange(pl.next_power_of_2(k), dtype=jnp.int32)
    pad = (j >= kk) & (j < k)
    pad_dest = jnp.where(pad, base + j, width)
    *key_out, idx_out = out_refs
    pltriton.store(idx_out.at[row, dest], idx, mask=sel)
    pltriton.store(idx_out.at[row, pad_dest], jnp.full(j.shape, -1, jnp.int32), mask=pad)
    if key_out:
        pltriton.store(key_out[0].at[row, dest], key, mask=sel)
        pltriton.store(key_out[0].at[row, pad_dest], jnp.full(j.shape, _INT32_MIN, jnp.int32), mask=pad)


def _ordered_key(x: jax.Array) -> jax.Array:
    """f32 -> int32 with the same order (-0.0 just below +0.0); non-finite -> INT32_MIN."""
    bits = lax.bitcast_convert_type(x, jnp.int32)
    return jnp.where(jnp.isfinite(x), bits ^ ((bits >> 31) & 0x7FFFFFFF), _INT32_MIN)


def _cutoff(key: jax.Array, kk) -> tuple[jax.Array, jax.Array]:
    """A threshold ``t`` whose selection ``key > t`` plus ties ``key == t`` yields the ``kk`` largest:
    the largest ``t`` with ``count(key >= t) >= kk``, built MSB first, or an earlier probe that
    already has exactly ``kk`` keys at or above it; and whether ``count(key >= t) == kk``."""

    def cond(state):
        bit, _, count = state
        return (bit >= 0) & (count != kk)

    def body(state):
        bit, t, _ = state
        # From t = INT32_MIN the first probe, at bit 31, wraps to 0: the sign decides first.
        probe = t + jnp.left_shift(jnp.int32(1), bit)
        count = jnp.sum((key >= probe).astype(jnp.int32))
        return bit - 1, jnp.where(count >= kk, probe, t), count

    # Constant initial carries: the Triton while lowering fails (AssertionError in _add) on a carry
    # initialised by a scalar jnp.where.
    _, t, count = lax.while_loop(cond, body, (jnp.int32(31), jnp.int32(_INT32_MIN), jnp.int32(-1)))
    return t, count == kk


def _key_value(key: jax.Array) -> jax.Array:
    """Inverse of :func:`_ordered_key` on finite keys (the bit flip is its own inverse)."""
    return lax.bitcast_convert_type(key ^ ((key >> 31) & 0x7FFFFFFF), jnp.float32)


def _cutoff_secant(key: jax.Array, valid: jax.Array, kk) -> tuple[jax.Array, jax.Array]:
    """The same cutoff as :func:`_cutoff`, found by false position on the values.

    Invariant: ``count(key >= lo) >= kk > count(key >= hi)``, starting from the smallest valid
    key and one past the largest. Each probe is placed where the line through the two counts
    reaches ``kk`` in value space, and is clamped strictly inside ``(lo, hi)``. When one end is
    kept twice in a row its weight is halved (Illinois), so the other end keeps moving. After two
    probes that fail to halve the count gap, the next probe bisects the key interval. The search
    ends on a probe with exactly ``kk`` keys at or above it, or when ``hi = lo + 1``. Then ``lo``
    is the kk-th largest key, as in the bisection.
    """
    f32, i32 = jnp.float32, jnp.int32
    lo = jnp.min(jnp.where(valid, key, _INT32_MAX))
    hi = jnp.max(key) + 1
    c_lo = jnp.sum(valid.astype(i32))

    def cond(s):
        lo, hi, c_lo, *_ = s
        return (c_lo != kk) & (hi - 1 > lo)

    def body(s):
        lo, hi, c_lo, c_hi, w_lo, w_hi, side, slow = s
        a = (c_lo - kk).astype(f32) * w_lo  # |count - kk| at each end, as weighted
        b = (kk - c_hi).astype(f32) * w_hi
        frac = b / (a + b)  # where the line through both ends reaches kk, measured from hi
        # hi - 1 is a valid key (hi itself may be +inf's bit pattern); every key in between is finite.
        v = _key_value(hi - 1) * (1.0 - frac) + _key_value(lo) * frac
        interp = _ordered_key(v)
        mid = (lo >> 1) + (hi >> 1) + (lo & hi & 1)  # floor((lo + hi) / 2) without int32 overflow
        probe = jnp.clip(jnp.where(slow >= 2, mid, interp), lo + 1, hi - 1)
        count = jnp.sum((key >= probe).astype(i32))
        up = count >= kk  # the probe becomes the new lo (an exact hit also ends the loop there)
        gap = c_lo - c_hi
        new_lo, new_c_lo = jnp.where(up, probe, lo), jnp.where(up, count, c_lo)
        new_hi, new_c_hi = jnp.where(up, hi, probe), jnp.where(up, c_hi, count)
        new_side = 2 * up.astype(i32) - 1  # +1: lo moved, -1: hi moved (a where of two literals lowers to i1)
        # Illinois: an end kept a second time in a row counts half, pulling the next probe towards it.
        w_hi = jnp.where(up, jnp.where(side == 1, w_hi * 0.5, 1.0), 1.0)
        w_lo = jnp.where(up, 1.0, jnp.where(side == -1, w_lo * 0.5, 1.0))
        slow = jnp.where(slow >= 2, 0, jnp.where(2 * (new_c_lo - new_c_hi) > gap, slow + 1, 0))
        return new_lo, new_hi, new_c_lo, new_c_hi, w_lo, w_hi, new_side, slow

    init = (lo, hi, c_lo, jnp.int32(0), jnp.float32(1.0), jnp.float32(1.0), jnp.int32(0), jnp.int32(0))
    lo, _, c_lo, *_ = lax.while_loop(cond, body, init)
    return lo, c_lo == kk
