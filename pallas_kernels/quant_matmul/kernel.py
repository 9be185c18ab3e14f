"""Pallas-Triton ``quant_matmul``: ``x @ W`` with W kept quantized and dequantized tile by tile.

Grid (M tiles, N tiles, K splits). A program walks its share of K in ``block_k`` steps: it reads
the weight's codes and the scale (and zero-point) rows of the step
(:func:`pallas_kernels.quant.tiles.pieces`), dequantizes them in registers to the activations' dtype
and multiplies them with the matching activation columns, accumulating in float32. Weight bytes are
read from HBM once per M tile, so decode (one M tile) is a pure weight stream at the codes' width: 4
or 8 bits per weight instead of 16. With several K splits each program writes a float32 partial sum
and one XLA fusion adds them.

Activation rows past M are masked on load (``other = 0``); the output is padded to whole M tiles,
so every store is in bounds and unmasked, and the padding is sliced off outside.

``layer``: W is a stack ``[L, K, N]`` of scanned layers' weights, read in place at that (traced)
layer (:func:`pallas_kernels.quant.tiles.operands`), so a scan over layers never copies a layer's
weight out of the stack for the kernel.

GEMV (a config with ``gemv``; :mod:`.tuning` chooses it up to ``gemv_max_m`` rows, off until
measured): a matrix-vector kernel for decode-sized M, with no ``tl.dot``. At M = 1 the tensor-core
kernel runs at a quarter to a third of HBM bandwidth (H200: INT4 ``o_proj``, K = 8192, N = 6144, 23
us for ~31 MB that need ~8): its 16-row MMA tile multiplies 15 padding rows, and every K step's
dequantized tile must first be converted into the MMA operand layout, a round trip through shared
memory between barriers, before a dot too small to hide it. The GEMV kernel multiplies the decoded
weights in the layout they were decoded in (only the few activation columns are broadcast to it):
grid (N tiles, K splits), every row in one program; each weight piece times its activation columns
is added elementwise into one float32 accumulator ``[piece rows, block_n]`` per row, reduced over K
once after the loop (no cross-thread reduction inside it). bf16 activations' products with bf16
weights are exact in float32, so it sums the same products as the tensor cores; float32 activations
get float32 products. Same output contract (float32 partial sums per K split, added by one XLA op),
same multi-weight launches and layer stacks.

Design notes and measurements: the kernel notes (docs/kernels.md §6).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels._triton import compiler_params, dot_precision, pl, pltriton
from pallas_kernels.quant import layout, tiles
from pallas_kernels.quant.decode import fp_decode
from pallas_kernels.quant.decode import int4_decode as int4_mode
from pallas_kernels.quant.layout import QuantizedWeight
from pallas_kernels.quant_matmul import ref, tuning


def _each_weight(w_refs, j, tile, *, specs, counts, tiles_at) -> None:
    """``tile(spec, refs, first)`` for the weight whose N tiles hold output tile ``j`` (weight ``w``'s:
    ``tiles_at[w]`` up to ``tiles_at[w + 1]``; ``first``: its first tile), given all the weights'
    refs (``counts[w]`` each). The weights' columns sit side by side in the one output, so tile
    ``j`` is stored at column ``j * block_n``."""
    start = 0
    for w, (spec, count) in enumerate(zip(specs, counts)):
        refs_w, start = w_refs[start : start + count], start + count
        if len(specs) == 1:
            tile(spec, refs_w, 0)
        else:
            inside = (j >= tiles_at[w]) & (j < tiles_at[w + 1])
            pl.when(inside)(functools.partial(tile, spec, refs_w, tiles_at[w]))


def _kernel(x_ref, *refs, specs, counts, tiles_at, block_m, block_n, block_k, steps, m_total, precision):
    """One program: the ``[block_m, block_n]`` output tile ``j`` over K split ``split``
    (:func:`_each_weight`)."""
    w_refs, (o_ref,) = refs[: sum(counts)], refs[sum(counts) :]
    i, j, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    m0 = pl.multiple_of(i * block_m, block_m)
    rows = m0 + jnp.arange(block_m, dtype=jnp.int32)
    valid = rows < m_total
    safe = jnp.where(valid, rows, 0)

    def tile(spec, refs, first: int) -> None:
        lead, refs = tiles.layer_lead(spec, refs)
        n0 = pl.multiple_of((j - first) * block_n, block_n)

        def step(t, acc):
            k0 = pl.multiple_of((split * steps + t) * block_k, block_k)
            for offset, length, w in tiles.pieces(spec, refs, lead, k0, n0, block_k, block_n, x_ref.dtype):
                cols = k0 + offset + jnp.arange(length, dtype=jnp.int32)
                xs = pltriton.load(x_ref.at[safe[:, None], cols[None, :]], mask=valid[:, None], other=0)
                acc += jnp.dot(xs, w, preferred_element_type=jnp.float32, precision=precision)
            return acc

        acc = jax.lax.fori_loop(0, steps, step, jnp.zeros((block_m, block_n), jnp.float32))
        column = pl.multiple_of(j * block_n, block_n)
        o_ref[split, pl.ds(m0, block_m), pl.ds(column, block_n)] = acc.astype(o_ref.dtype)

    _each_weight(w_refs, j, tile, specs=specs, counts=counts, tiles_at=tiles_at)


def _gemv_kernel(x_ref, *refs, specs, counts, tiles_at, rows, block_n, block_k, steps):
    """One GEMV program (module docstring): output columns ``j * block_n ...`` of all ``rows`` rows
    over K split ``split`` (:func:`_each_weight`). One accumulator per row: M is a few rows, and
    each accumulator is one piece's size (32 rows for 4-bit weights)."""
    w_refs, (o_ref,) = refs[: sum(counts)], refs[sum(counts) :]
    j, split = pl.program_id(0), pl.program_id(1)

    def tile(spec, refs, first: int) -> None:
        lead, refs = tiles.layer_lead(spec, refs)
        n0 = pl.multiple_of((j - first) * block_n, block_n)

        def step(t, accs):
            k0 = pl.multiple_of((split * steps + t) * block_k, block_k)
            accs = list(accs)
            for offset, length, w in tiles.pieces(spec, refs, lead, k0, n0, block_k, block_n, x_ref.dtype):
                w = w.astype(jnp.float32)
                for r in range(rows):
                    xs = x_ref[r, pl.ds(k0 + offset, length)].astype(jnp.float32)
                    accs[r] += w * xs[:, None]
            return tuple(accs)

        zero = jnp.zeros((tiles.piece_rows(spec, block_k), block_n), jnp.float32)
        accs = jax.lax.fori_loop(0, steps, step, (zero,) * rows)
        column = pl.multiple_of(j * block_n, block_n)
        for r, acc in enumerate(accs):
            o_ref[split, r, pl.ds(column, block_n)] = jnp.sum(acc, axis=0).astype(o_ref.dtype)

    _each_weight(w_refs, j, tile, specs=specs, counts=counts, tiles_at=tiles_at)


