"""How kernels turn fp8 / fp4 / e8m0 bytes into floats, and the one place that chooses the path.

sm_80 / sm_86 have no e4m3 conversion instruction and the Pallas-Triton lowering refuses the cast
there (``cannot cast from float8_e4m3fn`` below compute capability 8.9), so every kernel decodes
with integer bit manipulation on those parts ("software") and with the hardware conversion on
sm_89+ ("native"). :func:`fp_decode` is the single switch: an explicit argument wins, then
``JAXDSA_FP_DECODE=software|native``, then the compute capability; forcing "software" runs the
sm_80 path on a Hopper GPU or in the CPU interpreter.

e2m1 (FP4) and ue8m0 are always decoded with integer ops: Hopper has no e2m1 conversion and the
Pallas-Triton lowering has no 4-bit float types, and an e8m0 byte is a float32 exponent field.
Every decoder is exact, NaN codes included (e4m3 0x7F / 0xFF, e8m0 0xFF).

INT4 codes have two exact ways to their bf16 weights (:func:`int4_decode` chooses): "f32" converts
``q - zp`` to float32, multiplies by the scale and rounds to bf16 (two int/float conversions per
weight); "bf16" builds ``128 + q`` and ``128 + zp`` as bf16 bit patterns with integer ops, subtracts
and multiplies by the bf16 scale in bf16 arithmetic (``fma.rn.bf16``, sm_80+). The difference is an
exact small integer and the product of a 4-bit integer and a bf16 scale is rounded once, so both
give the same bits; "bf16" applies only where the scales and the activations are bf16 (it is the
default: on the H100 the INT4 MoE took 260 / 1840 / 4629 / 7201 us at T = 1 / 8 / 32 / 128 against
301 / 2135 / 5289 / 8222 us with "f32").
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels._triton import compute_capability

ENV = "JAXDSA_FP_DECODE"
MODES = ("native", "software")
INT4_ENV = "JAXDSA_INT4_DECODE"
INT4_MODES = ("f32", "bf16")
INT4_DEFAULT = "bf16"  # H100: 12-14 % faster MoE at T = 1-128 (benchmarks/results/quant-h100.md)


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


def int4_decode(mode: str | None = None) -> str:
    """'f32' or 'bf16' (module docstring): ``mode`` if given, else ``$JAXDSA_INT4_DECODE``, else
    :data:`INT4_DEFAULT`."""
    mode = mode or os.environ.get(INT4_ENV, "").strip().lower() or INT4_DEFAULT
    if mode not in INT4_MODES:
        raise ValueError(
            f"int4 decode mode {mode!r}: choose one of {', '.join(INT4_MODES)} (or unset {INT4_ENV})"
        )
    return mode


def nibble_plus_128_bf16(n: jax.Array) -> jax.Array:
    """Integers 0..127 (int32) -> bf16 equal to ``128 + n``: the bits of 128.0 (0x4300) with ``n``
    in the 7 mantissa bits."""
    return lax.bitcast_convert_type((n | 0x4300).astype(jnp.uint16), jnp.bfloat16)


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
