"""Pallas-Triton kernels for the lightning-indexer logits.

    logits[t, s] = sum_h w[t, h] * relu(q[t, h] . k[s])   for s <= q_pos[t], else -inf

Every key is fetched through the page table: logical position ``s`` of sequence ``seq`` is row
``page_table[seq, s // page] * page + s % page`` of the flat key pool. Two kernels:

* **row kernel**, grid ``(key blocks, T)``: one query and ``steps`` blocks of ``block_s`` keys per
  program; per block the dot ``keys [block_s, D] x q[t]^T [D, Hi]`` (heads zero-padded to 16) runs
  on the tensor cores, then relu, weight and sum over heads. Each query reads its own sequence's
  keys once, so decode (one query per sequence) is a single streaming pass over the keys:
  memory-bound by design.
* **tile kernel**, grid ``(key blocks, query blocks)``: ``block_t`` queries of one sequence share a
  key tile ``[block_s, D]`` gathered once; a loop over heads does
  ``keys [block_s, D] x q[:, h]^T -> [block_s, block_t]``, relu, times ``w[:, h]``, accumulate. The
  accumulator keeps the MMA layout (no reshape across heads) and the key tile stays resident, so
  prefill is bound by the MMAs. Key blocks are the fastest grid axis, so the programs in flight
  share one query tile in L2. A tile whose valid queries span several sequences (a boundary in a
  packed batch, decode tokens mixed in) runs the row path query by query, so arbitrary ``seq_ids``
  stay correct.

The tile kernel runs when ``T >= max(block_t, tile_min_queries_per_seq * B)`` (prefill: queries
outnumber sequences), the row kernel otherwise (decode). Both skip key blocks that lie wholly
beyond the largest ``q_pos`` they serve: those are filled with -inf without reading keys. The flat
form is the paged form with one sequence whose single page is the whole key set.

fp8 keys (``float8_e4m3fn`` values + one f32 scale per key row, docs/models.md §5.4): relu is positively
homogeneous and the scales are positive (amax / 448), so
``sum_h w relu(q . (c k)) = c * sum_h w relu(q . k)``. The kernels take the dot on the unscaled
e4m3 values (exact in bf16/f16) and multiply each logit by its key's scale, so key bytes stay at
one per value. On sm_89+ the e4m3 cast is done in-kernel. **On sm_80/86 the Triton lowering has no
e4m3 cast**: the keys are bitcast to uint8 in XLA (free) and decoded in-kernel with integer ops
(:func:`_e4m3_bits_to_f16`). The choice is :func:`pallas_kernels.quant.decode.fp_decode`'s
(``JAXDSA_FP_DECODE`` forces either path); ``native_fp8`` overrides it per call.

Inputs with ragged edges are masked explicitly on every load and store (JAX 0.11.2 does not mask
overhanging blocks); all refs are whole arrays indexed with program-id-derived offsets.

Design notes and measurements: the kernel notes (docs/kernels.md §2).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels._triton import compiler_params, pl, pltriton, tile_pad
from pallas_kernels.indexer_logits import tuning
from pallas_kernels.quant.decode import fp_decode

KeyFormat = Literal["plain", "e4m3", "e4m3_bits"]

# _e4m3_bits_to_f16 yields the e4m3 value times 2**-8; the logits are scaled back by this.
_E4M3_BITS_FACTOR = 256.0
_NEG_INF = float("-inf")
_INT32_MAX = 2**31 - 1


@functools.partial(jax.jit, static_argnames=("interpret", "config"))
def indexer_logits(
    q: jax.Array,
    w: jax.Array,
    k: jax.Array,
    *,
    q_pos: jax.Array,
    interpret: bool = False,
    config: tuning.IndexerConfig | None = None,
) -> jax.Array:
    """Prefill form: q [T,Hi,D], w [T,Hi], k [S,D] (shared by all queries), q_pos [T] -> [T,S] f32.

    See :func:`jaxdsa.ops.indexer_logits`. ``config`` overrides the tuning table (benchmarks).
    """
    T = q.shape[0]
    one_page = jnp.zeros((1, 1), jnp.int32)
    one_seq = jnp.zeros((T,), jnp.int32)
    return _logits_paged(
        q, w, k[None], one_page, one_seq, q_pos, None, interpret=interpret, native_fp8=None, config=config
    )


@functools.partial(jax.jit, static_argnames=("interpret", "native_fp8", "config"))
def indexer_logits_paged(
    q: jax.Array,
    w: jax.Array,
    k_pages: jax.Array,
    page_table: jax.Array,
    seq_ids: jax.Array,
    q_pos: jax.Array,
    *,
    k_scale: jax.Array | None = None,
    interpret: bool = False,
    native_fp8: bool | None = None,
    config: tuning.IndexerConfig | None = None,
) -> jax.Array:
    """Paged form: q [T,Hi,D], w [T,Hi], k_pages [P,page,D], page_table [B,M], seq_ids [T], q_pos [T]
    -> [T, M*page] f32. See :func:`jaxdsa.ops.indexer_logits_paged`.

    ``k_scale [P,page]`` marks ``float8_e4m3fn`` keys (true key = k * scale; scales must be >= 0).
    ``native_fp8``: cast e4m3 in-kernel (True) or decode the bytes with integer ops (False); the
    default picks the cast on sm_89+ only, where Triton can lower it. ``config`` overrides the
    tuning table.
    """
    return _logits_paged(
        q,
        w,
        k_pages,
        page_table,
        seq_ids,
        q_pos,
        k_scale,
        interpret=interpret,
        native_fp8=native_fp8,
        config=config,
    )


@dataclasses.dataclass(frozen=True)
class _Spec:
    """Static facts the kernel bodies need."""

    num_queries: int
    num_heads: int
    page: int  # tokens per page
    seq_len: int  # logical key positions per sequence = output width
    key_format: KeyFormat
    dtype: jnp.dtype  # dot operand dtype (the query dtype)
    has_scale: bool

    @property
    def heads_pad(self) -> int:
        """Heads of the row kernel's dot: padded to the MMA minimum of 16 and a power of two."""
        return tile_pad(self.num_heads)

    @property
    def precision(self):
        # f32 dots default to TF32 on the GPU; keep f32 inputs exact.
        return lax.Precision.HIGHEST if self.dtype == jnp.float32 else None


