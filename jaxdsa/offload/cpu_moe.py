"""The host experts' CPU kernel: routed-expert SwiGLU over weights kept in their checkpoint format.

XLA:CPU does not fuse a 4-bit or FP8 decode into its dot (it materializes the decoded weights:
0.18 GB/s of INT4 expert bytes on 2 cores for GLM-5.2's shapes), so the host side runs a Numba
kernel instead: one parallel loop over (expert, block of output columns) tasks. A task walks its
expert's code rows once, decoding each into float32 (mask, convert, scale and zero point in one
fused multiply-add, the format's rounding) and accumulating ``x @ W`` for the expert's tokens: for
one token straight into the accumulator, for more through decoded rows in L1 that every token
reuses. The weights are read once per step and never written.

What makes it fast is what LLVM vectorizes: every inner loop runs over the task's output columns
(contiguous in the layout), branch-free, on 32-bit integers (Numba widens integer arithmetic to 64
bits, which AVX2 cannot convert to float in vectors), storing to one array, in a function compiled on
its own (Numba's parallel-loop lowering leaves inlined loops scalar); a chunk's scales are decoded once
into L1 rows; each task prefetches its code strips ahead, since they lie a page apart. Measured by
``benchmarks/host_experts.py`` on 16 Emerald Rapids cores: 12-19 % of the host's read bandwidth
(docs/results.md); one core decodes 5.2 G INT4 weights/s from cache.

On AVX-512 hosts the loops run in 512-bit vectors (:func:`_wide_vectors`): LLVM's tuning for Intel's
server cores prefers 256-bit ones (the ``prefer-256-bit`` feature), which left one Emerald Rapids
core at 5.9 G INT4 weights/s from cache (one token, zero points) against 7.4 G in 512-bit vectors,
and FP8 / FP4 1.37 / 1.40x slower (``benchmarks/results/host_vectors-cpu-vectors.md``).

The arithmetic is the kernels' (:func:`pallas_kernels.quant.layout.dequantize`): INT4 values
rounded to their scale's dtype, every weight rounded to the activations' dtype (bf16 or float32),
products summed in float32; ``act`` rounded to the activations' dtype before the down projection.
Rounding to bf16 is Veltkamp's split (``c = w * (2^16 + 1); c - (c - w)``), which rounds a float32
to its nearest bf16, ties to even, in three float operations; it needs ``|w| < 2^112``. An FP4
weight times its power-of-two (ue8m0) scale is a bf16 already and is not rounded.
:func:`pallas_kernels.moe.ref.moe_experts` is the reference the tests hold it to.

Layouts are the kernels' (:mod:`pallas_kernels.quant.layout`), read in place from the host stacks.
NVFP4 experts are FP4 codes under float32 scales: :class:`HostWeight` forms each 16-row block's
effective scale ``fl32(fp32(s) * g)`` (e4m3 block scale times global scale, the format's rounding)
once at load, 4 bytes per 16 weights beside the codes' 8 (the e4m3 scales' byte stays with the
stored experts for the reference); a task then decodes its 4-bit pieces in spans of one scale row
(16 of a byte chunk's 32 rows). The product ``e2m1 * scale`` rounded to float32 is the format's
weight; bf16 activations round it once more, to bf16, as the GPU kernels do.
"""

from __future__ import annotations

import dataclasses
import os

import ml_dtypes
import numba
import numpy as np
from llvmlite import binding, ir
from numba.core import cgutils, types
from numba.extending import intrinsic

from pallas_kernels.quant.layout import NVFP4_GROUP, WORD_KPACK, QuantizedWeight