def quant_matmul(
    x: jax.Array,
    w: QuantizedWeight,
    *,
    layer: jax.Array | None = None,
    interpret: bool = False,
    decode: str | None = None,
    config: tuning.QmmConfig | None = None,
    int4_decode: str | None = None,
    dequantize_first: bool | None = None,
) -> jax.Array:
    """``x [M, K] @ W [K, N] -> [M, N]`` in x's dtype (bf16 or float32), W dequantized in the kernel to
    x's dtype, float32 accumulation. ``decode``: 'native' / 'software' e4m3 decoding (default:
    :func:`pallas_kernels.quant.decode.fp_decode`); ``int4_decode``: 'f32' / 'bf16' / 'ptx' INT4
    arithmetic (default: :func:`pallas_kernels.quant.decode.int4_decode`); ``config`` overrides the
    tuning table (benchmark sweeps; one with ``gemv=True`` takes the GEMV kernel). An N that is not a
    multiple of 16 (a tiny model's 136-wide ``kv_a``) is padded with zero columns, sliced off the
    result; an FP8 weight's K likewise with zero rows (and x with zero columns: a tiny V4's 40-wide
    ``q_lora``). 4-bit weights' K is whole packed chunks (32 or 64 rows) by their layout.
    ``dequantize_first``: dequantize W in XLA and multiply with XLA's dot instead of the kernel
    (default: from the tuning table's row count on, :func:`.tuning.dequantize_first`). ``layer``
    (int32 scalar, may be traced): W is a stack ``[L, K, N]`` read at that layer in place (a weight
    that needs padding is sliced first: padding copies it anyway; dequantizing first reads only
    that layer's slice)."""
    if tuning.dequantize_first(x.shape[0]) if dequantize_first is None else dequantize_first:
        return ref.quant_matmul(x, w, layer=layer)  # the definition is also the fastest prefill path
    k, n = x.shape[-1], w.shape[-1]
    if layer is not None and (k % 16 or n % 16):
        w, layer = layout.take_layer(w, layer), None
    w = layout.pad_n(w, -(-n // 16) * 16)
    if k % 16:
        x, w = jnp.pad(x, ((0, 0), (0, -k % 16))), layout.pad_k(w, -(-k // 16) * 16)
    (out,) = _quant_matmul(
        x,
        (w,),
        layer,
        interpret=interpret,
        decode=fp_decode(decode),
        config=config or group_config(x.shape[0], (w,), x.dtype),
        int4=int4_mode(int4_decode, interpret=interpret),
    )
    return out if out.shape[-1] == n else out[:, :n]


def quant_matmul_many(
    x: jax.Array,
    ws: tuple[QuantizedWeight, ...],
    *,
    layer: jax.Array | None = None,
    interpret: bool = False,
    decode: str | None = None,
    int4_decode: str | None = None,
) -> tuple[jax.Array, ...]:
    """``(x @ W_1, x @ W_2, ...)``: projections of the same activations (MLA's ``q_a`` and ``kv_a``, a
    shared expert's gate and up) in one launch, each program computing one tile of one weight. One
    kernel instead of several matters at decode, where each is a few microseconds of latency and a
    launch. Weights of one format and packing whose widths are multiples of 16 go together (K as
    well); anything else, or prefill-sized M (:func:`.tuning.dequantize_first`), is computed one
    weight at a time by :func:`quant_matmul`, with the same results."""
    k = x.shape[-1]
    alone = functools.partial(
        quant_matmul, layer=layer, interpret=interpret, decode=decode, int4_decode=int4_decode
    )
    if len(ws) == 1 or not groupable(x.shape[0], k, ws):
        return tuple(alone(x, w) for w in ws)
    return _grouped(x, ws, layer, interpret, decode, int4_decode, partials=False)


def quant_matmul_partials(
    x: jax.Array,
    ws: tuple[QuantizedWeight, ...],
    *,
    layer: jax.Array | None = None,
    interpret: bool = False,
    decode: str | None = None,
    int4_decode: str | None = None,
) -> jax.Array | None:
    """:func:`quant_matmul_many`'s one launch before the sum over its K splits: ``[S, R, N_1 + N_2 +
    ...]`` (float32 partial products; the activations' dtype when S = 1), the weights' columns side
    by side, ``R >= M`` rows padded to the row tile (the first M are x's: a slice of them would be
    a launch of its own); None where the weights do not group (:func:`groupable`). For a kernel that
    adds the splits itself and goes on with the rows (``pallas_kernels.mla_latent``,
    ``pallas_kernels.mla_query``), saving the sum's launch."""
    if not groupable(x.shape[0], x.shape[-1], ws):
        return None
    return _grouped(x, ws, layer, interpret, decode, int4_decode, partials=True)


def _grouped(x, ws, layer, interpret: bool, decode, int4_decode, *, partials: bool):
    """One launch over the groupable weights ``ws``: their products, or (``partials``) the unsummed
    K-split products."""
    return _quant_matmul(
        x,
        tuple(ws),
        layer,
        interpret=interpret,
        decode=fp_decode(decode),
        config=group_config(x.shape[0], tuple(ws), x.dtype),
        int4=int4_mode(int4_decode, interpret=interpret),
        partials=partials,
    )


def groupable(m: int, k: int, ws: tuple[QuantizedWeight, ...]) -> bool:
    """Whether ``ws`` can share one :func:`quant_matmul_many` launch for ``m`` rows of width ``k``."""
    first = ws[0]
    return (
        not tuning.dequantize_first(m)
        and k % 16 == 0
        and all(w.shape[-1] % 16 == 0 and w.shape[-2] == k for w in ws)
        and all((w.format, w.kpack, w.packed) == (first.format, first.kpack, first.packed) for w in ws)
    )


def default_config(m: int, w: QuantizedWeight, dtype, *, gemv: bool | None = None) -> tuning.QmmConfig:
    """The tuning table's config for ``x [m, K]`` of ``dtype`` times ``w`` (what the kernel uses when
    given none; benchmark sweeps start from it). ``gemv``: the table's GEMV (True) or tensor-core
    (False) config at any ``m``; None: the table's (and ``$JAXDSA_QMM_GEMV_MAX_M``'s) choice."""
    return group_config(m, (w,), dtype, gemv=gemv)


def group_config(
    m: int, ws: tuple[QuantizedWeight, ...], dtype, *, gemv: bool | None = None
) -> tuning.QmmConfig:
    """The config of one launch over weights ``ws`` of one format (:func:`quant_matmul_many`): the
    table's choice for their summed width, a ``block_n`` dividing each width, K splits for the
    programs of all of them. ``gemv`` as in :func:`default_config`."""
    k, n = ws[0].shape[-2], sum(w.shape[-1] for w in ws)
    cfg = tuning.choose(
        m,
        k,
        n,
        itemsize=jnp.dtype(dtype).itemsize,
        weight_bits=4 if ws[0].packed else 8,
        min_block_k=max(ws[0].kpack, 16),
        gemv=gemv,
    )
    if len(ws) == 1:
        return cfg
    block_n = min(tuning.fit_block(cfg.block_n, w.shape[-1], 16, "N") for w in ws)
    programs = cfg.m_tiles(m) * sum(w.shape[-1] // block_n for w in ws)
    return dataclasses.replace(cfg, block_n=block_n, splits=tuning.splits_for(programs, k // cfg.block_k))


@functools.partial(jax.jit, static_argnames=("interpret", "decode", "config", "int4", "partials"))
def _quant_matmul(
    x, ws, layer, *, interpret: bool, decode: str, config: tuning.QmmConfig, int4: str, partials: bool = False
):
    m, k = x.shape
    specs, arrays = [], []
    for w in ws:
        if len(w.shape) != (2 if layer is None else 3):
            raise ValueError(f"quant_matmul: a weight of shape {w.shape} with layer={layer}")
        if w.shape[-2] != k:
            raise ValueError(f"quant_matmul: x has K = {k}, the weight {w.shape[-2]}")
        spec, operands = tiles.operands(w, decode, int4, layer, interpret=interpret)
        specs.append(spec)
        arrays.append(operands)
    min_block_k = max(specs[0].kpack, 16)
    widths = [w.shape[-1] for w in ws]
    block_n = min(tuning.fit_block(config.block_n, n, 16, "N") for n in widths)
    block_k = tuning.fit_block(max(config.block_k, min_block_k), k, min_block_k, "K")
    steps = k // block_k // config.splits
    if steps * config.splits * block_k != k:
        raise ValueError(f"{config.splits} K splits do not divide {k // block_k} steps of {block_k}")
    tiles_at = tuple(int(t) for t in np.cumsum([0, *(n // block_n for n in widths)]))
    dtype = x.dtype if config.splits == 1 else jnp.float32
    shared = dict(
        specs=tuple(specs),
        counts=tuple(len(a) for a in arrays),
        tiles_at=tiles_at,
        block_n=block_n,
        block_k=block_k,
        steps=steps,
    )
    if config.gemv:  # every row in one program: the output has exactly M rows
        body = functools.partial(_gemv_kernel, rows=m, **shared)
        rows, grid = m, (tiles_at[-1], config.splits)
    else:
        m_tiles = config.m_tiles(m)
        precision = dot_precision(x.dtype)
        body = functools.partial(_kernel, block_m=config.block_m, m_total=m, precision=precision, **shared)
        rows, grid = m_tiles * config.block_m, (m_tiles, tiles_at[-1], config.splits)
    out = pl.pallas_call(
        body,
        out_shape=jax.ShapeDtypeStruct((config.splits, rows, sum(widths)), dtype),
        grid=grid,
        compiler_params=compiler_params(config.num_warps, config.num_stages),
        interpret=interpret,
        name="quant_matmul",
    )(x, *(a for operands in arrays for a in operands))
    if partials:
        return out
    # one sum over the K splits for all the weights; their columns sliced apart after it
    out = out.sum(axis=0)[:m].astype(x.dtype) if config.splits > 1 else out[0, :m]
    return tuple(out[:, a * block_n : b * block_n] for a, b in zip(tiles_at, tiles_at[1:]))