class _Refs(NamedTuple):
    q: object
    w: object
    k: object
    scale: object  # None without fp8 scales
    page_table: object
    seq_ids: object
    q_pos: object
    out: object


def _logits_paged(q, w, k_pages, page_table, seq_ids, q_pos, k_scale, *, interpret, native_fp8, config):
    T, Hi, D = q.shape
    P, page, Dk = k_pages.shape
    B, M = page_table.shape
    if Dk != D or w.shape != (T, Hi):
        raise ValueError(f"shape mismatch: q {q.shape}, w {w.shape}, k_pages {k_pages.shape}")
    if D < 16 or D & (D - 1):
        raise ValueError(f"indexer head_dim={D}: Pallas-Triton needs a power of two >= 16")
    itemsize = max(q.dtype.itemsize, k_pages.dtype.itemsize)
    cfg = config or tuning.choose(num_heads=Hi, head_dim=D, itemsize=itemsize)
    key_format, k_flat = _key_operand(k_pages.reshape(P * page, D), k_scale, native_fp8)
    spec = _Spec(T, Hi, page, M * page, key_format, jnp.dtype(q.dtype), k_scale is not None)
    operands = [q, w, k_flat]
    if k_scale is not None:
        operands.append(k_scale.reshape(P * page).astype(jnp.float32))
    operands += [page_table.astype(jnp.int32), seq_ids.astype(jnp.int32), q_pos.astype(jnp.int32)]

    if T >= max(cfg.tile.block_t, cfg.tile_min_queries_per_seq * B):
        tile = cfg.tile
        kernel = functools.partial(_tile_kernel, spec=spec, block_t=tile.block_t, block_s=tile.block_s)
        grid = (pl.cdiv(spec.seq_len, tile.block_s), pl.cdiv(T, tile.block_t))
        params = compiler_params(tile.num_warps, tile.num_stages)
    else:
        row = cfg.row
        kernel = functools.partial(_row_kernel, spec=spec, block_s=row.block_s, steps=row.steps)
        grid = (pl.cdiv(spec.seq_len, row.steps * row.block_s), T)
        params = compiler_params(row.num_warps, row.num_stages)
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((T, spec.seq_len), jnp.float32),
        grid=grid,
        compiler_params=params,
        interpret=interpret,
        name="indexer_logits",
    )(*operands)