BLOCK = 256  # output columns per task by default (a 1 KiB strip of an INT4 word row)
# what the codes hold, and how the scales are stored (kernel arguments)
INT4, FP4, FP8, DENSE_F32, DENSE_BF16 = 0, 1, 2, 3, 4
SCALE_F32, SCALE_BF16, SCALE_E8M0 = 0, 1, 2
SPLIT_BF16 = np.float32(65537.0)  # Veltkamp's constant for rounding to bf16; 0 leaves a float32 as it is
_NONE = np.zeros((1, 1, 1), np.uint8)
_BF16, _E8M0 = np.dtype(ml_dtypes.bfloat16), np.dtype(ml_dtypes.float8_e8m0fnu)
_FP8_ROWS = 4  # FP8 rows decoded together
_AHEAD_BYTES = 4096  # how far ahead of the row being decoded its task's code rows are prefetched


def _wide_vectors() -> None:
    """Let Numba's LLVM vectorize in 512-bit registers on a host with AVX-512 (the host's own features
    without the ``prefer-256-bit`` tuning), unless ``NUMBA_CPU_NAME`` or ``NUMBA_CPU_FEATURES`` say
    otherwise. It applies to what Numba compiles after its CPU target starts (at the first
    compile), in this module first; each feature set has its own entries in Numba's cache."""
    if os.environ.get("NUMBA_CPU_NAME") or os.environ.get("NUMBA_CPU_FEATURES"):
        return
    features = binding.get_host_cpu_features()
    if features.get("avx512f"):
        numba.config.CPU_FEATURES = f"{features.flatten()},-prefer-256-bit"


_wide_vectors()


@dataclasses.dataclass(frozen=True)
class HostWeight:
    """One layer's expert projection stack ``[E, K, N]`` as the kernel reads it: NumPy views of the
    codes, scales and zero points (bf16 and ue8m0 scales decoded in the kernel; FP8's block scales
    widened to one per output column at load, 1/gk of the weights' count; NVFP4's as FP4 codes under
    their effective float32 scales, formed at load: :func:`nvfp4_scales`)."""

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
        if w.format == "nvfp4":
            scales = nvfp4_scales(pick(w.scales), pick(w.global_scales), w.global_group)
            return cls(FP4, pick(w.codes), scales, SCALE_F32, _NONE, NVFP4_GROUP, w.kpack, False)
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

    def split(self, round_bf16: bool) -> np.float32:
        """The rounding constant for bf16 activations (``round_bf16``) or this format's own
        rounding: :data:`SPLIT_BF16`, or 0 where the decoded weights are exact already (FP4 under
        ue8m0 scales: bf16 values; NVFP4's float32 scales make rounded products, rounded to bf16)."""
        if self.fmt == FP4 and self.scale_kind == SCALE_E8M0:
            return np.float32(0)
        return SPLIT_BF16 if round_bf16 or self.int4_bf16 else np.float32(0)


