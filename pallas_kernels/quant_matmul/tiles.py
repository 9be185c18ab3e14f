"""Reading weight tiles inside a kernel, dense or quantized: the dequantize step of every kernel.

A kernel's K loop loads the ``[block_k, block_n]`` tile of a weight at ``(k0, n0)`` as stored
(:func:`fetch`: codes, and the few rows and columns of scales and zero points the tile spans) and
decodes it (:func:`unpack`) into a list of ``(k_offset, k_len, tile)`` pieces in the activations'
dtype, each to be multiplied by the activation columns ``k0 + k_offset ... + k_len``. Dense and FP8
weights come as one piece; 4-bit weights as two pieces per packed chunk (low nibbles = first half
of the chunk's rows, high nibbles = second half; see :mod:`.layout`). :func:`k_loop` runs the K loop,
optionally loading step ``i + 1``'s tile while step ``i``'s is decoded and multiplied.

Tiles must be aligned to the scale groups: ``block_k`` a multiple of ``kpack`` (4-bit), and every
power-of-two tile side either divides its group or is a multiple of it.

A weight stacked over scanned layers (``[L, ...]``) is passed whole with a traced layer index
(:func:`operands` with ``layer``): the index travels as a ``(1,)`` int32 operand in front of the
weight's arrays, the kernel reads it once (:func:`layer_lead`) and prepends it to the leading
indices it gives :func:`fetch`. Inside ``lax.scan`` this is what keeps XLA from copying the
layer's slice out of the stack before every kernel call (a custom call needs its operands
materialized).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels._triton import pl
from pallas_kernels.quant_matmul import decode
from pallas_kernels.quant_matmul.layout import E4M3, E8M0, QuantizedWeight

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

    @property
    def packed(self) -> bool:
        return self.format in ("int4", "fp4")


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
    )
    arrays = (as_bytes(w.codes), as_bytes(w.scales)) + ((w.zeros,) if w.zeros is not None else ())
    return spec, (*index, *arrays)


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


def _group_load(ref, lead: tuple, spec: WeightSpec, r0, rows: int, n0, cols: int) -> jax.Array:
    """The ``[rs, cs]`` per-group entries (scales or zero points) covering rows ``r0 .. r0 + rows`` and
    columns ``n0 .. n0 + cols`` of the weight (:func:`_expand` spreads them over the tile)."""
    gk, gn = spec.group
    rs, cs = max(rows // gk, 1), max(cols // gn, 1)
    return ref[(*lead, pl.ds(r0 // gk, rs), pl.ds(n0 // gn, cs))]


def _bf16_int4(spec: WeightSpec, dtype) -> bool:
    """Whether an INT4 weight takes a bf16-arithmetic decode ("bf16" / "ptx"): bf16 scales and
    activations (the product is rounded to the scales' dtype, then used in the activations')."""
    return spec.int4_decode != "f32" and spec.scale_dtype == jnp.bfloat16 and dtype == jnp.bfloat16


def _int4_zero_bf16(spec: WeightSpec, zeros, rows: int, cols: int):
    """Zero points (a loaded group tile, or None when the weight is symmetric) as bf16
    ``128 + (zp + 8)`` (the codes' offset domain), to broadcast over ``[rows, cols]``; 136 when
    symmetric (codes hold q + 8)."""
    if not spec.has_zeros:
        return jnp.bfloat16(136)
    return decode.nibble_plus_128_bf16(_expand(zeros, rows, cols).astype(jnp.int32))


def _dequantize(spec: WeightSpec, codes, scales, zeros, dtype) -> jax.Array:
    """Codes ``[rows, cols]`` (int32) with their loaded scale (and zero-point) group tiles -> weights
    in ``dtype``."""
    rows, cols = codes.shape
    s = _expand(scales, rows, cols)
    if spec.format == "int4" and _bf16_int4(spec, dtype):
        # ((128 + q) - (128 + zp)) * scale in bf16: the subtraction exact, the product rounded once,
        # as the float32 path rounds it (see .decode)
        return (decode.nibble_plus_128_bf16(codes) - _int4_zero_bf16(spec, zeros, rows, cols)) * s
    s = decode.e8m0_to_f32(s) if spec.scale_e8m0 else s.astype(jnp.float32)
    if spec.format == "fp8":
        return (decode.e4m3_to_f32(codes, spec.decode) * s).astype(dtype)
    if spec.format == "fp4":
        return (decode.e2m1_to_f32(codes) * s).astype(dtype)
    zero = _expand(zeros, rows, cols).astype(jnp.int32) if spec.has_zeros else 8
    value = (codes - zero).astype(jnp.float32) * s
    return value.astype(spec.scale_dtype).astype(dtype)  # rounded as compressed-tensors rounds


def aligned(offset, multiple: int):
    """``pl.multiple_of`` for a traced offset; a Python int (step 0's, which :func:`k_loop` fetches
    before its loop) needs no hint, and Triton's lowering cannot attach one to a constant."""
    return offset if isinstance(offset, int) else pl.multiple_of(offset, multiple)


Fetched = tuple  # the loads of one weight tile (a pytree of arrays), as :func:`fetch` returns them


def fetch(spec: WeightSpec, refs: Sequence, lead: tuple, k0, n0, block_k: int, block_n: int) -> Fetched:
    """Load the ``[block_k, block_n]`` weight tile at rows ``k0``, columns ``n0`` (``lead``: indices of
    leading dims, e.g. the expert) as stored: codes (or dense values), and the scale and zero-point
    group tiles it spans. :func:`unpack` turns them into pieces; the two are apart so that a K loop
    can issue the next step's loads before it decodes this step's tile (:func:`k_loop`)."""
    cols = pl.ds(n0, block_n)
    if spec.format is None:
        return (refs[0][(*lead, pl.ds(k0, block_k), cols)],)
    groups = lambda r0, rows: (  # noqa: E731
        _group_load(refs[1], lead, spec, r0, rows, n0, block_n),
        _group_load(refs[2], lead, spec, r0, rows, n0, block_n) if spec.has_zeros else None,
    )
    if spec.format == "fp8":
        return (refs[0][(*lead, pl.ds(k0, block_k), cols)], groups(k0, block_k))
    half = spec.kpack // 2
    chunks = []
    for c in range(block_k // spec.kpack):
        byte = refs[0][(*lead, pl.ds(aligned(k0 // 2 + c * half, half), half), cols)]
        r0 = k0 + c * spec.kpack  # weight row of the chunk's low nibbles; the high ones follow
        chunks.append((byte, groups(r0, half), groups(r0 + half, half)))
    return tuple(chunks)


def unpack(spec: WeightSpec, tile: Fetched, dtype) -> list[Piece]:
    """A tile from :func:`fetch` as pieces in ``dtype`` (see the module docstring)."""
    if spec.format is None:
        (values,) = tile
        return [(0, values.shape[0], values.astype(dtype))]
    if spec.format == "fp8":
        codes, (scales, zeros) = tile
        return [(0, codes.shape[0], _dequantize(spec, codes.astype(jnp.int32), scales, zeros, dtype))]
    ptx = spec.format == "int4" and spec.int4_decode == "ptx" and _bf16_int4(spec, dtype)
    out = []
    for c, (byte, *halves) in enumerate(tile):
        half, cols = byte.shape
        if ptx:  # the asm is elementwise: scales and zero points broadcast over the tile
            for h, (scales, zeros) in enumerate(halves):
                s = jnp.broadcast_to(_expand(scales, half, cols), (half, cols))
                z = jnp.broadcast_to(_int4_zero_bf16(spec, zeros, half, cols), (half, cols))
                out.append((c * 2 * half + h * half, half, decode.int4_ptx(byte, s, z, high=h == 1)))
            continue
        byte = byte.astype(jnp.int32)
        for h, (codes, (scales, zeros)) in enumerate(zip((byte & 0xF, byte >> 4), halves)):
            out.append((c * 2 * half + h * half, half, _dequantize(spec, codes, scales, zeros, dtype)))
    return out


def k_loop(steps: int, fetch_at: Callable, body: Callable, init, *, prefetch: bool):
    """``fori_loop`` over ``steps`` K steps: ``acc = body(i, fetch_at(i), acc)``.

    With ``prefetch`` the loads of step ``i + 1`` are issued during step ``i`` and carried to it in
    registers, so they are in flight while this step's tile is decoded and multiplied (the last
    step re-reads its own tile instead of reading past the weight). ``fetch_at(i)`` returns a pytree
    of loaded arrays, e.g. :func:`fetch`'s.
    """
    if not prefetch:
        return jax.lax.fori_loop(0, steps, lambda i, acc: body(i, fetch_at(i), acc), init)

    def step(i, carry):
        acc, loaded = carry
        ahead = fetch_at(jnp.minimum(i + 1, steps - 1))
        return body(i, loaded, acc), ahead

    return jax.lax.fori_loop(0, steps, step, (init, fetch_at(0)))[0]
