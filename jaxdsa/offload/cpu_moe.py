"""The host experts' CPU kernel: routed-expert SwiGLU over weights kept in their checkpoint format.

XLA:CPU does not fuse a 4-bit or FP8 decode into its dot (it materializes the decoded weights:
0.18 GB/s of INT4 expert bytes on 2 cores for GLM-5.2's shapes), so the host side runs a Numba
kernel instead: one parallel loop over (expert, block of output columns) tasks, each decoding its
weights row by row (shift, mask, zero point, scale, the format's rounding) and accumulating ``x @ W``
for the expert's tokens in float32: for one token in registers as it decodes, for more through a
decoded row in L1 that every token reuses. The weights are read once per step and never written.
Measured against the host's read bandwidth by ``benchmarks/host_experts.py``: 13-18 % for INT4 and
FP8 on the GPU machines' Sapphire Rapids hosts (docs/results.md), far from what streaming allows.

The arithmetic is the kernels' (:func:`pallas_kernels.quant.layout.dequantize`): INT4 values
rounded to their scale's dtype, every weight rounded to the activations' dtype (bf16 or float32),
products summed in float32; ``act`` rounded to the activations' dtype before the down projection.
:func:`pallas_kernels.moe.ref.moe_experts` is the reference the tests hold it to.

Layouts are the kernels' (:mod:`pallas_kernels.quant.layout`), read in place from the host stacks.
"""

from __future__ import annotations

import dataclasses

import ml_dtypes
import numba
import numpy as np
from llvmlite import ir
from numba.core import types
from numba.extending import intrinsic

from pallas_kernels.quant.layout import WORD_KPACK, QuantizedWeight

BLOCK = 256  # output columns per task by default (a 1 KiB strip of an INT4 word row)
# what the codes hold, and how the scales are stored (kernel arguments)
INT4, FP4, FP8, DENSE_F32, DENSE_BF16 = 0, 1, 2, 3, 4
SCALE_F32, SCALE_BF16, SCALE_E8M0 = 0, 1, 2
_NONE = np.zeros((1, 1, 1), np.uint8)
_BF16, _E8M0 = np.dtype(ml_dtypes.bfloat16), np.dtype(ml_dtypes.float8_e8m0fnu)


@dataclasses.dataclass(frozen=True)
class HostWeight:
    """One layer's expert projection stack ``[E, K, N]`` as the kernel reads it: NumPy views of the
    codes, scales and zero points (bf16 and ue8m0 scales decoded in the kernel; FP8's block scales
    widened to one per output column at load, 1/gk of the weights' count)."""

    fmt: int
    codes: np.ndarray
    scales: np.ndarray
    scale_kind: int
    zeros: np.ndarray
    gk: int
    kpack: int
    int4_bf16: bool  # INT4 values round to their bf16 scales' dtype

    @classmethod
    def of(cls, w, layer: int | None) -> HostWeight:
        """``w`` (a QuantizedWeight or a dense array on JAX's CPU device, ``[L?, E, K, N]``) at
        ``layer`` (None: not stacked)."""
        pick = (lambda a: np.asarray(a)) if layer is None else (lambda a: np.asarray(a)[layer])
        if not isinstance(w, QuantizedWeight):
            codes = pick(w)
            if codes.dtype == _BF16:
                return cls(DENSE_BF16, codes.view(np.uint16), _NONE, SCALE_F32, _NONE, 1, 1, False)
            return cls(DENSE_F32, codes.astype(np.float32, copy=False), _NONE, SCALE_F32, _NONE, 1, 1, False)
        codes, scales = pick(w.codes), pick(w.scales)
        zeros = _NONE if w.zeros is None else pick(w.zeros)
        kind = {_BF16: SCALE_BF16, _E8M0: SCALE_E8M0}.get(scales.dtype, SCALE_F32)
        if kind == SCALE_BF16:
            scales = scales.view(np.uint16)
        elif kind == SCALE_E8M0:
            scales = scales.view(np.uint8)
        elif scales.dtype != np.float32:
            raise ValueError(f"host experts: {scales.dtype} scales are not supported (bf16, ue8m0, float32)")
        if w.group[1] > 1:  # block scales: one per output column
            if kind != SCALE_F32:
                scales = (
                    scales.astype(np.float32)
                    if kind == SCALE_BF16
                    else np.exp2(scales.astype(np.float32) - 127)
                )
                kind = SCALE_F32
            scales = np.ascontiguousarray(np.repeat(scales, w.group[1], axis=-1)[..., : codes.shape[-1]])
        if w.format == "fp8":
            return cls(FP8, codes.view(np.uint8), scales, kind, zeros, w.group[0], 1, False)
        fmt = FP4 if w.format == "fp4" else INT4
        return cls(fmt, codes, scales, kind, zeros, w.group[0], w.kpack, kind == SCALE_BF16)


