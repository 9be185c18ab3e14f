"""Pallas-Triton ``quant_matmul``: ``x @ W`` with W kept quantized and dequantized tile by tile.

Grid (M tiles, N tiles, K splits). A program walks its share of K in ``block_k`` steps: it reads
the weight's codes and the scale (and zero-point) rows of the step (:func:`.tiles.pieces`),
dequantizes them in registers to the activations' dtype and multiplies them with the matching
activation columns, accumulating in float32. Weight bytes are read from HBM once per M tile, so
decode (one M tile) is a pure weight stream at the codes' width: 4 or 8 bits per weight instead of
16. With several K splits each program writes a float32 partial sum and one XLA fusion adds them.

Activation rows past M are masked on load (``other = 0``); the output is padded to whole M tiles,
so every store is in bounds and unmasked, and the padding is sliced off outside.

``layer``: W is a stack ``[L, K, N]`` of scanned layers' weights, read in place at that (traced)
layer (:func:`.tiles.operands`), so a scan over layers never copies a layer's weight out of the
stack for the kernel.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels._triton import compiler_params, pl, pltriton
from pallas_kernels.quant_matmul import layout, ref, tiles, tuning
from pallas_kernels.quant_matmul.decode import fp_decode
from pallas_kernels.quant_matmul.decode import int4_decode as int4_mode
from pallas_kernels.quant_matmul.layout import QuantizedWeight


def _kernel(
    x_ref, *refs, spec, block_m: int, block_n: int, block_k: int, steps: int, m_total: int, precision
):
    *w_refs, o_ref = refs
    lead, w_refs = tiles.layer_lead(spec, w_refs)
    i, j, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    m0, n0 = pl.multiple_of(i * block_m, block_m), pl.multiple_of(j * block_n, block_n)
    rows = m0 + jnp.arange(block_m, dtype=jnp.int32)
    valid = rows < m_total
    safe = jnp.where(valid, rows, 0)

    def step(t, acc):
        k0 = pl.multiple_of((split * steps + t) * block_k, block_k)
        for offset, length, w in tiles.pieces(spec, w_refs, lead, k0, n0, block_k, block_n, x_ref.dtype):
            cols = k0 + offset + jnp.arange(length, dtype=jnp.int32)
            xs = pltriton.load(x_ref.at[safe[:, None], cols[None, :]], mask=valid[:, None], other=0)
            acc += jnp.dot(xs, w, preferred_element_type=jnp.float32, precision=precision)
        return acc

    acc = jax.lax.fori_loop(0, steps, step, jnp.zeros((block_m, block_n), jnp.float32))
    o_ref[split, pl.ds(m0, block_m), pl.ds(n0, block_n)] = acc.astype(o_ref.dtype)


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
    :func:`.decode.fp_decode`); ``int4_decode``: 'f32' / 'bf16' / 'ptx' INT4 arithmetic (default:
    :func:`.decode.int4_decode`); ``config`` overrides the tuning table (benchmark sweeps). An N that
    is not a multiple of 16 (a tiny model's 136-wide ``kv_a``) is padded with zero columns, sliced
    off the result; an FP8 weight's K likewise with zero rows (and x with zero columns: a tiny V4's
    40-wide ``q_lora``). 4-bit weights' K is whole packed chunks (32 or 64 rows) by their layout.
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
    out = _quant_matmul(
        x,
        w,
        layer,
        interpret=interpret,
        decode=fp_decode(decode),
        config=config,
        int4=int4_mode(int4_decode, interpret=interpret),
    )
    return out if out.shape[-1] == n else out[:, :n]


def default_config(m: int, w: QuantizedWeight, dtype) -> tuning.QmmConfig:
    """The tuning table's config for ``x [m, K]`` of ``dtype`` times ``w`` (what the kernel uses when
    given none; benchmark sweeps start from it)."""
    k, n = w.shape[-2:]
    return tuning.choose(
        m,
        k,
        n,
        itemsize=jnp.dtype(dtype).itemsize,
        weight_bits=4 if w.packed else 8,
        min_block_k=max(w.kpack, 16),
    )


@functools.partial(jax.jit, static_argnames=("interpret", "decode", "config", "int4"))
def _quant_matmul(x, w, layer, *, interpret: bool, decode: str, config: tuning.QmmConfig | None, int4: str):
    m, k = x.shape
    if len(w.shape) != (2 if layer is None else 3):
        raise ValueError(f"quant_matmul: a weight of shape {w.shape} with layer={layer}")
    wk, n = w.shape[-2:]
    if wk != k:
        raise ValueError(f"quant_matmul: x has K = {k}, the weight {wk}")
    spec, arrays = tiles.operands(w, decode, int4, layer, interpret=interpret)
    min_block_k = max(spec.kpack, 16)
    cfg = config or default_config(m, w, x.dtype)
    block_n = tuning.fit_block(cfg.block_n, n, 16, "N")
    block_k = tuning.fit_block(max(cfg.block_k, min_block_k), k, min_block_k, "K")
    steps, m_tiles = k // block_k // cfg.splits, -(-m // cfg.block_m)
    if steps * cfg.splits * block_k != k:
        raise ValueError(f"{cfg.splits} K splits do not divide {k // block_k} steps of {block_k}")
    out = pl.pallas_call(
        functools.partial(
            _kernel,
            spec=spec,
            block_m=cfg.block_m,
            block_n=block_n,
            block_k=block_k,
            steps=steps,
            m_total=m,
            precision=jax.lax.Precision.HIGHEST if x.dtype == jnp.float32 else None,
        ),
        out_shape=jax.ShapeDtypeStruct(
            (cfg.splits, m_tiles * cfg.block_m, n), x.dtype if cfg.splits == 1 else jnp.float32
        ),
        grid=(m_tiles, n // block_n, cfg.splits),
        compiler_params=compiler_params(cfg.num_warps, cfg.num_stages),
        interpret=interpret,
        name="quant_matmul",
    )(x, *arrays)
    return out.sum(axis=0)[:m].astype(x.dtype) if cfg.splits > 1 else out[0, :m]