def _key_operand(k_flat, k_scale, native_fp8):
    """How the kernel reads keys, and the array it reads them from."""
    if k_scale is None:
        return "plain", k_flat
    if k_flat.dtype != jnp.float8_e4m3fn:
        raise ValueError(f"k_scale given, so keys must be float8_e4m3fn, got {k_flat.dtype}")
    if native_fp8 is None:
        native_fp8 = fp_decode() == "native"
    # Both fp8 paths load bytes: a masked load needs an ``other`` fill, which has no e4m3 constant.
    return ("e4m3" if native_fp8 else "e4m3_bits"), lax.bitcast_convert_type(k_flat, jnp.uint8)


def _e4m3_bits_to_f16(u8: jax.Array) -> jax.Array:
    """e4m3fn bytes -> float16 equal to the e4m3 value times 2**-8, with integer ops only.

    Moving the 4 exponent + 3 mantissa bits into float16's exponent/mantissa fields leaves the
    exponent bias 8 short (7 instead of 15): an exact factor 2**-8 for normal and subnormal codes
    alike. The NaN codes 0x7F/0xFF decode as +-480 * 2**-8 (scaled caches never hold NaN).
    """
    u = u8.astype(jnp.int32)
    bits = ((u & 0x80) << 8) | ((u & 0x7F) << 7)
    return lax.bitcast_convert_type(bits.astype(jnp.uint16), jnp.float16)