def expert_matmul(
    xs: np.ndarray,
    offsets: np.ndarray,
    experts: np.ndarray,
    w: HostWeight,
    round_bf16: bool,
    n: int,
    block: int = BLOCK,
) -> np.ndarray:
    """``out[r] = xs[r] @ W[experts[u]]`` for the rows ``offsets[u] .. offsets[u + 1]`` of group
    ``u`` (float32 ``[S, n]``); decoded weights rounded to bf16 where ``round_bf16`` (bf16
    activations) or the format says so; ``block`` output columns per task."""
    out = np.zeros((xs.shape[0], n), np.float32)
    _matmul(
        xs,
        offsets,
        experts,
        w.fmt,
        w.codes,
        w.scales,
        w.scale_kind,
        w.zeros,
        w.zeros.size > 1,
        w.gk,
        w.kpack,
        round_bf16 or w.int4_bf16,
        block,
        out,
    )
    return out


@numba.njit(parallel=True, cache=True)
def _matmul(
    xs, offsets, experts, fmt, codes, scales, scale_kind, zeros, has_zeros, gk, kpack, round_bf16, block, out
):
    """One task per (expert group, ``block`` output columns); its weights decoded one row at a time.
    The tasks' loops are functions of their own, compiled apart: inlined into the parallel loop's
    body, Numba's parfor lowering left them unvectorized (6x slower on one thread)."""
    groups = experts.shape[0]
    n_total = out.shape[1]
    blocks = (n_total + block - 1) // block
    for task in numba.prange(groups * blocks):
        u, b = task // blocks, task % blocks
        r0, r1 = offsets[u], offsets[u + 1]
        if r0 == r1:
            continue
        n0 = b * block
        width = min(block, n_total - n0)
        x = xs[r0:r1]
        acc = np.zeros((r1 - r0, width), np.float32)
        e = experts[u]
        rounding = _rounding(round_bf16)
        if fmt == INT4 or fmt == FP4:
            z = zeros[e if has_zeros else 0]
            _nibbles(
                x,
                fmt,
                codes[e],
                scales[e],
                scale_kind,
                z,
                has_zeros,
                gk,
                kpack,
                rounding,
                n0,
                width,
                acc,
            )
        else:
            _rows(x, fmt, codes[e], scales[e if fmt == FP8 else 0], gk, rounding, n0, width, acc)
        out[r0:r1, n0 : n0 + width] = acc[:, :width]


@intrinsic
def _bits(typingctx, value):
    """float32 -> its bits (uint32), as a register bitcast."""
    return types.uint32(types.float32), lambda context, builder, sig, args: builder.bitcast(
        args[0], ir.IntType(32)
    )


@intrinsic
def _float(typingctx, value):
    """uint32 bits -> the float32 they encode."""
    return types.float32(types.uint32), lambda context, builder, sig, args: builder.bitcast(
        args[0], ir.FloatType()
    )


@numba.njit(inline="always")
def _rounding(round_bf16):
    """The constants of :func:`_to_bf16`: rounding to bf16 (nearest even), or none."""
    if round_bf16:
        return np.uint32(0x7FFF), np.uint32(1), np.uint32(0xFFFF0000)
    return np.uint32(0), np.uint32(0), np.uint32(0xFFFFFFFF)


