"""The host experts' CPU kernel: routed-expert SwiGLU over weights kept in their checkpoint format.

XLA:CPU does not fuse a 4-bit or FP8 decode into its dot (it materializes the decoded weights:
0.18 GB/s of INT4 expert bytes on 2 cores for GLM-5.2's shapes), so the host side runs a Numba
kernel instead: one parallel loop over (expert, 64-column block) tasks, each decoding its weights
row by row into a 64-wide buffer (shift, mask, zero point, scale, the format's rounding) and
accumulating ``x @ W`` for the expert's tokens in float32. The weights are read once per step and
never written; a decoded row lives in L1.

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

BLOCK = 64  # output columns per task: one decoded row is BLOCK float32
# what the codes hold, and how the scales are stored (kernel arguments)
INT4, FP4, FP8, DENSE_F32, DENSE_BF16 = 0, 1, 2, 3, 4
SCALE_F32, SCALE_BF16, SCALE_E8M0 = 0, 1, 2
_E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float32)
_E4M3 = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
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
    lut: np.ndarray
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
                return cls(DENSE_BF16, codes.view(np.uint16), _NONE, SCALE_F32, _NONE, _E2M1, 1, 1, False)
            return cls(
                DENSE_F32, codes.astype(np.float32, copy=False), _NONE, SCALE_F32, _NONE, _E2M1, 1, 1, False
            )
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
            return cls(FP8, codes.view(np.uint8), scales, kind, zeros, _E4M3, w.group[0], 1, False)
        fmt = FP4 if w.format == "fp4" else INT4
        return cls(fmt, codes, scales, kind, zeros, _E2M1, w.group[0], w.kpack, kind == SCALE_BF16)


def expert_matmul(
    xs: np.ndarray, offsets: np.ndarray, experts: np.ndarray, w: HostWeight, round_bf16: bool, n: int
) -> np.ndarray:
    """``out[r] = xs[r] @ W[experts[u]]`` for the rows ``offsets[u] .. offsets[u + 1]`` of group
    ``u`` (float32 ``[S, n]``); decoded weights rounded to bf16 where ``round_bf16`` (bf16
    activations) or the format says so."""
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
        w.lut,
        w.gk,
        w.kpack,
        round_bf16 or w.int4_bf16,
        out,
    )
    return out


@numba.njit(parallel=True, cache=True)
def _matmul(
    xs, offsets, experts, fmt, codes, scales, scale_kind, zeros, has_zeros, lut, gk, kpack, round_bf16, out
):
    """One task per (expert group, BLOCK output columns); its weights decoded one row at a time."""
    groups = experts.shape[0]
    n_total = out.shape[1]
    blocks = (n_total + BLOCK - 1) // BLOCK
    for task in numba.prange(groups * blocks):
        u, b = task // blocks, task % blocks
        r0, r1 = offsets[u], offsets[u + 1]
        if r0 == r1:
            continue
        n0 = b * BLOCK
        width = min(BLOCK, n_total - n0)
        x = xs[r0:r1]
        acc = np.zeros((r1 - r0, BLOCK), np.float32)
        e = experts[u]
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
                lut,
                gk,
                kpack,
                round_bf16,
                n0,
                width,
                acc,
            )
        else:
            _rows(x, fmt, codes[e], scales[e if fmt == FP8 else 0], lut, gk, round_bf16, n0, width, acc)
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
def _to_bf16(w, round_bf16):
    """``w`` rounded to bf16 (nearest even, as float32 -> bf16 casts do) if asked."""
    if not round_bf16:
        return w
    v = _bits(w)
    return _float((v + np.uint32(0x7FFF) + ((v >> np.uint32(16)) & np.uint32(1))) & np.uint32(0xFFFF0000))


@numba.njit(inline="always")
def _nibbles(x, fmt, codes, scales, scale_kind, zeros, has_zeros, lut, gk, kpack, round_bf16, n0, width, acc):
    """INT4 / FP4 codes ``[K', N]``: code row ``r`` of chunk ``c`` holds ``per`` rows of the chunk's
    ``kpack``, ``piece`` apart (8 in an int32 word, 2 in a byte), each in its own nibble; each
    piece lies inside one scale group. One token and INT4: decoded and multiplied in one loop;
    else each row is decoded once into ``row``, then multiplied with every token."""
    per = 8 if kpack == WORD_KPACK else 2
    piece = kpack // per
    scale = np.zeros((per, BLOCK), np.float32)
    zero = np.full((per, BLOCK), np.float32(8))
    row = np.zeros(BLOCK, np.float32)
    for chunk in range(codes.shape[0] // piece):
        for j in range(per):
            g = (chunk * kpack + j * piece) // gk
            _decode_scales(scales[g, n0 : n0 + width], scale_kind, scale[j])
            if has_zeros:
                for c in range(width):
                    zero[j, c] = np.float32(zeros[g, n0 + c])
        for r in range(piece):
            code_row = codes[chunk * piece + r, n0 : n0 + width]
            for j in range(per):
                k, shift, s, z = chunk * kpack + j * piece + r, 4 * j, scale[j], zero[j]
                # the format's branch stays outside the column loops, which LLVM vectorizes
                if fmt == FP4:
                    for c in range(width):
                        row[c] = _to_bf16(lut[(np.int32(code_row[c]) >> shift) & 15] * s[c], round_bf16)
                elif x.shape[0] == 1:
                    xv = x[0, k]
                    for c in range(width):
                        q = np.float32((np.int32(code_row[c]) >> shift) & 15)
                        acc[0, c] += xv * _to_bf16((q - z[c]) * s[c], round_bf16)
                    continue
                else:
                    for c in range(width):
                        q = np.float32((np.int32(code_row[c]) >> shift) & 15)
                        row[c] = _to_bf16((q - z[c]) * s[c], round_bf16)
                _multiply(x, k, row, width, acc)


@numba.njit(inline="always")
def _rows(x, fmt, codes, scales, lut, gk, round_bf16, n0, width, acc):
    """FP8 codes (bytes; float32 scales, one per column) or dense rows ``[K, N]``."""
    row = np.zeros(BLOCK, np.float32)
    for k in range(codes.shape[0]):
        code_row = codes[k, n0 : n0 + width]
        s = scales[k // gk, n0 : n0 + width] if fmt == FP8 else scales[0, :1]
        if fmt == FP8:
            for c in range(width):
                row[c] = _to_bf16(lut[np.int32(code_row[c])] * s[c], round_bf16)
        elif fmt == DENSE_BF16:
            for c in range(width):
                row[c] = _float(np.uint32(code_row[c]) << np.uint32(16))
        else:
            for c in range(width):
                row[c] = _to_bf16(np.float32(code_row[c]), round_bf16)
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