def _gather_keys(refs: _Refs, spec: _Spec, seq, s, valid):
    """Keys ``[n, D]`` (dot dtype) at logical positions ``s [n]`` of sequence ``seq``, and the per-key
    logit factor ``[n]`` (None for plain keys). Rows where ``valid`` is False read nothing."""
    page_ids = pltriton.load(
        refs.page_table.at[seq, jnp.where(valid, s // spec.page, 0)], mask=valid, other=0
    )
    rows = jnp.where(valid, page_ids * spec.page + s % spec.page, 0)
    cols = jnp.arange(refs.k.shape[1], dtype=jnp.int32)
    raw = pltriton.load(refs.k.at[rows[:, None], cols[None, :]], mask=valid[:, None], other=0)
    if spec.key_format == "e4m3":
        raw = lax.bitcast_convert_type(raw, jnp.float8_e4m3fn)
    elif spec.key_format == "e4m3_bits":
        raw = _e4m3_bits_to_f16(raw)
    keys = raw.astype(spec.dtype)
    if not spec.has_scale:
        return keys, None
    factor = pltriton.load(refs.scale.at[rows], mask=valid, other=0.0)
    if spec.key_format == "e4m3_bits":
        factor = factor * _E4M3_BITS_FACTOR
    return keys, factor


def _row_block(refs: _Refs, spec: _Spec, t, s0, block_s: int, steps: int = 1) -> None:
    """logits[t, s0 : s0 + steps * block_s] for one query against its own sequence's keys, one
    ``block_s`` dot per step (a loop, so Triton can prefetch the next step's gathers)."""
    seq = refs.seq_ids[t]
    pos = jnp.where(seq >= 0, refs.q_pos[t], -1)

    @pl.when(s0 <= pos)
    def _():
        q_t, w_t = _query_heads(refs, spec, t)  # [heads_pad, D], [heads_pad] f32

        def step(i, carry):
            s = s0 + i * block_s + jnp.arange(block_s, dtype=jnp.int32)
            in_row = s < spec.seq_len
            valid = (s <= pos) & in_row
            keys, factor = _gather_keys(refs, spec, jnp.maximum(seq, 0), s, valid)
            scores = pltriton.dot(keys, q_t, trans_b=True, precision=spec.precision)  # [block_s, heads_pad]
            logits = jnp.sum(jnp.maximum(scores, 0.0) * w_t[None, :], axis=1)
            if factor is not None:
                logits = logits * factor
            out = refs.out.at[t, pl.ds(s0 + i * block_s, block_s)]
            pltriton.store(out, jnp.where(valid, logits, _NEG_INF), mask=in_row)
            return carry

        lax.fori_loop(0, steps, step, 0)

    @pl.when(s0 > pos)
    def _():
        s = s0 + jnp.arange(steps * block_s, dtype=jnp.int32)
        fill = jnp.full((steps * block_s,), _NEG_INF, jnp.float32)
        pltriton.store(refs.out.at[t, pl.ds(s0, steps * block_s)], fill, mask=s < spec.seq_len)


def _query_heads(refs: _Refs, spec: _Spec, t):
    """Query ``t``'s heads and weights, padded with zero rows to ``spec.heads_pad`` (tensor-parallel
    shards of a 32-head indexer hold 4 or 8); a padded head's weight 0 drops it from the sum."""
    if spec.heads_pad == spec.num_heads:
        return refs.q[t], refs.w[t].astype(jnp.float32)
    heads = jnp.arange(spec.heads_pad, dtype=jnp.int32)
    ok = heads < spec.num_heads
    cols = jnp.arange(refs.q.shape[2], dtype=jnp.int32)
    q_t = pltriton.load(refs.q.at[t, heads[:, None], cols[None, :]], mask=ok[:, None], other=0)
    return q_t, pltriton.load(refs.w.at[t, heads], mask=ok, other=0).astype(jnp.float32)


def _row_kernel(*refs, spec: _Spec, block_s: int, steps: int) -> None:
    refs = _unpack(refs, spec)
    _row_block(refs, spec, pl.program_id(1), pl.program_id(0) * (steps * block_s), block_s, steps)


def _tile_kernel(*refs, spec: _Spec, block_t: int, block_s: int) -> None:
    refs = _unpack(refs, spec)
    t0 = pl.program_id(1) * block_t
    s0 = pl.program_id(0) * block_s
    t = t0 + jnp.arange(block_t, dtype=jnp.int32)
    t_ok = t < spec.num_queries
    seq = pltriton.load(refs.seq_ids.at[pl.ds(t0, block_t)], mask=t_ok, other=-1)
    pos = jnp.where(seq >= 0, pltriton.load(refs.q_pos.at[pl.ds(t0, block_t)], mask=t_ok, other=-1), -1)
    last = jnp.max(pos)
    seq_hi = jnp.max(seq)
    seq_lo = jnp.min(jnp.where(seq >= 0, seq, _INT32_MAX))
    s = s0 + jnp.arange(block_s, dtype=jnp.int32)
    in_row = s < spec.seq_len
    out = refs.out.at[pl.ds(t0, block_t), pl.ds(s0, block_s)]
    out_mask = t_ok[:, None] & in_row[None, :]

    @pl.when(s0 > last)
    def _():
        pltriton.store(out, jnp.full((block_t, block_s), _NEG_INF, jnp.float32), mask=out_mask)

    @pl.when((s0 <= last) & (seq_lo == seq_hi))
    def _():
        keys, factor = _gather_keys(refs, spec, seq_hi, s, (s <= last) & in_row)

        # Keys are the loop-invariant A operand and each head's queries the streamed B operand,
        # the flash-attention pattern: scores and accumulator are [block_s, block_t].
        def head(h, acc):
            q_h = pltriton.load(refs.q.at[pl.ds(t0, block_t), h, :], mask=t_ok[:, None], other=0)
            w_h = pltriton.load(refs.w.at[pl.ds(t0, block_t), h], mask=t_ok, other=0).astype(jnp.float32)
            scores = pltriton.dot(keys, q_h, trans_b=True, precision=spec.precision)
            return acc + jnp.maximum(scores, 0.0) * w_h[None, :]

        acc = lax.fori_loop(0, spec.num_heads, head, jnp.zeros((block_s, block_t), jnp.float32))
        if factor is not None:
            acc = acc * factor[:, None]
        logits = jnp.where(s[:, None] <= pos[None, :], acc, _NEG_INF).T
        pltriton.store(out, logits, mask=out_mask)

    @pl.when((s0 <= last) & (seq_lo != seq_hi))
    def _():
        def one_query(j, carry):
            pl.when(t0 + j < spec.num_queries)(lambda: _row_block(refs, spec, t0 + j, s0, block_s))
            return carry

        lax.fori_loop(0, block_t, one_query, 0)


def _unpack(refs, spec: _Spec) -> _Refs:
    if spec.has_scale:
        return _Refs(*refs)
    q, w, k, *rest = refs
    return _Refs(q, w, k, None, *rest)