@numba.njit(inline="always")
def _to_bf16(w, rounding):
    """``w`` rounded as ``rounding`` (:func:`_rounding`) says, without a branch, so that the loops
    around it vectorize: ``(bits + half + lsb) & keep`` rounds to nearest even, or is the identity."""
    half, lsb, keep = rounding
    v = _bits(w)
    return _float((v + half + ((v >> np.uint32(16)) & lsb)) & keep)


@numba.njit(cache=True)
def _nibbles(x, fmt, codes, scales, scale_kind, zeros, has_zeros, gk, kpack, rounding, n0, width, acc):
    """INT4 / FP4 codes ``[K', N]``: code row ``r`` of chunk ``c`` holds ``per`` rows of the chunk's
    ``kpack``, ``piece`` apart (8 in an int32 word, 2 in a byte), each in its own nibble; each
    piece lies inside one scale group. An INT4 weight is ``q * s - z * s``: with bf16 scales both
    products and their difference are exact in float32, so this is ``(q - z) * s`` to the bit.
    One token: decoded and multiplied in one loop over the columns (INT4 words: a word's eight
    weights at once); more: each row decoded once into ``row``, then multiplied with every token."""
    per = 8 if kpack == WORD_KPACK else 2
    piece = kpack // per
    one = x.shape[0] == 1
    scale = np.zeros((per, width), np.float32)
    zs = np.zeros((per, width), np.float32)  # zero point times scale
    row = np.zeros(width, np.float32)
    for chunk in range(codes.shape[0] // piece):
        for j in range(per):
            g = (chunk * kpack + j * piece) // gk
            _decode_scales(scales[g, n0 : n0 + width], scale_kind, scale[j])
            for c in range(width):
                zero = np.float32(zeros[g, n0 + c]) if has_zeros else np.float32(8)
                zs[j, c] = zero * scale[j, c]
        for r in range(piece):
            code_row = codes[chunk * piece + r, n0 : n0 + width]
            k0 = chunk * kpack + r
            if fmt == INT4 and per == 8 and one:
                _word_row(x[0], k0, code_row, scale, zs, rounding, width, acc[0])
                continue
            for j in range(per):
                shift, s, z = np.int32(4 * j), scale[j], zs[j]
                # the format's branch stays outside the column loops, which LLVM vectorizes
                if fmt == FP4 and one:
                    xv = x[0, k0 + j * piece]
                    for c in range(width):
                        q = (np.int32(code_row[c]) >> shift) & np.int32(15)
                        acc[0, c] += xv * _to_bf16(_e2m1(q) * s[c], rounding)
                    continue
                if fmt == FP4:
                    for c in range(width):
                        q = (np.int32(code_row[c]) >> shift) & np.int32(15)
                        row[c] = _to_bf16(_e2m1(q) * s[c], rounding)
                else:
                    for c in range(width):
                        q = np.float32((np.int32(code_row[c]) >> shift) & np.int32(15))
                        row[c] = _to_bf16(q * s[c] - z[c], rounding)
                _multiply(x, k0 + j * piece, row, width, acc)


@numba.njit(inline="always")
def _word_row(x, k0, code_row, scale, zs, rounding, width, acc):
    """acc += the eight weights of each word of ``code_row`` (rows ``k0 + 32 j``) times x: the
    nibble loop unrolled, so that the column loop is innermost and keeps ``acc`` in registers."""
    x0, x1, x2, x3 = x[k0], x[k0 + 32], x[k0 + 64], x[k0 + 96]
    x4, x5, x6, x7 = x[k0 + 128], x[k0 + 160], x[k0 + 192], x[k0 + 224]
    f = np.int32(15)
    for c in range(width):
        w = np.int32(code_row[c])
        a = acc[c]
        a += x0 * _to_bf16(np.float32(w & f) * scale[0, c] - zs[0, c], rounding)
        a += x1 * _to_bf16(np.float32((w >> np.int32(4)) & f) * scale[1, c] - zs[1, c], rounding)
        a += x2 * _to_bf16(np.float32((w >> np.int32(8)) & f) * scale[2, c] - zs[2, c], rounding)
        a += x3 * _to_bf16(np.float32((w >> np.int32(12)) & f) * scale[3, c] - zs[3, c], rounding)
        a += x4 * _to_bf16(np.float32((w >> np.int32(16)) & f) * scale[4, c] - zs[4, c], rounding)
        a += x5 * _to_bf16(np.float32((w >> np.int32(20)) & f) * scale[5, c] - zs[5, c], rounding)
        a += x6 * _to_bf16(np.float32((w >> np.int32(24)) & f) * scale[6, c] - zs[6, c], rounding)
        a += x7 * _to_bf16(np.float32((w >> np.int32(28)) & f) * scale[7, c] - zs[7, c], rounding)
        acc[c] = a


@numba.njit(inline="always")
def _e2m1(q):
    """An FP4 e2m1 code as float32, by its bits (no table lookup or branch, so that the column loop
    vectorizes; no subnormal either, which the threads of XLA's callbacks flush to zero): the
    magnitude's bits under a float32 exponent of 126 make ``v = 2^(e-1) (1 + m/2)``, the value when
    e > 0; when e = 0 the value is ``m/2 = 2v - 1``."""
    q = np.uint32(q)
    magnitude = q & np.uint32(7)
    v = _float((magnitude << np.uint32(22)) + (np.uint32(126) << np.uint32(23)))
    v += np.float32((magnitude >> np.uint32(1)) == 0) * (v - np.float32(1))
    return _float(_bits(v) | ((q & np.uint32(8)) << np.uint32(28)))


@numba.njit(inline="always")
def _e4m3(b):
    """An FP8 e4m3fn code as float32, the same way: ``v = 2^(e-7) (1 + m/8)`` under an exponent of
    120, and ``m 2^-9 = 2v - 2^-6`` when e = 0."""
    b = np.uint32(b)
    magnitude = b & np.uint32(0x7F)
    v = _float((magnitude << np.uint32(20)) + (np.uint32(120) << np.uint32(23)))
    v += np.float32((magnitude >> np.uint32(3)) == 0) * (v - np.float32(2.0**-6))
    return _float(_bits(v) | ((b & np.uint32(0x80)) << np.uint32(24)))


@numba.njit(cache=True)
def _rows(x, fmt, codes, scales, gk, rounding, n0, width, acc):
    """FP8 codes (bytes; float32 scales, one per column) or dense rows ``[K, N]``; one token's FP8
    decoded and multiplied in one loop."""
    row = np.zeros(width, np.float32)
    for k in range(codes.shape[0]):
        code_row = codes[k, n0 : n0 + width]
        s = scales[k // gk, n0 : n0 + width] if fmt == FP8 else scales[0, :1]
        if fmt == FP8 and x.shape[0] == 1:
            xv = x[0, k]
            for c in range(width):
                acc[0, c] += xv * _to_bf16(_e4m3(code_row[c]) * s[c], rounding)
            continue
        if fmt == FP8:
            for c in range(width):
                row[c] = _to_bf16(_e4m3(code_row[c]) * s[c], rounding)
        elif fmt == DENSE_BF16:
            for c in range(width):
                row[c] = _float(np.uint32(code_row[c]) << np.uint32(16))
        else:
            for c in range(width):
                row[c] = _to_bf16(np.float32(code_row[c]), rounding)
        _multiply(x, k, row, width, acc)


@numba.njit(inline="always")
def _multiply(x, k, row, width, acc):
    """acc[t] += x[t, k] * row for every token t."""
    for t in range(x.shape[0]):
        xv = x[t, k]
        for c in range(width):
            acc[t, c] += xv * row[c]


@numba.njit(inline="always")
def _decode_scales(scales, scale_kind, scale):
    """One scale row (bf16 bits, ue8m0 exponents or float32) into ``scale`` (float32)."""
    for c in range(scales.shape[0]):
        if scale_kind == SCALE_BF16:
            scale[c] = _float(np.uint32(scales[c]) << np.uint32(16))
        elif scale_kind == SCALE_E8M0:  # 2^(s - 127); s = 0 is 2^-127, a float32 subnormal
            e = np.uint32(scales[c])
            scale[c] = _float(e << np.uint32(23) if e > 0 else np.uint32(0x00400000))
        else:
            scale[c] = scales[c]
