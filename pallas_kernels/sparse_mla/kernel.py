"""Pallas-Triton sparse MLA: attention of absorbed queries over gathered latent-cache rows.

Math (per query t, head h, over the selected rows r = kv[indices[t, j]]): scores
``sm_scale * q[t,h] . r`` over the full row; values are the first ``v_dim`` columns of the same
rows; online softmax in float32 (base 2, ``log2(e)`` folded into the scale).

Layout. A float row is split into its value part (``v_dim`` columns) and its rope part (the
rest); each part is padded to a power of two (Triton tiles must be powers of two) with column
masks, so 576 = 512 + 64 takes the unmasked fast path and e.g. the tiny models' 136 = 128 + 8 works
with masks. Scores are one dot per value column group plus one for the rope part; the value
tiles are reused for P.V, one float32 accumulator per group. Float rows are one group, FP8 rows
one per scale tile (below).

FP8 cache. With ``kv_scale`` the rows are :mod:`pallas_kernels.quant.kv_fp8`'s three latent
arrays: ``kv`` the e4m3 values ``[Z, C]``, ``kv_scale`` ``[Z, S]`` (one scale per ``tile = C / S``
values: float32, or ue8m0 exponent bytes as uint8), ``kv_rope`` the bf16 rope part ``[Z, D - C]``.
Two formats use them: GLM's ``DS_MLA`` (C = 512, tiles of 128, float32 scales, ``V`` = the e4m3
part: ``v_dim = C``) and DeepSeek-V4's ``MODEL1`` (C = 448, tiles of 64, ue8m0 scales; the tiny
test models' C = 24 is one tile of 24; ``K = V`` = the whole row: ``v_dim = D``, so the rope tile
is a value group too, with its own float32 accumulator and output columns C..D). They are decoded
in-kernel from the gathered rows (never a dequantized copy of the cache): the e4m3 part as ``S``
groups of ``tile`` columns, each a contiguous ``[block_n, tile]`` byte tile (padded to a power of
two with column masks, as 24 -> 32; the e4m3 array is bitcast to uint8 in XLA, a free same-size
bitcast: a masked load needs an ``other`` fill, and there is no e4m3 constant) whose scale is one
per row, a ``[block_n]`` gathered load from the flattened scales broadcast over the tile (ue8m0
bytes become float32 by moving the byte into the exponent field, :func:`_e8m0_scale`); the rope
is a ``[block_n, Pr]`` bf16 tile, loaded as the float rows' rope tile is. Every value is
dequantized as :func:`pallas_kernels.quant.kv_fp8.dequantize_latent` does it: e4m3 to float32,
times its float32 scale in float32, then cast to q's dtype for the dots (float32 queries see the
reference's rows exactly; bf16 rounds once, as casting the dequantized row would).
The e4m3 decode is the hardware cast ("native", sm_89+) or integer bit moves into float16
(:func:`_e4m3_software`; sm_80/86, the interpreter), chosen by
:func:`pallas_kernels.quant.decode.fp_decode` at trace time or per call; the two agree on all 254
finite codes, but the software decode reads the NaN codes 0x7F / 0xFF as +-480 (scaled caches
never hold NaN). Measured on H200 with GLM's rows (``benchmarks/results/kernels_mla_fp8-h200.md``, decode,
top-2048, 8k context): right with both decoders, but still 1.3-2.2x the time of bf16 rows at
B >= 8 (5-15 % of the memory ceiling against 14-45 %), little better than the one-record layout
it replaced (H = 16 B = 128: 296 vs 379 us; H = 64 B = 64: 219 vs 228 us). The decode does not bound
it: at H = 16 B = 128 an integer-to-float cast in place of the e4m3 decode, no scales, or the codes
converted straight to bf16 take 321 / 371 / 398 us against 306. Triton's pipeliner does not
multi-buffer the tiles that pass through the decode (a third stage adds 768 bytes of shared
memory, not a stage of tiles), so each step waits for its own gathers; the tile config moves it
most (4 warps: 204 us there). Hence, with ``prefetch``, FP8 rows are software-pipelined by hand: the
loop carry holds the next step's raw gathered parts (code tiles, scales, rope tile and their row
mask) and the indices of the step after, so step i issues step i + 1's gathers before it decodes
and multiplies step i's rows (:func:`_gather_fp8` / :func:`_decode_fp8`); the carried bytes live in
registers (``block_n`` rows of 656 bytes per program for GLM, 583 for DeepSeek-V4, whose scales
travel as their ue8m0 bytes). Float rows keep the loop as it was (``prefetch``
carries their next indices only; their row loads feed the dots and Triton's pipeliner stages them).
It pays only where a program must hide its own gathers and has the registers (H200, 64k context):
16 heads in one wave (H = 16 B = 32: 62 us, bf16 rows 60, without it 83) and 32-head blocks; not
64-head blocks (a 128 KiB accumulator: 667 vs 360 us at B = 128), nor two waves of 16-head programs,
where 4 warps without it let two programs per SM cover each other (H = 16 B = 128: 187 us against
254 with it, 306 at b12e627, bf16 rows 161). :func:`.tuning.fp8_adjust` chooses accordingly.

Grid ``(head_groups, splits, T)``, head group fastest so the programs sharing one query's rows
run side by side (the second read of a row hits L2). Each program:

1. loads its query tiles (one per value group, one rope) once;
2. walks its chunk of the index list ``block_n`` at a time: loads the indices, masks -1 and
   out-of-range slots, gathers the rows with masked pointer loads (skipped rows cost no
   traffic; duplicates are just two rows), ``S = q.r^T`` (f32 accumulate), online softmax,
   ``acc += P.r[:, :Dv]``;
3. with one split, normalises, folds in the sink and writes ``out``/``lse``; with several, writes
   ``(out, lse)`` partials (outputs in float32, or in the query dtype with ``narrow_partials``:
   half the bytes written and merged at B = 1, where they rival the gathered rows) that
   :func:`pallas_kernels.merge_states.kernel.merge_states` combines (the sink joins there, once).

Split count, head block and tile sizes come from :mod:`.tuning` (per compute capability and
operand dtype: float32 tiles are sized to fit the same shared memory as bf16 ones; fp8 rows count
their three parts' bytes per stage and the decoded value tile as resident; DeepSeek-V4's rows take
the rules measured on GLM's).

Design notes and measurements: the kernel notes (docs/kernels.md §1).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import operator
import warnings

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels._triton import compiler_params, pl, pltriton, tile_pad
from pallas_kernels.merge_states.kernel import apply_sink, merge_states
from pallas_kernels.quant.decode import fp_decode
from pallas_kernels.sparse_mla import ref, tuning
from pallas_kernels.sparse_mla.tuning import MlaConfig

_LOG2E = math.log2(math.e)
_LN2 = math.log(2.0)
_MAX_ROW_PAD = 1024  # padded value + rope columns per head; wider q tiles and accumulators spill


@dataclasses.dataclass(frozen=True)
class _Geometry:
    """Static shape facts the kernel body specialises on."""

    n_heads: int
    n_keys: int
    n_slots: int
    d_c: int  # the row's first part: a float row's value columns, an FP8 row's e4m3 columns
    d_r: int  # rope columns (the rest of the row); 0 when the first part is the whole row
    chunk: int  # indices per split (a multiple of block_n)
    block_h: int
    block_n: int
    prefetch: bool  # load step i+1's indices while step i's rows are gathered
    fp8: str | None = None  # FP8 latent parts, e4m3 decoded "native" / "software"; None: float rows
    tile: int = 0  # FP8 e4m3 values per scale
    rope_value: bool = False  # the rope part is a value group too (FP8 rows with V = K: DeepSeek-V4)

    @property
    def d_r_pad(self) -> int:
        return tile_pad(self.d_r) if self.d_r else 0

    @property
    def groups(self) -> tuple[tuple[int, int, int], ...]:
        """``(first column, width, padded width)`` of each group of the first part: one scale tile
        each for FP8 values, the whole value part of a float row."""
        return _groups(self.d_c, self.tile if self.fp8 else self.d_c)

    @property
    def out_groups(self) -> tuple[tuple[int, int, int], ...]:
        """The value column groups, one float32 accumulator each: :attr:`groups`, then the rope part
        where it is a value (its output columns follow the e4m3 ones)."""
        rope = ((self.d_c, self.d_r, self.d_r_pad),) if self.rope_value else ()
        return self.groups + rope

    @property
    def rope_col(self) -> int:
        """The rope part's first column in the array that holds it: its own array for FP8, after the
        value columns of a float row."""
        return 0 if self.fp8 else self.d_c


def _groups(width: int, tile: int) -> tuple[tuple[int, int, int], ...]:
    """``(first column, tile, padded tile)`` of the ``width / tile`` groups of ``tile`` columns."""
    return tuple((c, tile, tile_pad(tile)) for c in range(0, width, tile))


def _load_tile(src, rows, row_ok, col0: int, width: int, width_pad: int):
    """``src[rows, col0 : col0 + width]`` as a ``[len(rows), width_pad]`` tile, zeros where masked.

    Fully broadcast array indexers: one pointer tensor on GPU, and the form whose masked load the
    interpreter supports. The column mask only appears when the width is padded, so the real
    576-wide rows keep an all-row mask that Triton can vectorise along columns.
    """
    j = jnp.arange(width_pad, dtype=jnp.int32)
    mask = row_ok[:, None]
    if width_pad != width:
        mask = mask & (j < width)[None, :]
    return pltriton.load(src.at[rows[:, None], (col0 + j)[None, :]], mask=mask, other=0)


def _e4m3_software(u8: jax.Array) -> jax.Array:
    """e4m3fn bytes -> float32 with integer ops: ``(u + (u & 0x80)) << 7`` moves the sign to bit 15
    and the 4 exponent + 3 mantissa bits to float16's, the value times 2^-8 (the exponent bias is 8
    short) for normal and subnormal codes alike; times 256 in float16 is exact (|e4m3| <= 448).
    The NaN codes 0x7F / 0xFF come out as +-480 (:func:`pallas_kernels.quant.decode.e4m3_to_f32`
    keeps them NaN at the cost of a select per value)."""
    u = u8.astype(jnp.int32)
    half = lax.bitcast_convert_type(((u + (u & 0x80)) << 7).astype(jnp.uint16), jnp.float16)
    return (half * jnp.float16(256.0)).astype(jnp.float32)


def _e8m0_scale(e: jax.Array) -> jax.Array:
    """ue8m0 bytes -> float32 ``2^(e - 127)``: the byte moved into float32's exponent field, as
    :func:`pallas_kernels.quant.kv_fp8.decode_scales` reads them (e = 0 gives 0, e = 255 inf; the
    writer stores neither)."""
    return lax.bitcast_convert_type(e.astype(jnp.int32) << 23, jnp.float32)


def _gather_fp8(kv_ref, scale_ref, rope_ref, rows, ok, g: _Geometry) -> tuple:
    """The raw FP8 parts of the gathered rows, undecoded: one ``[block_n, tile]`` code tile (uint8)
    and one ``[block_n]`` scale (float32, or ue8m0 bytes: a quarter of the carried registers) per
    scale group, and the ``[block_n, Pr]`` rope tile (None without rope). With ``prefetch`` these
    travel through the loop carry, loaded a step ahead."""
    codes, scales, zero = [], [], 0.0 if scale_ref.dtype == jnp.float32 else 0
    for group, (c, w, wp) in enumerate(g.groups):
        scales.append(pltriton.load(scale_ref.at[rows * len(g.groups) + group], mask=ok, other=zero))
        codes.append(_load_tile(kv_ref, rows, ok, c, w, wp))
    rope = _load_tile(rope_ref, rows, ok, g.rope_col, g.d_r, g.d_r_pad) if g.d_r else None
    return codes, scales, rope


def _decode_fp8(codes, scales, g: _Geometry, dtype) -> list[jax.Array]:
    """:func:`_gather_fp8`'s code tiles as operand tiles in ``dtype``: e4m3 to float32, times the
    row's scale in float32."""
    tiles = []
    for code, scale in zip(codes, scales, strict=True):
        if scale.dtype == jnp.uint8:
            scale = _e8m0_scale(scale)
        if g.fp8 == "native":
            values = lax.bitcast_convert_type(code, jnp.float8_e4m3fn).astype(jnp.float32)
        else:
            values = _e4m3_software(code)
        tiles.append((values * scale[:, None]).astype(dtype))
    return tiles


