"""How kernels turn fp8 / fp4 / e8m0 bytes into floats, and the one place that chooses the path.

sm_80 / sm_86 have no e4m3 conversion instruction and the Pallas-Triton lowering refuses the cast
there (``cannot cast from float8_e4m3fn`` below compute capability 8.9), so every kernel decodes
with integer bit manipulation on those parts ("software") and with the hardware conversion on
sm_89+ ("native"): FP8 weights' codes and NVFP4 weights' e4m3 scales alike. :func:`fp_decode` is
the single switch: an explicit argument wins, then ``JAXDSA_FP_DECODE=software|native``, then the
compute capability; forcing "software" runs the sm_80 path on a Hopper GPU or in the CPU
interpreter.

e2m1 (FP4) and ue8m0 are always decoded with integer ops: Hopper has no e2m1 conversion and the
Pallas-Triton lowering has no 4-bit float types, and an e8m0 byte is a float32 exponent field.
Every decoder is exact, NaN codes included (e4m3 0x7F / 0xFF, e8m0 0xFF). With bf16 activations
on a GPU, FP4 weights take the packed-register path INT4's "ptx" takes (below; :func:`fp4_ptx`):
the nibbles become bf16 bit patterns worth the value times 2^-126, one ``fma.rn.bf16x2`` by 2^126
makes them exact and a second applies the power-of-two scale, about four instructions a weight
against the float32 path's dozen (two conversions, the scale's decode, two products, the rounding).

INT4 codes have three exact ways to their bf16 weights (:func:`int4_decode` chooses): "f32" converts
``q - zp`` to float32, multiplies by the scale and rounds to bf16 (two int/float conversions per
weight); "bf16" builds ``128 + q`` and ``128 + zp`` as bf16 bit patterns with integer ops, subtracts
and multiplies by the bf16 scale in bf16 arithmetic, one element per instruction; "ptx" does the
same on packed registers (:func:`int4_ptx` for bytes, :func:`int4_word_ptx` for int32 words): the
low (or high) nibbles of four code bytes become
two ``bf16x2`` registers with two ``prmt`` and two ``lop3`` (and two shifts), then two
``fma.rn.bf16x2`` per register subtract the zero point and apply the scale, so a weight costs
about two instructions instead of eight. The difference ``q - zp`` is an exact small integer and its product
with a bf16 scale is rounded once, so all three give the same bits. "bf16" and "ptx" apply only
where the scales and the activations are bf16. "ptx" is the default on a GPU (sm_80+: ``lop3``,
``prmt`` and ``fma.rn.bf16x2`` exist from sm_80 on); the Pallas interpreter cannot run inline
assembly, so CPU runs default to "bf16". On the H100 "bf16" took the INT4 MoE to 260 / 1840 /
4629 / 7201 us at T = 1 / 8 / 32 / 128 against 301 / 2135 / 5289 / 8222 us with "f32".
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels._triton import compute_capability, pltriton

ENV = "JAXDSA_FP_DECODE"
MODES = ("native", "software")
INT4_ENV = "JAXDSA_INT4_DECODE"
INT4_MODES = ("f32", "bf16", "ptx")


def fp_decode(mode: str | None = None, *, cc: int | None = None) -> str:
    """'native' or 'software': ``mode`` if given, else ``$JAXDSA_FP_DECODE``, else native from
    compute capability 8.9 on. The CPU interpreter (cc 0) defaults to software, so CPU tests run
    the sm_80 path unless they ask for the other."""
    mode = mode or os.environ.get(ENV, "").strip().lower() or None
    if mode is None:
        cc = compute_capability() if cc is None else cc
        return "native" if cc >= 89 else "software"
    if mode not in MODES:
        raise ValueError(f"fp decode mode {mode!r}: choose one of {', '.join(MODES)} (or unset {ENV})")
    return mode


def int4_decode(mode: str | None = None, *, interpret: bool = False, cc: int | None = None) -> str:
    """'f32', 'bf16' or 'ptx' (module docstring): ``mode`` if given, else ``$JAXDSA_INT4_DECODE``, else
    'ptx' on a GPU from sm_80 on and 'bf16' in the interpreter (which cannot run inline assembly:
    asking for 'ptx' there is an error). FP4 weights follow it too: 'ptx' decodes them on packed
    registers, 'f32' and 'bf16' in float32 (the interpreter's XLA flushes bf16 subnormals, which the
    packed path's code 1 passes through, so there is no interpretable bf16 twin); NVFP4 takes its
    exact e2m1 values from the packed path under 'ptx' (:func:`e2m1_ptx`)."""
    mode = mode or os.environ.get(INT4_ENV, "").strip().lower() or None
    if mode is None:
        cc = compute_capability() if cc is None else cc
        return "ptx" if cc >= 80 and not interpret else "bf16"
    if mode not in INT4_MODES:
        raise ValueError(
            f"int4 decode mode {mode!r}: choose one of {', '.join(INT4_MODES)} (or unset {INT4_ENV})"
        )
    if mode == "ptx" and interpret:
        raise ValueError("int4 decode mode 'ptx' is inline PTX, which the Pallas interpreter cannot run")
    return mode


def nibble_plus_128_bf16(n: jax.Array) -> jax.Array:
    """Integers 0..127 (int32) -> bf16 equal to ``128 + n``: the bits of 128.0 (0x4300) with ``n``
    in the 7 mantissa bits."""
    return lax.bitcast_convert_type((n | 0x4300).astype(jnp.uint16), jnp.bfloat16)


def _int4_ptx_asm(high: bool) -> str:
    """PTX for one instance: 4 code bytes ($6; byte i in bits 8i..8i+7) -> the bf16 weights of their
    low (or ``high``) nibbles, two per output register ($0, $1; element 2j in the low half), from the
    scales ($2, $3) and the zero points as bf16 ``128 + zp`` ($4, $5). ``prmt`` spreads bytes 0, 1
    (2, 3) into the low bytes of a register's two halves; ``lop3`` (a & b) | c (lut 0xEA) keeps one
    nibble per half under the bits of bf16 128.0 (0x4300), giving 128 + q; the first ``fma``
    subtracts 128 + zp exactly (q - zp), the second multiplies by the scale, rounded once (adding -0
    keeps the product as it is)."""
    shift = "shr.u32 t0, t0, 4;\nshr.u32 t1, t1, 4;\n" if high else ""
    return (
        "{\n.reg .b32 t<2>, v<2>, negone, negzero;\n"
        "mov.b32 negone, 0xBF80BF80;\nmov.b32 negzero, 0x80008000;\n"
        "prmt.b32 t0, $6, 0, 0x4140;\nprmt.b32 t1, $6, 0, 0x4342;\n"
        + shift
        + "lop3.b32 v0, t0, 0x000F000F, 0x43004300, 0xEA;\n"
        "lop3.b32 v1, t1, 0x000F000F, 0x43004300, 0xEA;\n"
        "fma.rn.bf16x2 v0, $4, negone, v0;\nfma.rn.bf16x2 v1, $5, negone, v1;\n"
        "fma.rn.bf16x2 $0, v0, $2, negzero;\nfma.rn.bf16x2 $1, v1, $3, negzero;\n}"
    )


def int4_ptx(codes: jax.Array, scale: jax.Array, zero: jax.Array, *, high: bool) -> jax.Array:
    """Packed INT4 bytes ``[r, c]`` uint8 -> bf16 ``[r, c]`` weights ``(q - zp) * scale`` of their low
    (or ``high``) nibbles; ``scale`` bf16 and ``zero`` bf16 ``128 + zp`` (codes and zero points in the
    same offset domain), both ``[r, c]``. Inline PTX on packed registers (module docstring); GPU
    only. One asm per half: JAX's lowering returns only the first result of a multi-result asm."""
    return _bf16_asm(_int4_ptx_asm(high), "=r,=r,r,r,r,r,r", 4, scale, zero, codes)


def _bf16_asm(asm: str, constraints: str, pack: int, *args: jax.Array) -> jax.Array:
    """``asm`` run elementwise over ``args``, ``pack`` elements per instance: the bf16 weights, shaped
    like the last argument (the codes)."""
    codes = args[-1]
    [out] = pltriton.elementwise_inline_asm(
        asm,
        args=list(args),
        constraints=constraints,
        pack=pack,
        result_shape_dtypes=[jax.ShapeDtypeStruct(codes.shape, jnp.bfloat16)],
    )
    return out


def _int4_word_ptx_asm(nibble: int) -> str:
    """PTX for one instance: code words $3, $4 (two K-consecutive rows of one column) -> the bf16x2
    of their nibble ``nibble`` ($0; $3's in the low half), from the scales ($1) and the zero points
    as bf16 ``128 + zp`` ($2). ``prmt`` moves the byte holding the nibble of each word into the low
    byte of a half, ``lop3`` (a & b) | c keeps the nibble under bf16 128.0 as in
    :func:`_int4_ptx_asm`, then the same two ``fma.rn.bf16x2``."""
    byte, high = divmod(nibble, 2)
    shift = "shr.u32 t0, t0, 4;\n" if high else ""
    return (
        "{\n.reg .b32 t0, v0, negone, negzero;\n"
        "mov.b32 negone, 0xBF80BF80;\nmov.b32 negzero, 0x80008000;\n"
        f"prmt.b32 t0, $3, $4, {byte | (4 + byte) << 8:#x};\n"
        + shift
        + "lop3.b32 v0, t0, 0x000F000F, 0x43004300, 0xEA;\n"
        "fma.rn.bf16x2 v0, $2, negone, v0;\n"
        "fma.rn.bf16x2 $0, v0, $1, negzero;\n}"
    )


def int4_word_ptx(words: jax.Array, scale: jax.Array, zero: jax.Array, nibble: int) -> jax.Array:
    """INT4 code words ``[r, c]`` (int32, eight codes each) -> bf16 ``[r, c]`` weights ``(q - zp) * scale``
    of nibble ``nibble`` (0..7) of every word; ``scale`` bf16 and ``zero`` bf16 ``128 + zp``, both
    ``[r, c]``. Inline PTX on pairs of words, two weights per instruction after the ``prmt``; GPU
    only. Exactly :func:`int4_ptx`'s arithmetic."""
    return _bf16_asm(_int4_word_ptx_asm(nibble), "=r,r,r,r,r", 2, scale, zero, words)


def _fp4_ptx_asm(high: bool, scaled: bool = True) -> str:
    """PTX for one instance: 4 code bytes ($4) -> the bf16 weights of their low (or ``high``) e2m1
    nibbles, two per output register ($0, $1; element 2j in the low half), times the bf16 scales
    ($2, $3). ``prmt`` spreads the bytes over the halves as in :func:`_int4_ptx_asm`; ``and`` keeps
    the nibbles; the exponent and mantissa bits go to bf16's bits 6..8 and the sign to bit 15 (two
    shifts, one ``lop3`` (a & c) | (b & ~c) with c set over bits 6..8 and 12..14, where the other
    input is zero), which reads as the e2m1 value times 2^-126 (code 1, 0.5, a bf16 subnormal,
    included); one ``fma`` by 2^126 (0x7E80) gives the value exactly, the second multiplies by the
    scale (a power of two: exact unless it overflows, as in float32). Not ``scaled``: the exact values
    ($0, $1 from the bytes $2), no second ``fma``."""
    codes = "$4" if scaled else "$2"
    shift = "shr.u32 t0, t0, 4;\nshr.u32 t1, t1, 4;\n" if high else ""
    values = ("v0", "v1") if scaled else ("$0", "$1")
    return (
        "{\n.reg .b32 t<2>, m0, s0, v<2>, two126, negzero;\n"
        "mov.b32 two126, 0x7E807E80;\nmov.b32 negzero, 0x80008000;\n"
        f"prmt.b32 t0, {codes}, 0, 0x4140;\nprmt.b32 t1, {codes}, 0, 0x4342;\n"
        + shift
        + "and.b32 t0, t0, 0x000F000F;\nand.b32 t1, t1, 0x000F000F;\n"
        + _e2m1_bits_ptx("t0", "v0")
        + _e2m1_bits_ptx("t1", "v1")
        + f"fma.rn.bf16x2 {values[0]}, v0, two126, negzero;\n"
        + f"fma.rn.bf16x2 {values[1]}, v1, two126, negzero;\n"
        + ("fma.rn.bf16x2 $0, v0, $2, negzero;\nfma.rn.bf16x2 $1, v1, $3, negzero;\n" if scaled else "")
        + "}"
    )


def _e2m1_bits_ptx(nibbles: str, out: str) -> str:
    """PTX: register ``nibbles`` (one e2m1 code in bits 0..3 of each half, the rest zero) -> ``out``,
    bf16x2 bit patterns of the codes' values times 2^-126 (:func:`_fp4_ptx_asm`). Uses m0 and s0."""
    return (
        f"shl.b32 m0, {nibbles}, 6;\nshl.b32 s0, {nibbles}, 12;\n"
        f"lop3.b32 {out}, m0, s0, 0x71C071C0, 0xE4;\n"  # (a & c) | (b & ~c)
    )


def fp4_ptx(codes: jax.Array, scale: jax.Array, *, high: bool) -> jax.Array:
    """Packed e2m1 bytes ``[r, c]`` uint8 -> bf16 ``[r, c]`` weights ``e2m1(q) * scale`` of their low
    (or ``high``) nibbles; ``scale`` bf16 ``[r, c]`` (:func:`e8m0_to_bf16`'s powers of two). Inline
    PTX on packed registers, the same bits as :func:`e2m1_to_f32` times the scale rounded to bf16;
    GPU only."""
    return _bf16_asm(_fp4_ptx_asm(high), "=r,=r,r,r,r", 4, scale, codes)


def e2m1_ptx(codes: jax.Array, *, high: bool) -> jax.Array:
    """Packed e2m1 bytes ``[r, c]`` uint8 -> the exact values of their low (or ``high``) nibbles as bf16
    ``[r, c]`` (every e2m1 value is a bf16): :func:`fp4_ptx` without the scale, for NVFP4, whose
    float32 scales are applied after (their products round in float32 first). GPU only."""
    return _bf16_asm(_fp4_ptx_asm(high, scaled=False), "=r,=r,r", 4, codes)


def _fp4_word_ptx_asm(nibble: int) -> str:
    """PTX for one instance: code words $2, $3 (two K-consecutive rows of one column) -> the bf16x2 of
    their e2m1 nibble ``nibble`` ($0; $2's in the low half) times the scales ($1), as
    :func:`_fp4_ptx_asm` decodes a byte's nibble after :func:`_int4_word_ptx_asm`'s ``prmt``."""
    byte, high = divmod(nibble, 2)
    shift = "shr.u32 t0, t0, 4;\n" if high else ""
    return (
        "{\n.reg .b32 t0, m0, s0, v0, two126, negzero;\n"
        "mov.b32 two126, 0x7E807E80;\nmov.b32 negzero, 0x80008000;\n"
        f"prmt.b32 t0, $2, $3, {byte | (4 + byte) << 8:#x};\n"
        + shift
        + "and.b32 t0, t0, 0x000F000F;\n"
        + _e2m1_bits_ptx("t0", "v0")
        + "fma.rn.bf16x2 v0, v0, two126, negzero;\n"
        "fma.rn.bf16x2 $0, v0, $1, negzero;\n}"
    )


def fp4_word_ptx(words: jax.Array, scale: jax.Array, nibble: int) -> jax.Array:
    """e2m1 code words ``[r, c]`` (int32, eight codes each) -> bf16 ``[r, c]`` weights of nibble
    ``nibble`` (0..7) of every word times ``scale`` (bf16 ``[r, c]``); exactly :func:`fp4_ptx`'s
    arithmetic. GPU only."""
    return _bf16_asm(_fp4_word_ptx_asm(nibble), "=r,r,r,r", 2, scale, words)


def e8m0_to_bf16(e: jax.Array) -> jax.Array:
    """ue8m0 bytes (int, 0..255) -> bf16 2^(e - 127), exactly: the byte is bf16's exponent field too
    (0 is the subnormal 2^-127, 255 NaN), so the scales FP4's PTX decode multiplies by lose nothing."""
    e = e.astype(jnp.int32)
    bits = jnp.where(e == 255, 0x7FC0, jnp.where(e == 0, 0x0040, e << 7))
    return lax.bitcast_convert_type(bits.astype(jnp.uint16), jnp.bfloat16)


def e4m3_to_f32(u: jax.Array, mode: str) -> jax.Array:
    """e4m3fn bytes (any int dtype, 0..255) -> float32.

    Software: the sign, 4 exponent and 3 mantissa bits moved into float16's fields leave the
    exponent bias 8 short, an exact factor 2^-8 for normal and subnormal codes alike (float16 has
    the range and precision of every e4m3 value times 2^-8); multiplying by 256 is exact.
    """
    if mode == "native":
        return lax.bitcast_convert_type(u.astype(jnp.uint8), jnp.float8_e4m3fn).astype(jnp.float32)
    u = u.astype(jnp.int32)
    half = lax.bitcast_convert_type((((u & 0x80) << 8) | ((u & 0x7F) << 7)).astype(jnp.uint16), jnp.float16)
    return jnp.where((u & 0x7F) == 0x7F, jnp.float32(jnp.nan), half.astype(jnp.float32) * 256.0)


def e2m1_to_f32(n: jax.Array) -> jax.Array:
    """e2m1 codes (int, 0..15) -> float32: the same float16 trick, exponent bias 14 short (x 2^14)."""
    n = n.astype(jnp.int32)
    half = lax.bitcast_convert_type((((n & 0x8) << 12) | ((n & 0x7) << 9)).astype(jnp.uint16), jnp.float16)
    return half.astype(jnp.float32) * 16384.0


def e8m0_to_f32(e: jax.Array) -> jax.Array:
    """ue8m0 bytes (int, 0..255) -> float32 2^(e - 127): the byte is the float32 exponent field,
    except 0 (2^-127, a float32 subnormal) and 255 (NaN)."""
    e = e.astype(jnp.int32)
    bits = jnp.where(e == 255, 0x7FC00000, jnp.where(e == 0, 0x00400000, e << 23))
    return lax.bitcast_convert_type(bits, jnp.float32)
