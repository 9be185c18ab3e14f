"""Reading weight tiles inside a kernel, dense or quantized: the dequantize step of every kernel.

A kernel's K loop asks :func:`pieces` for the ``[block_k, block_n]`` tile of a weight at
``(k0, n0)`` and gets it as a list of ``(k_offset, k_len, tile)`` pieces in the activations' dtype,
each to be multiplied by the activation columns ``k0 + k_offset ... + k_len``. Dense and FP8
weights come as one piece; 4-bit weights as one 32-row piece per nibble of a packed chunk's code
rows (eight per int32 word, two per byte; see :mod:`.layout`). Scales (and zero points) are
loaded as the few rows and columns the tile spans and broadcast over it; NVFP4's e4m3 scales are
decoded and multiplied by their global scales before the broadcast, once per 16-row block.

Tiles must be aligned to the scale groups: ``block_k`` a multiple of ``kpack`` (4-bit), and every
power-of-two tile side either divides its group or is a multiple of it (NVFP4 global-scale
groups are powers of two for that reason).

A weight stacked over scanned layers (``[L, ...]``) is passed whole with a traced layer index
(:func:`operands` with ``layer``): the index travels as a ``(1,)`` int32 operand in front of the
weight's arrays, the kernel reads it once (:func:`layer_lead`) and prepends it to the leading
indices it gives :func:`pieces`. Inside ``lax.scan`` this is what keeps XLA from copying the
layer's slice out of the stack before every kernel call (a custom call needs its operands
materialized).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels._triton import pl
from pallas_kernels.quant import decode
from pallas_kernels.quant.layout import E4M3, E8M0, NVFP4_GROUP, WORD_KPACK, WORD_PIECE, QuantizedWeight

Piece = tuple[int, int, jax.Array]  # (k offset in the tile, k length, [k length, block_n] tile)


@dataclasses.dataclass(frozen=True)
class WeightSpec:
    """Static description of how a kernel reads one weight operand (hashable: a kernel parameter)."""

    format: str | None = None  # None: a dense array of the compute dtype
    group: tuple[int, int] = (1, 1)
    kpack: int = 0
    scale_dtype: Any = None  # int4: the dtype the product is rounded to
    scale_e8m0: bool = False
    has_zeros: bool = False
    decode: str = "native"
    int4_decode: str = "f32"  # decode.int4_decode; "bf16" / "ptx" apply only with bf16 scales and activations
    stacked: bool = False  # a [L, ...] stack whose layer index leads the operands (layer_lead)
    global_group: tuple[int, int] = (0, 0)  # nvfp4: elements per global scale (its operand after the scales)

    @property
    def packed(self) -> bool:
        return self.format in ("int4", "fp4", "nvfp4")


def decoded_tile_bytes(weight_elements: int, *, block_m: int, itemsize: int, weight_bits: int) -> int:
    """Shared memory a quantized step's dequantized weight tile (``weight_elements``) holds on its way
    to the tensor cores, at the activation itemsize; none for 4-bit codes in tiles of fewer than 64
    rows, which Triton decodes straight into the MMA operand registers (H100: 70.7 KiB for 4 stages
    of the MoE's gate|up, ``benchmarks/results/profile-h100-moe-4bit.md``). The quantized kernels'
    shared-memory estimates (:func:`pallas_kernels.quant_matmul.tuning.smem_bytes` and
    :func:`pallas_kernels.moe.tuning.smem_bytes`) both use it."""
    return 0 if weight_bits == 4 and block_m < 64 else weight_elements * itemsize


def operands(
    w,
    decode_mode: str | None = None,
    int4_mode: str | None = None,
    layer: jax.Array | None = None,
    *,
    interpret: bool = False,
) -> tuple[WeightSpec, tuple[jax.Array, ...]]:
    """The spec and the arrays a kernel receives for weight ``w`` (dense array or
    :class:`QuantizedWeight`). One-byte float types travel as uint8 (a free bitcast): masked loads
    need a fill value, and sm_80 cannot touch e4m3 values at all. With ``layer`` (an int32
    scalar, may be traced), ``w`` is a stack ``[L, ...]`` read in place at that layer: the index
    leads the arrays as a ``(1,)`` operand (see the module docstring). ``interpret``: the kernel
    runs in the Pallas interpreter (no inline PTX)."""
    index = () if layer is None else (jnp.reshape(jnp.asarray(layer, jnp.int32), (1,)),)
    if not isinstance(w, QuantizedWeight):
        return WeightSpec(stacked=layer is not None), (*index, w)
    as_bytes = lambda a: (  # noqa: E731
        jax.lax.bitcast_convert_type(a, jnp.uint8) if np.dtype(a.dtype) in (E4M3, E8M0) else a
    )
    spec = WeightSpec(
        format=w.format,
        group=tuple(w.group),
        kpack=w.kpack,
        scale_dtype=np.dtype(w.scales.dtype),
        scale_e8m0=np.dtype(w.scales.dtype) == E8M0,
        has_zeros=w.zeros is not None,
        decode=decode.fp_decode(decode_mode),
        int4_decode=decode.int4_decode(int4_mode, interpret=interpret),
        stacked=layer is not None,
        global_group=tuple(w.global_group),
    )
    extra = tuple(a for a in (w.zeros, w.global_scales) if a is not None)
    return spec, (*index, as_bytes(w.codes), as_bytes(w.scales), *extra)


def layer_lead(spec: WeightSpec, refs: Sequence) -> tuple[tuple, Sequence]:
    """``(lead, weight refs)`` from the refs of :func:`operands`' arrays: for a stacked weight the
    layer index (read once, as a scalar) to put in front of the other leading indices, and the refs
    after it; ``((), refs)`` otherwise."""
    if not spec.stacked:
        return (), refs
    return (refs[0][0],), refs[1:]


def _expand(s: jax.Array, rows: int, cols: int) -> jax.Array:
    """Repeat each entry of a ``[rs, cs]`` group tile over its ``rows/rs x cols/cs`` elements. A side
    of 1 stays 1 (it broadcasts)."""
    rs, cs = s.shape
    if 1 < cs < cols:
        s = jnp.broadcast_to(s[:, :, None], (rs, cs, cols // cs)).reshape(rs, cols)
    if 1 < rs < rows:
        s = jnp.broadcast_to(s[:, None, :], (rs, rows // rs, s.shape[1])).reshape(rows, s.shape[1])
    return s


def _group_load(ref, lead: tuple, group: tuple[int, int], r0, rows: int, n0, cols: int) -> jax.Array:
    """The per-group entries (``group`` elements each) covering rows ``r0 .. r0 + rows`` and columns
    ``n0 .. n0 + cols`` of the weight, one per group: ``[max(rows / gk, 1), max(cols / gn, 1)]``."""
    gk, gn = group
    return ref[(*lead, pl.ds(r0 // gk, max(rows // gk, 1)), pl.ds(n0 // gn, max(cols // gn, 1)))]


def _group_tile(ref, lead: tuple, spec: WeightSpec, r0, rows: int, n0, cols: int) -> jax.Array:
    """The per-group entries (scales or zero points) covering rows ``r0 .. r0 + rows`` and columns
    ``n0 .. n0 + cols`` of the weight, expanded to broadcast over that tile."""
    return _expand(_group_load(ref, lead, spec.group, r0, rows, n0, cols), rows, cols)


def _nvfp4_scales(spec: WeightSpec, refs: Sequence, lead: tuple, r0, rows: int, n0, cols: int) -> jax.Array:
    """An NVFP4 tile's effective scales ``fp32(s) * g``, formed once per 16-row block (the rounding
    the format defines, and 1/16 of the multiplies), then expanded over the tile. The e4m3 bytes are
    decoded as :func:`decode.fp_decode` says (integer ops on sm_80); the global scales are float32."""
    s = _group_load(refs[1], lead, spec.group, r0, rows, n0, cols).astype(jnp.int32)
    s = decode.e4m3_to_f32(s, spec.decode)
    g = _group_load(refs[2 + spec.has_zeros], lead, spec.global_group, r0, rows, n0, cols)
    return _expand(s * _expand(g, *s.shape), rows, cols)


def _bf16_int4(spec: WeightSpec, dtype) -> bool:
    """Whether an INT4 weight takes a bf16-arithmetic decode ("bf16" / "ptx"): bf16 scales and
    activations (the product is rounded to the scales' dtype, then used in the activations')."""
    return spec.int4_decode != "f32" and spec.scale_dtype == jnp.bfloat16 and dtype == jnp.bfloat16


def _ptx(spec: WeightSpec, dtype) -> bool:
    """Whether 4-bit codes are decoded by inline PTX ('ptx' asked, bf16 activations): INT4 with bf16
    scales (:func:`decode.int4_ptx` / ``int4_word_ptx``), and FP4, whose power-of-two scales make
    the bf16 product exact (:func:`decode.fp4_ptx` / ``fp4_word_ptx``). NVFP4's e4m3 x float32
    scales are not powers of two and its product is rounded in float32 first: it takes only the
    exact e2m1 values from PTX (:func:`_nvfp4_pieces`)."""
    if spec.int4_decode != "ptx" or dtype != jnp.bfloat16:
        return False
    return spec.format == "fp4" or (spec.format == "int4" and spec.scale_dtype == jnp.bfloat16)


def _ptx_scale_zero(spec: WeightSpec, refs: Sequence, lead: tuple, r0, rows: int, n0, cols: int):
    """The scales and the bf16 ``128 + zp`` zero points of weight rows ``r0 ...``, loaded per group and
    broadcast over the ``[rows, cols]`` tile (the PTX decode is elementwise)."""
    scale = _group_tile(refs[1], lead, spec, r0, rows, n0, cols)
    zero = _int4_zero_bf16(spec, refs, lead, r0, rows, n0, cols)
    return jnp.broadcast_to(scale, (rows, cols)), jnp.broadcast_to(zero, (rows, cols))


def _fp4_scale(spec: WeightSpec, refs: Sequence, lead: tuple, r0, rows: int, n0, cols: int) -> jax.Array:
    """FP4's ue8m0 scales of weight rows ``r0 ...`` as bf16 (exact), decoded once per group, then
    broadcast over the ``[rows, cols]`` tile (the PTX decode is elementwise)."""
    s = decode.e8m0_to_bf16(_group_load(refs[1], lead, spec.group, r0, rows, n0, cols))
    return jnp.broadcast_to(_expand(s, rows, cols), (rows, cols))


def _ptx_chunk(spec: WeightSpec, refs: Sequence, lead: tuple, byte, r0, n0) -> tuple[jax.Array, jax.Array]:
    """A packed chunk's bytes ``[half, cols]`` (uint8; weight rows ``r0 ...`` in the low nibbles, the
    next ``half`` rows in the high ones) -> both halves' bf16 weights by inline PTX."""
    half, cols = byte.shape
    out = []
    for row, high in ((r0, False), (r0 + half, True)):
        if spec.format == "fp4":
            out.append(decode.fp4_ptx(byte, _fp4_scale(spec, refs, lead, row, half, n0, cols), high=high))
        else:
            out.append(
                decode.int4_ptx(byte, *_ptx_scale_zero(spec, refs, lead, row, half, n0, cols), high=high)
            )
    return tuple(out)