def _load_values(kv_ref, scale_ref, rows, ok, g: _Geometry, dtype) -> list[jax.Array]:
    """The value part of the gathered rows as one ``[block_n, width]`` tile per group, in ``dtype``:
    float rows cast; FP8 codes decoded, each group times its row's scale (``scale_ref``: the
    ``[Z * groups]`` flattened scales) in float32."""
    if not g.fp8:
        return [_load_tile(kv_ref, rows, ok, c, w, wp).astype(dtype) for c, w, wp in g.groups]
    codes, scales, _ = _gather_fp8(kv_ref, scale_ref, None, rows, ok, dataclasses.replace(g, d_r=0))
    return _decode_fp8(codes, scales, g, dtype)


def _kernel(*refs, g: _Geometry, sm_scale: float, has_sink: bool, precision):
    idx_ref, q_ref, kv_ref, *rest, out_ref, lse_ref = refs
    scale_ref = sink_ref = None
    rope_ref = kv_ref  # float rows: the rope columns follow the value columns
    if g.fp8:
        scale_ref, *rest = rest
        if g.d_r:
            rope_ref, *rest = rest
    if has_sink:
        (sink_ref,) = rest
    dtype = q_ref.dtype
    heads = pl.program_id(0) * g.block_h + jnp.arange(g.block_h, dtype=jnp.int32)
    head_ok = heads < g.n_heads
    start = pl.program_id(1) * g.chunk
    dot = functools.partial(lax.dot_general, preferred_element_type=jnp.float32, precision=precision)
    nt = (((1,), (1,)), ((), ()))  # a @ b.T
    nn = (((1,), (0,)), ((), ()))  # a @ b

    q_v = [_load_tile(q_ref, heads, head_ok, c, w, wp) for c, w, wp in g.groups]
    if g.d_r:
        q_r = _load_tile(q_ref, heads, head_ok, g.d_c, g.d_r, g.d_r_pad)

    def load_indices(i):
        pos = start + i * g.block_n + jnp.arange(g.block_n, dtype=jnp.int32)
        return pltriton.load(idx_ref.at[pos], mask=pos < g.n_keys, other=-1)

    def update(m, row_sum, acc, valid, values, rope):
        """One step of the online softmax over gathered rows: scores, rescale, ``acc += P.V``
        (``rope``: a callable giving the rope tile, traced after the value dots; with
        ``rope_value`` it is the last value group too)."""
        s = functools.reduce(operator.add, [dot(qg, vg, nt) for qg, vg in zip(q_v, values, strict=True)])
        if g.d_r:
            rope_tile = rope()
            s = s + dot(q_r, rope_tile, nt)
            if g.rope_value:
                values = [*values, rope_tile]
        s = jnp.where(valid[None, :], s * (sm_scale * _LOG2E), -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        m_ref = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # no valid key yet: keep exp2 finite
        alpha = jnp.exp2(m - m_ref)
        p = jnp.exp2(s - m_ref[:, None])
        pd = p.astype(dtype)
        acc = [a * alpha[:, None] + dot(pd, vg, nn) for a, vg in zip(acc, values, strict=True)]
        return m_new, row_sum * alpha + jnp.sum(p, axis=1), acc

    def rows_of(idx):
        valid = (idx >= 0) & (idx < g.n_slots)
        return jnp.where(valid, idx, 0), valid

    def step(i, carry):
        if g.prefetch:  # this step's indices came with the carry; fetch the next step's now
            m, row_sum, acc, idx = carry
            nxt = load_indices(i + 1)
        else:
            m, row_sum, acc = carry
            idx = load_indices(i)
        safe, valid = rows_of(idx)
        values = _load_values(kv_ref, scale_ref, safe, valid, g, dtype)
        rope = lambda: _load_tile(rope_ref, safe, valid, g.rope_col, g.d_r, g.d_r_pad).astype(dtype)  # noqa: E731
        out = update(m, row_sum, acc, valid, values, rope)
        return (*out, nxt) if g.prefetch else out

    n_steps = g.chunk // g.block_n

    def fp8_step(i, carry):
        """FP8 rows with ``prefetch``: the carry holds this step's raw gathered parts (loaded by the
        previous step) and the next step's indices; step i + 1's gathers (and step i + 2's indices)
        are issued before step i's decode and dots, so their latency hides behind this step's work
        (Triton multi-buffers only loads that feed a dot directly, not these)."""
        m, row_sum, acc, valid, raw, nxt_idx = carry
        nxt_safe, nxt_valid = rows_of(nxt_idx)
        nxt_valid = nxt_valid & (i + 1 < n_steps)  # past the chunk: no traffic
        nxt_raw = _gather_fp8(kv_ref, scale_ref, rope_ref, nxt_safe, nxt_valid, g)
        after = load_indices(i + 2)
        codes, scales, rope = raw
        values = _decode_fp8(codes, scales, g, dtype)
        out = update(m, row_sum, acc, valid, values, lambda: rope.astype(dtype))
        return (*out, nxt_valid, nxt_raw, after)

    init = (
        jnp.full((g.block_h,), -jnp.inf, jnp.float32),
        jnp.zeros((g.block_h,), jnp.float32),
        [jnp.zeros((g.block_h, wp), jnp.float32) for _, _, wp in g.out_groups],
    )
    if g.fp8 and g.prefetch:
        safe, valid = rows_of(load_indices(0))
        raw = _gather_fp8(kv_ref, scale_ref, rope_ref, safe, valid, g)
        init = (*init, valid, raw, load_indices(1))
        body = fp8_step
    elif g.prefetch:
        init = (*init, load_indices(0))
        body = step
    else:
        body = step
    m, row_sum, acc = lax.fori_loop(0, n_steps, body, init)[:3]

    row_sum_safe = jnp.where(row_sum > 0, row_sum, 1.0)
    lse = jnp.where(row_sum > 0, m * _LN2 + jnp.log(row_sum_safe), -jnp.inf)
    if has_sink:  # only compiled in with a single split; otherwise the merge applies it
        sink = pltriton.load(sink_ref.at[heads], mask=head_ok, other=-jnp.inf)
        # the sink's factor on every value group's output: apply_sink of a [block_h, 1] tile of ones
        sink_factor, lse = apply_sink(jnp.ones((g.block_h, 1), jnp.float32), lse, sink)
    for (c, w, wp), a in zip(g.out_groups, acc, strict=True):
        out = a / row_sum_safe[:, None]
        if has_sink:
            out = out * sink_factor
        cols = c + jnp.arange(wp, dtype=jnp.int32)
        out_mask = head_ok[:, None]
        if wp != w:
            out_mask = out_mask & (cols < c + w)[None, :]
        pltriton.store(out_ref.at[heads[:, None], cols[None, :]], out.astype(out_ref.dtype), mask=out_mask)
    pltriton.store(lse_ref.at[heads], lse, mask=head_ok)


def _empty(t: int, h: int, v_dim: int, dtype, sink):
    lse = jnp.full((t, h), -jnp.inf, jnp.float32)
    if sink is not None:
        lse = jnp.broadcast_to(sink.astype(jnp.float32)[None, :], (t, h))
    return jnp.zeros((t, h, v_dim), dtype), lse


def _whole(shape: tuple[int, ...]) -> pl.BlockSpec:
    """The whole array in every program (rows are gathered by pointer)."""
    return pl.BlockSpec(shape, lambda hg, s, i: (0,) * len(shape))


def sparse_mla(
    q: jax.Array,
    kv: jax.Array,
    indices: jax.Array,
    *,
    sm_scale: float,
    sink: jax.Array | None = None,
    v_dim: int = 512,
    kv_scale: jax.Array | None = None,
    kv_rope: jax.Array | None = None,
    interpret: bool = False,
    config: MlaConfig | None = None,
    fp8_decode: str | None = None,
) -> tuple[jax.Array, jax.Array]:
    """See :func:`jaxdsa.ops.sparse_mla`.

    q [T, H, D], kv [Z, D] float rows, indices [T, K] int32 (-1 or >= Z: skipped), sink [H] f32 or
    None -> (out [T, H, v_dim] in q.dtype, lse [T, H] f32, natural log, sink included). With
    ``kv_scale`` the rows are FP8 latent parts (:mod:`pallas_kernels.quant.kv_fp8`): kv
    float8_e4m3fn [Z, C], kv_scale f32 or uint8 ue8m0 [Z, S] (one scale per C / S values), kv_rope
    bf16 [Z, D - C] (None when D == C), v_dim C (GLM) or D (DeepSeek-V4: the rope part is a value
    too); :func:`.ref.check_kv` checks them. ``config`` overrides :func:`.tuning.choose`
    (benchmark sweeps); ``fp8_decode`` ("native" / "software") overrides
    :func:`pallas_kernels.quant.decode.fp_decode` for FP8 rows.
    """
    t, h, d = q.shape
    n = kv.shape[0]
    if indices.ndim != 2 or indices.shape[0] != t:
        raise ValueError(f"sparse_mla: q {q.shape}, kv {kv.shape}, indices {indices.shape}, v_dim {v_dim}")
    k = indices.shape[1]
    ref.check_kv(kv, d, v_dim, kv_scale, kv_rope)
    fp8 = fp_decode(fp8_decode) if kv_scale is not None else None
    if t == 0 or h == 0 or k == 0 or n == 0:
        return _empty(t, h, v_dim, q.dtype, sink)
    d_c = kv.shape[1] if fp8 else v_dim  # the row's first part: e4m3 columns, or a float row's values
    d_r = d - d_c
    tile = d_c // kv_scale.shape[1] if fp8 else d_c
    if sum(wp for *_, wp in _groups(d_c, tile)) + (tile_pad(d_r) if d_r else 0) > _MAX_ROW_PAD:
        warnings.warn(
            f"sparse_mla: a {d}-wide row ({v_dim} value columns, groups of {tile}) pads past "
            f"{_MAX_ROW_PAD} columns per head, more than one program's registers hold; running the "
            "pure-JAX reference instead",
            stacklevel=2,
        )
        return ref.sparse_mla(
            q, kv, indices, sm_scale=sm_scale, sink=sink, v_dim=v_dim, kv_scale=kv_scale, kv_rope=kv_rope
        )

    # Dot operands are q's dtype: float rows are cast to it after the load, FP8 values decoded into it.
    itemsize = max(q.dtype.itemsize, kv.dtype.itemsize)
    fp8_rows = tuning.Fp8Rows(d_c, tile, kv_scale.dtype.itemsize) if fp8 else False
    cfg = config or tuning.choose(t, h, k, d_v=v_dim, d_r=d_r, itemsize=itemsize, fp8=fp8_rows)
    chunk = pl.cdiv(pl.cdiv(k, cfg.splits), cfg.block_n) * cfg.block_n
    splits = pl.cdiv(k, chunk)
    g = _Geometry(
        h, k, n, d_c, d_r, chunk, cfg.block_h, cfg.block_n, cfg.prefetch, fp8, tile, rope_value=v_dim > d_c
    )

    has_sink = sink is not None and splits == 1
    part_dtype = q.dtype if splits == 1 or cfg.narrow_partials else jnp.float32
    if fp8:  # bitcast and flatten: free in XLA
        rows = [lax.bitcast_convert_type(kv, jnp.uint8), kv_scale.reshape(-1), *([kv_rope] if g.d_r else [])]
    else:
        rows = [kv]
    args = [indices.astype(jnp.int32), q, *rows]
    in_specs = [
        pl.BlockSpec((None, k), lambda hg, s, i: (i, 0)),
        pl.BlockSpec((None, h, d), lambda hg, s, i: (i, 0, 0)),
        *(_whole(a.shape) for a in rows),
    ]
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