def nvfp4_scales(scales: np.ndarray, global_scales: np.ndarray, global_group: tuple[int, int]) -> np.ndarray:
    """NVFP4's effective scales ``fl32(fp32(s) * g)``, float32 ``[..., K/16, N]``: each e4m3 block
    scale (``scales``) times the global scale over it (``global_scales`` per ``global_group``),
    rounded once in float32 as the format defines (:func:`pallas_kernels.quant.layout.dequantize`)."""
    s = scales.astype(np.float32)  # e4m3 -> float32 exactly, subnormals included
    (gk, gn), rows = global_group, NVFP4_GROUP * np.arange(s.shape[-2])
    g = np.take(np.take(global_scales, rows // gk, axis=-2), np.arange(s.shape[-1]) // gn, axis=-1)
    return s * g.astype(np.float32, copy=False)


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
    zeros = w.zeros.size > 1
    args = (w.codes, w.scales, w.scale_kind, w.zeros, zeros, w.gk, w.kpack, w.split(round_bf16), block, out)
    _matmul(xs, offsets, experts, w.fmt, *args)
    return out


@numba.njit(parallel=True, cache=True)
def _matmul(
    xs, offsets, experts, fmt, codes, scales, scale_kind, zeros, has_zeros, gk, kpack, split, block, out
):
    """One task per (expert group, ``block`` output columns)."""
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
        acc = np.zeros((r1 - r0, width), np.float32)
        e = experts[u]
        if fmt == INT4 or fmt == FP4:
            z = zeros[e if has_zeros else 0]
            _nibbles(xs[r0:r1], fmt, codes[e], scales[e], scale_kind, z, has_zeros, gk, kpack, split, n0, acc)
        else:
            _rows(xs[r0:r1], fmt, codes[e], scales[e if fmt == FP8 else 0], gk, split, n0, acc)
        out[r0:r1, n0 : n0 + width] = acc


# -- register-level helpers (inlined) ------------------------------------------------------------


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


@intrinsic
def _fma(typingctx, a, b, c):
    """``a * b + c`` rounded once (llvm.fma, which LLVM vectorizes)."""
    return types.float32(types.float32, types.float32, types.float32), (
        lambda context, builder, sig, args: builder.fma(*args)
    )


@intrinsic
def _prefetch(typingctx, array, offset):
    """Prefetch the cache line at byte ``offset`` of ``array``'s data (llvm.prefetch: read, keep)."""

    def codegen(context, builder, sig, args):
        data = context.make_array(sig.args[0])(context, builder, args[0]).data
        pointer = builder.gep(builder.bitcast(data, ir.IntType(8).as_pointer()), [args[1]])
        i32 = ir.IntType(32)
        prefetch = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(ir.VoidType(), [pointer.type, i32, i32, i32]), "llvm.prefetch.p0"
        )
        builder.call(prefetch, [pointer, ir.Constant(i32, 0), ir.Constant(i32, 3), ir.Constant(i32, 1)])
        return context.get_dummy_value()

    return types.none(array, types.intp), codegen


@numba.njit(inline="always")
def _prefetch_ahead(codes, row, n0, width):
    """Prefetch the task's strip of the code row :data:`_AHEAD_BYTES` ahead of ``row``: a task's
    rows lie a whole row of the stack apart, each strip in a page of its own, where the hardware's
    prefetchers do not follow (2x slower from DRAM than from cache without it)."""
    strip = width * codes.itemsize
    ahead = row + max(1, _AHEAD_BYTES // strip)
    if ahead < codes.shape[0]:
        base = (ahead * codes.shape[1] + n0) * codes.itemsize
        for line in range(0, strip, 64):
            _prefetch(codes, base + line)


@numba.njit(inline="always")
def _round(w, split):
    """``w`` rounded to bf16 (nearest, ties to even) when ``split`` is :data:`SPLIT_BF16`, ``w``
    itself when it is 0 (``0 - (0 - w)``): Veltkamp's split, branch-free."""
    c = w * split
    return c - (c - w)


@numba.njit(inline="always")
def _e4m3(b):
    """An FP8 e4m3fn code as float32, by its bits (no table lookup or branch, so that the column loop
    vectorizes; no subnormal either, which the threads of XLA's callbacks flush to zero): the
    magnitude's bits under a float32 exponent of 120 make ``v = 2^(e-7) (1 + m/8)``, the value when
    e > 0; when e = 0 the value is ``m 2^-9 = 2v - 2^-6``."""
    b = np.uint32(b)
    magnitude = np.uint32(b & np.uint32(0x7F))
    v = _float(np.uint32((magnitude << np.uint32(20)) + np.uint32(120 << 23)))
    v += np.float32(magnitude < np.uint32(8)) * (v - np.float32(2.0**-6))
    return _float(np.uint32(_bits(v) | np.uint32(np.uint32(b & np.uint32(0x80)) << np.uint32(24))))


_E2M1_TWICE = np.uint32(0xC8643210)  # nibble i: twice the e2m1 magnitude i (0, .5, 1, 1.5, 2, 3, 4, 6)


@numba.njit(inline="always")
def _e2m1_twice(q):
    """Twice an FP4 e2m1 code's value, as float32: the magnitude looked up in the nibbles of one
    constant by a shift, converted exactly, and given the code's sign bit."""
    q = np.uint32(q)
    shift = np.uint32(np.uint32(q & np.uint32(7)) << np.uint32(2))
    twice = np.int32(np.uint32(_E2M1_TWICE >> shift) & np.uint32(15))
    sign = np.uint32(np.uint32(q & np.uint32(8)) << np.uint32(28))
    return _float(np.uint32(_bits(np.float32(twice)) | sign))


# -- 4-bit codes -----------------------------------------------------------------------------------


@numba.njit(cache=True)
def _nibbles(x, fmt, codes, scales, scale_kind, zeros, has_zeros, gk, kpack, split, n0, acc):
    """INT4 / FP4 codes ``[K', N]``: code row ``r`` of chunk ``c`` holds ``per`` rows of the chunk's
    ``kpack``, ``piece`` apart (8 in an int32 word, 2 in a byte), each in its own nibble. A chunk's
    code rows are walked in spans of ``min(piece, gk)`` rows, so that each nibble's rows of a span
    lie in one scale group (a whole piece, but for NVFP4's 16-row groups: half a byte piece). One
    token: each code row decoded and multiplied in one loop over the columns; more: decoded once
    into ``rows``, then multiplied with every token; a span's rows in one call of a function
    compiled on its own."""
    per = 8 if kpack == WORD_KPACK else 2
    piece = kpack // per
    span = min(piece, gk)
    width = acc.shape[1]
    words = fmt == INT4 and per == 8
    one = x.shape[0] == 1
    scale = np.empty((per, width), np.float32)
    offset = np.empty((per, width), np.float32)
    rows = np.empty((per, width), np.float32)
    for start in range(0, codes.shape[0], span):
        k0 = start // piece * kpack + start % piece  # the span's first row of nibble 0
        _chunk_scales(scales, scale_kind, zeros, has_zeros, fmt, words, k0, piece, gk, n0, scale, offset)
        if words and one:
            _word_dot(x[0], k0, codes, start, span, n0, scale, offset, split, acc[0])
        elif words:
            _word_multiply(x, k0, codes, start, span, piece, n0, scale, offset, split, rows, acc)
        elif fmt == FP4 and one:
            _fp4_dot(x[0], k0, codes, start, span, piece, n0, scale, split, acc[0])
        else:
            _byte_multiply(x, fmt, k0, codes, start, span, piece, n0, scale, offset, split, rows, acc)


@numba.njit(cache=True)
def _chunk_scales(scales, scale_kind, zeros, has_zeros, fmt, words, k0, piece, gk, n0, scale, offset):
    """The scales of a span's ``per`` pieces (from row ``k0``, ``piece`` apart) as float32 rows,
    and for INT4 the offset ``-zero * scale`` (an INT4 weight is ``q s - z s``; with bf16 scales
    both products and their difference are exact in float32, so this is ``(q - z) s`` to the bit).
    INT4 words keep nibble j in place (``q 2^4j``), so their scales come divided by ``2^4j``,
    exactly, and nibble 7 shifted down; FP4 decodes to twice its value, so its scales come halved
    (exactly while ``s/2`` is a normal float32: ``2e * s/2`` rounds as ``e * s``, NVFP4's too)."""
    width = scale.shape[1]
    for j in range(scale.shape[0]):
        g = (k0 + j * piece) // gk
        _decode_scales(scales[g, n0 : n0 + width], scale_kind, scale[j])
        if fmt == FP4:
            for c in range(width):
                scale[j, c] *= np.float32(0.5)
            continue
        if has_zeros:
            for c in range(width):
                offset[j, c] = -np.float32(zeros[g, n0 + c]) * scale[j, c]
        else:
            for c in range(width):
                offset[j, c] = np.float32(-8) * scale[j, c]
        if words and j < 7:
            f = np.float32(2.0 ** (-4 * j))
            for c in range(width):
                scale[j, c] *= f


@numba.njit(inline="always")
def _decode_scales(scales, scale_kind, scale):
    """One scale row (bf16 bits, ue8m0 exponents or float32) into ``scale`` (float32); the kind's
    branch outside the loops, so that each vectorizes."""
    if scale_kind == SCALE_BF16:
        for c in range(scales.shape[0]):
            scale[c] = _float(np.uint32(np.uint32(scales[c]) << np.uint32(16)))
    elif scale_kind == SCALE_E8M0:  # 2^(s - 127); s = 0 is 2^-127, a float32 subnormal
        for c in range(scales.shape[0]):
            e = np.uint32(scales[c])
            scale[c] = _float(np.uint32(e << np.uint32(23)) if e > 0 else np.uint32(0x00400000))
    else:
        for c in range(scales.shape[0]):
            scale[c] = scales[c]


@numba.njit(inline="always")
def _word(w, j, scale, offset, c, split):
    """Nibble ``j`` of INT4 word ``w`` (column ``c``) decoded: masked in place, converted, scaled
    and offset in one fused multiply-add (exact), rounded."""
    if j == 7:
        q = np.float32(np.int32(np.uint32(w) >> np.uint32(28)))
    else:
        q = np.float32(np.int32(w & np.int32(15 << (4 * j))))
    return _round(_fma(q, scale[j, c], offset[j, c]), split)


@numba.njit(cache=True)
def _word_dot(x, k0, codes, rows0, count, n0, scale, offset, split, acc):
    """acc += ``count`` INT4 word rows from ``rows0`` times x: each word's eight weights (rows
    ``k + 32 j``) unrolled, so that the column loop is innermost and keeps its sums in registers
    (two chains, for latency)."""
    for r in range(count):
        _prefetch_ahead(codes, rows0 + r, n0, acc.shape[0])
        k = k0 + r
        x0, x1, x2, x3 = x[k], x[k + 32], x[k + 64], x[k + 96]
        x4, x5, x6, x7 = x[k + 128], x[k + 160], x[k + 192], x[k + 224]
        code_row = codes[rows0 + r, n0 : n0 + acc.shape[0]]
        for c in range(acc.shape[0]):
            w = np.int32(code_row[c])
            a = x0 * _word(w, 0, scale, offset, c, split)
            b = x1 * _word(w, 1, scale, offset, c, split)
            a = _fma(x2, _word(w, 2, scale, offset, c, split), a)
            b = _fma(x3, _word(w, 3, scale, offset, c, split), b)
            a = _fma(x4, _word(w, 4, scale, offset, c, split), a)
            b = _fma(x5, _word(w, 5, scale, offset, c, split), b)
            a = _fma(x6, _word(w, 6, scale, offset, c, split), a)
            b = _fma(x7, _word(w, 7, scale, offset, c, split), b)
            acc[c] += a + b


@numba.njit(cache=True)
def _word_multiply(x, k0, codes, rows0, count, piece, n0, scale, offset, split, rows, acc):
    """acc += ``count`` INT4 word rows from ``rows0`` times every token's x, each word row decoded
    once, a nibble at a time (a loop that stores to one row vectorizes; one that stores to eight did
    not)."""
    for r in range(count):
        _prefetch_ahead(codes, rows0 + r, n0, rows.shape[1])
        code_row = codes[rows0 + r, n0 : n0 + rows.shape[1]]
        for j in range(8):
            row = rows[j]
            for c in range(row.shape[0]):
                row[c] = _word(np.int32(code_row[c]), j, scale, offset, c, split)
        _multiply(x, k0 + r, piece, rows, acc)


@numba.njit(cache=True)
def _fp4_dot(x, k0, codes, rows0, count, piece, n0, scale, split, acc):
    """acc += ``count`` FP4 byte rows from ``rows0`` times x, both weights of a byte (rows ``k``,
    ``k + piece``). Weights that need no rounding past their float32 product (``split`` 0: float32
    activations, or FP4's power-of-two scales) skip the rounding's three operations, which LLVM
    keeps (``0 * w`` is not 0 for every float) and which were a quarter of the loop's."""
    for r in range(count):
        _prefetch_ahead(codes, rows0 + r, n0, acc.shape[0])
        x0, x1 = x[k0 + r], x[k0 + r + piece]
        code_row = codes[rows0 + r, n0 : n0 + acc.shape[0]]
        if split == 0:
            for c in range(acc.shape[0]):
                q = np.uint32(code_row[c])
                a = x0 * (_e2m1_twice(q) * scale[0, c])
                acc[c] += _fma(x1, _e2m1_twice(np.uint32(q >> np.uint32(4))) * scale[1, c], a)
        else:
            for c in range(acc.shape[0]):
                q = np.uint32(code_row[c])
                a = x0 * _round(_e2m1_twice(q) * scale[0, c], split)
                acc[c] += _fma(x1, _round(_e2m1_twice(np.uint32(q >> np.uint32(4))) * scale[1, c], split), a)


@numba.njit(cache=True)
def _byte_multiply(x, fmt, k0, codes, rows0, count, piece, n0, scale, offset, split, rows, acc):
    """acc += ``count`` 4-bit byte rows from ``rows0`` (INT4 or FP4) times every token's x, each
    decoded once, a row at a time."""
    for r in range(count):
        _prefetch_ahead(codes, rows0 + r, n0, rows.shape[1])
        code_row = codes[rows0 + r, n0 : n0 + rows.shape[1]]
        for j in range(2):
            row, shift = rows[j], np.uint32(4 * j)
            if fmt == FP4 and split == 0:  # the float32 product is the weight (:func:`_fp4_dot`)
                for c in range(row.shape[0]):
                    row[c] = _e2m1_twice(np.uint32(np.uint32(code_row[c]) >> shift)) * scale[j, c]
            elif fmt == FP4:
                for c in range(row.shape[0]):
                    q = np.uint32(np.uint32(code_row[c]) >> shift)
                    row[c] = _round(_e2m1_twice(q) * scale[j, c], split)
            else:
                for c in range(row.shape[0]):
                    q = np.float32(np.int32(np.uint32(np.uint32(code_row[c]) >> shift) & np.uint32(15)))
                    row[c] = _round(_fma(q, scale[j, c], offset[j, c]), split)
        _multiply(x, k0 + r, piece, rows, acc)


@numba.njit(inline="always")
def _multiply(x, k, step, rows, acc):
    """acc[t] += sum_j x[t, k + j step] rows[j] for every token t: for eight or four rows one
    pass over the columns per token (one load and store of the sums for all the rows), else a
    pass per row. Indexed in two dimensions, not through row views: a view is a reference-counted
    object, and a few per token and row cost more than the multiplications (0.85 ms of a 1.3 ms
    two-token call of one GLM-5.2 expert)."""
    n, width = rows.shape
    for t in range(x.shape[0]):
        if n == 8:
            x0, x1, x2, x3 = x[t, k], x[t, k + step], x[t, k + 2 * step], x[t, k + 3 * step]
            x4, x5, x6, x7 = x[t, k + 4 * step], x[t, k + 5 * step], x[t, k + 6 * step], x[t, k + 7 * step]
            for c in range(width):
                p = _fma(x2, rows[2, c], _fma(x1, rows[1, c], x0 * rows[0, c]))
                q = _fma(x6, rows[6, c], _fma(x5, rows[5, c], x4 * rows[4, c]))
                acc[t, c] += _fma(x3, rows[3, c], p) + _fma(x7, rows[7, c], q)
        elif n == 4:
            x0, x1, x2, x3 = x[t, k], x[t, k + step], x[t, k + 2 * step], x[t, k + 3 * step]
            for c in range(width):
                acc[t, c] += _fma(x1, rows[1, c], x0 * rows[0, c]) + _fma(x3, rows[3, c], x2 * rows[2, c])
        else:
            for j in range(n):
                xv = x[t, k + j * step]
                for c in range(width):
                    acc[t, c] = _fma(xv, rows[j, c], acc[t, c])


# -- FP8 and dense rows ----------------------------------------------------------------------------


@numba.njit(cache=True)
def _rows(x, fmt, codes, scales, gk, split, n0, acc):
    """FP8 codes (bytes; float32 scales, one per column and block of ``gk`` rows), a block of rows
    per call, or dense rows ``[K, N]``."""
    width = acc.shape[1]
    if fmt != FP8:
        row = np.empty((1, width), np.float32)
        for k in range(codes.shape[0]):
            _dense_decode(fmt, codes[k, n0 : n0 + width], split, row[0])
            _multiply(x, k, 1, row, acc)
        return
    rows = np.empty((_FP8_ROWS, width), np.float32)
    for k0 in range(0, codes.shape[0], gk):
        k1 = min(k0 + gk, codes.shape[0])
        if x.shape[0] == 1:
            _fp8_dot(x[0], k0, k1, codes, n0, scales[k0 // gk], split, acc[0])
        else:
            _fp8_multiply(x, k0, k1, codes, n0, scales[k0 // gk], split, rows, acc)


@numba.njit(cache=True)
def _fp8_dot(x, k0, k1, codes, n0, s, split, acc):
    """acc += FP8 rows ``k0 .. k1`` (one scale block) decoded, scaled, rounded, times x, four at a
    time."""
    width = acc.shape[0]
    s = s[n0 : n0 + width]
    k = k0
    while k + _FP8_ROWS <= k1:
        for j in range(_FP8_ROWS):
            _prefetch_ahead(codes, k + j, n0, width)
        x0, x1, x2, x3 = x[k], x[k + 1], x[k + 2], x[k + 3]
        r0, r1 = codes[k, n0 : n0 + width], codes[k + 1, n0 : n0 + width]
        r2, r3 = codes[k + 2, n0 : n0 + width], codes[k + 3, n0 : n0 + width]
        for c in range(width):
            sc = s[c]
            a = x0 * _round(_e4m3(r0[c]) * sc, split)
            b = x1 * _round(_e4m3(r1[c]) * sc, split)
            a = _fma(x2, _round(_e4m3(r2[c]) * sc, split), a)
            b = _fma(x3, _round(_e4m3(r3[c]) * sc, split), b)
            acc[c] += a + b
        k += _FP8_ROWS
    for tail in range(k, k1):  # a block of a height that is not a multiple of four
        xv, code_row = x[tail], codes[tail, n0 : n0 + width]
        for c in range(width):
            acc[c] = _fma(xv, _round(_e4m3(code_row[c]) * s[c], split), acc[c])


@numba.njit(cache=True)
def _fp8_multiply(x, k0, k1, codes, n0, s, split, rows, acc):
    """acc += FP8 rows ``k0 .. k1`` times every token's x, :data:`_FP8_ROWS` decoded at a time."""
    for k in range(k0, k1, _FP8_ROWS):
        n = min(_FP8_ROWS, k1 - k)
        for j in range(n):  # a row at a time (module docstring)
            _prefetch_ahead(codes, k + j, n0, rows.shape[1])
            code_row, sc, row = codes[k + j, n0 : n0 + rows.shape[1]], s[n0 : n0 + rows.shape[1]], rows[j]
            for c in range(rows.shape[1]):
                row[c] = _round(_e4m3(code_row[c]) * sc[c], split)
        _multiply(x, k, 1, rows[:n], acc)


@numba.njit(cache=True)
def _dense_decode(fmt, code_row, split, row):
    """A dense row (bf16 bits, or float32 rounded as ``split`` says) into ``row``."""
    if fmt == DENSE_BF16:
        for c in range(row.shape[0]):
            row[c] = _float(np.uint32(np.uint32(code_row[c]) << np.uint32(16)))
    else:
        for c in range(row.shape[0]):
            row[c] = _round(np.float32(code_row[c]), split)