def _ptx_word(spec: WeightSpec, refs: Sequence, lead: tuple, words, r0, n0, nibble: int) -> jax.Array:
    """Nibble ``nibble`` of a chunk's code words ``[32, cols]`` (weight rows ``r0 ...``) -> bf16 weights
    by inline PTX."""
    rows, cols = words.shape
    if spec.format == "fp4":
        return decode.fp4_word_ptx(words, _fp4_scale(spec, refs, lead, r0, rows, n0, cols), nibble)
    return decode.int4_word_ptx(words, *_ptx_scale_zero(spec, refs, lead, r0, rows, n0, cols), nibble)


def _int4_zero_bf16(spec: WeightSpec, refs: Sequence, lead: tuple, r0, rows: int, n0, cols: int):
    """The zero points of weight rows ``r0 ...`` as bf16 ``128 + (zp + 8)`` (the codes' offset domain),
    a group tile to broadcast; 136 when the weight is symmetric (codes hold q + 8)."""
    if not spec.has_zeros:
        return jnp.bfloat16(136)
    return decode.nibble_plus_128_bf16(_group_tile(refs[2], lead, spec, r0, rows, n0, cols).astype(jnp.int32))


def _int4_bf16(spec: WeightSpec, refs: Sequence, lead: tuple, codes, r0, n0) -> jax.Array:
    """INT4 codes -> bf16 in bf16 arithmetic (:mod:`.decode`): ``((128 + q) - (128 + zp)) * scale``,
    the subtraction exact, the product rounded once, as the float32 path rounds it."""
    rows, cols = codes.shape
    s = _group_tile(refs[1], lead, spec, r0, rows, n0, cols)
    zero = _int4_zero_bf16(spec, refs, lead, r0, rows, n0, cols)
    return (decode.nibble_plus_128_bf16(codes) - zero) * s


def _dequantize(spec: WeightSpec, refs: Sequence, lead: tuple, codes, r0, n0, dtype) -> jax.Array:
    """Codes ``[rows, cols]`` (int32) of weight rows ``r0 ...`` -> weights in ``dtype``."""
    rows, cols = codes.shape
    s = _group_load(refs[1], lead, spec.group, r0, rows, n0, cols)  # decoded per group, then expanded
    s = _expand(decode.e8m0_to_f32(s) if spec.scale_e8m0 else s.astype(jnp.float32), rows, cols)
    if spec.format == "fp8":
        return (decode.e4m3_to_f32(codes, spec.decode) * s).astype(dtype)
    if spec.format == "fp4":
        return (decode.e2m1_to_f32(codes) * s).astype(dtype)
    if _bf16_int4(spec, dtype):
        return _int4_bf16(spec, refs, lead, codes, r0, n0)
    zero = _group_tile(refs[2], lead, spec, r0, rows, n0, cols).astype(jnp.int32) if spec.has_zeros else 8
    value = (codes - zero).astype(jnp.float32) * s
    return value.astype(spec.scale_dtype).astype(dtype)  # rounded as compressed-tensors rounds


def _word_pieces(
    spec: WeightSpec, refs: Sequence, lead: tuple, k0, n0, block_k: int, block_n: int, dtype
) -> list[Piece]:
    """The pieces of 4-bit codes held in int32 words (``kpack`` = 256): per chunk one ``[32, N]`` load
    of words, then eight 32-row pieces, nibble ``j`` holding rows ``32 j ...`` of the chunk."""
    ptx = _ptx(spec, dtype)
    cols = pl.ds(n0, block_n)
    out = []
    for c in range(block_k // WORD_KPACK):
        row = pl.multiple_of(k0 // 8 + c * WORD_PIECE, WORD_PIECE)
        words = refs[0][(*lead, pl.ds(row, WORD_PIECE), cols)]
        for j in range(8):
            offset = c * WORD_KPACK + j * WORD_PIECE
            if ptx:
                tile = _ptx_word(spec, refs, lead, words, k0 + offset, n0, j)
            else:
                codes = (words >> (4 * j)) & 0xF  # int32: the arithmetic shift's sign bits are masked off
                tile = _dequantize(spec, refs, lead, codes, k0 + offset, n0, dtype)
            out.append((offset, WORD_PIECE, tile))
    return out


def piece_rows(spec: WeightSpec, block_k: int) -> int:
    """Rows of every piece :func:`pieces` gives for a ``block_k``-row tile: the whole tile for dense and
    FP8 weights, one nibble's rows of a packed chunk for 4-bit ones (32 for words, ``kpack / 2`` for
    bytes, 16 for NVFP4: one scale row each)."""
    if not spec.packed:
        return block_k
    if spec.format == "nvfp4":
        return NVFP4_GROUP
    return WORD_PIECE if spec.kpack == WORD_KPACK else spec.kpack // 2


def pieces(
    spec: WeightSpec, refs: Sequence, lead: tuple, k0, n0, block_k: int, block_n: int, dtype
) -> list[Piece]:
    """The ``[block_k, block_n]`` weight tile at rows ``k0``, columns ``n0`` (``lead``: indices of
    leading dims, e.g. the expert), as pieces in ``dtype`` (see the module docstring)."""
    cols = pl.ds(n0, block_n)
    if spec.format is None:
        return [(0, block_k, refs[0][(*lead, pl.ds(k0, block_k), cols)].astype(dtype))]
    if spec.format == "fp8":
        codes = refs[0][(*lead, pl.ds(k0, block_k), cols)].astype(jnp.int32)
        return [(0, block_k, _dequantize(spec, refs, lead, codes, k0, n0, dtype))]
    if spec.kpack == WORD_KPACK:
        return _word_pieces(spec, refs, lead, k0, n0, block_k, block_n, dtype)
    half = spec.kpack // 2
    ptx = _ptx(spec, dtype)
    out = []
    for c in range(block_k // spec.kpack):
        row = pl.multiple_of(k0 // 2 + c * half, half)  # byte row of this chunk
        if spec.format == "nvfp4":
            out += _nvfp4_pieces(spec, refs, lead, row, c * spec.kpack, k0, n0, block_n, dtype)
            continue
        byte = refs[0][(*lead, pl.ds(row, half), cols)]
        if ptx:
            lo, hi = _ptx_chunk(spec, refs, lead, byte, k0 + c * spec.kpack, n0)
            out += [(c * spec.kpack, half, lo), (c * spec.kpack + half, half, hi)]
            continue
        byte = byte.astype(jnp.int32)
        for h, codes in enumerate((byte & 0xF, byte >> 4)):
            offset = c * spec.kpack + h * half
            out.append((offset, half, _dequantize(spec, refs, lead, codes, k0 + offset, n0, dtype)))
    return out


def _nvfp4_pieces(spec: WeightSpec, refs: Sequence, lead: tuple, row, chunk, k0, n0, block_n: int, dtype):
    """An NVFP4 byte chunk as 16-row pieces, one per scale row: each piece's scales broadcast over it
    as they are (a 32-row piece would repeat its two scale rows by a reshape, which Triton lowers as a
    layout conversion through shared memory: 3.7x the INT4 experts' time at T = 1 on the H200). The
    e2m1 values come exact from inline PTX where 'ptx' is asked (:func:`decode.e2m1_ptx`, any
    activation dtype: the float32 product and its rounding follow as the format defines them), else
    from integer ops."""
    half, out = spec.kpack // 2, []
    for q in range(0, half, NVFP4_GROUP):
        byte = refs[0][(*lead, pl.ds(row + q, NVFP4_GROUP), pl.ds(n0, block_n))]
        for h in range(2):
            offset = chunk + h * half + q
            if spec.int4_decode == "ptx":
                values = decode.e2m1_ptx(byte, high=bool(h)).astype(jnp.float32)
            else:
                values = decode.e2m1_to_f32(byte.astype(jnp.int32) >> (4 * h) & 0xF)
            scales = _nvfp4_scales(spec, refs, lead, k0 + offset, NVFP4_GROUP, n0, block_n)
            out.append((offset, NVFP4_GROUP, (values * scales).astype(dtype)))
    return out
