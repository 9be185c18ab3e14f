"""The FP8 KV-cache formats of GLM-5.x / DeepSeek-V3.2, as the released engines store them
(docs/models.md §5.2, §5.4), and their exact quantizers.

**Latent rows, ``fp8_ds_mla``** (FlashMLA's name; 656 bytes a token at the released widths). One
cached MLA row ``[c (C values) | k_pe (Pr values)]`` becomes one byte record::

    bytes [0, C)               c / s_k as e4m3, tile k = c[128k : 128k + 128]
    bytes [C, C + 4 C/128)     the C/128 scales s_k, float32 little-endian
    bytes [.., + 2 Pr)         k_pe in bfloat16 (not quantized)

C = 512, Pr = 64 gives 512 + 16 + 128 = 656 bytes against 1,152 in bf16. Dequantized,
``c[j] = f32(e4m3[j]) * s_{j // 128}`` and ``k_pe`` is the bf16 value: attention reads
``K = [c | k_pe]`` and ``V = c``.

**Index keys.** One key of D values (D = 128 released) becomes D e4m3 values and one float32
scale: 132 bytes against 256. The key is rotated by the normalized Hadamard matrix before it is
quantized, as DeepSeek's reference and the engines do (the queries get the same rotation, so the
scores are unchanged in exact arithmetic and the rotation spreads outlier channels before the
rounding).

Scales follow DeepSeek's ``act_quant`` rule with ``scale_fmt = ue8m0``: ``amax = max(|x|, 1e-4)``
over the tile, ``s = amax / 448`` rounded *up* to a power of two, ``q = e4m3(x / s)`` (round to
nearest even; ``|x / s| <= 448`` by construction). A power-of-two scale makes ``x / s`` exact, so the
only rounding is e4m3's. Readers accept any positive float32 scale (vLLM's writer stores the raw
``amax / 448``).

The records are ``uint8`` arrays and the keys ``float8_e4m3fn``: the cache keeps them as such, the
kernels decode them in place (:mod:`pallas_kernels.quant.decode`), and the functions here are the
reference and the writer.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

TILE = 128  # latent values per scale
E4M3_MAX = 448.0
AMAX_FLOOR = 1e-4


def record_width(v_dim: int, rope_dim: int) -> int:
    """Bytes of one ``fp8_ds_mla`` record of ``v_dim`` latent and ``rope_dim`` rope values."""
    if v_dim % TILE:
        raise ValueError(f"fp8_ds_mla: the latent width {v_dim} is not a multiple of {TILE}")
    return v_dim + 4 * (v_dim // TILE) + 2 * rope_dim


def split_record(width: int, q_dim: int) -> tuple[int, int]:
    """``(v_dim, rope_dim)`` of records ``width`` bytes wide that serve ``q_dim``-wide queries
    (``q_dim = v_dim + rope_dim``); raises when no split fits."""
    # width = v + v/32 + 2 (q - v)  =>  v (1 + 1/32 - 2) = width - 2 q
    v_dim = round((2 * q_dim - width) * 32 / 31)
    rope_dim = q_dim - v_dim
    if v_dim <= 0 or rope_dim < 0 or v_dim % TILE or record_width(v_dim, rope_dim) != width:
        raise ValueError(f"fp8_ds_mla: {width}-byte records do not hold {q_dim}-wide rows")
    return v_dim, rope_dim


def pow2_scale(amax: jax.Array) -> jax.Array:
    """``act_quant``'s ue8m0 scale of tiles whose largest magnitude is ``amax``: the power of two
    at or above ``max(amax, 1e-4) / 448``, exactly (frexp, not a rounded log2)."""
    s = jnp.maximum(amax.astype(jnp.float32), AMAX_FLOOR) / E4M3_MAX
    mantissa, exponent = jnp.frexp(s)  # s = mantissa * 2**exponent, mantissa in [0.5, 1)
    return jnp.ldexp(jnp.float32(1.0), jnp.where(mantissa == 0.5, exponent - 1, exponent))


def _quantize_tiles(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """x [..., n, w] float32 -> (e4m3 [..., n, w], scales [..., n] float32), one scale per tile."""
    scale = pow2_scale(jnp.max(jnp.abs(x), axis=-1))
    q = jnp.clip(x / scale[..., None], -E4M3_MAX, E4M3_MAX).astype(jnp.float8_e4m3fn)
    return q, scale


def _bytes(x: jax.Array) -> jax.Array:
    """The little-endian bytes of ``x [T, n]`` as ``uint8 [T, n * itemsize]``."""
    u8 = lax.bitcast_convert_type(x, jnp.uint8)
    return u8.reshape(*x.shape[:-1], -1)


def quantize_latent(rows: jax.Array, v_dim: int) -> jax.Array:
    """Cached MLA rows ``[T, v_dim + Pr]`` (any float dtype) -> ``fp8_ds_mla`` records ``uint8 [T, W]``."""
    rows = rows.astype(jnp.float32)
    T = rows.shape[0]
    q, scale = _quantize_tiles(rows[:, :v_dim].reshape(T, v_dim // TILE, TILE))
    parts = (
        lax.bitcast_convert_type(q.reshape(T, v_dim), jnp.uint8),
        _bytes(scale),
        _bytes(rows[:, v_dim:].astype(jnp.bfloat16)),
    )
    return jnp.concatenate(parts, axis=-1)


def dequantize_latent(records: jax.Array, v_dim: int, rope_dim: int) -> jax.Array:
    """``fp8_ds_mla`` records ``uint8 [..., W]`` -> the rows they hold, float32
    ``[..., v_dim + rope_dim]``."""
    lead = records.shape[:-1]
    tiles = v_dim // TILE
    values = lax.bitcast_convert_type(records[..., :v_dim], jnp.float8_e4m3fn).astype(jnp.float32)
    scale_bytes = records[..., v_dim : v_dim + 4 * tiles].reshape(*lead, tiles, 4)
    scale = lax.bitcast_convert_type(scale_bytes, jnp.float32)
    rope_bytes = records[..., v_dim + 4 * tiles :].reshape(*lead, rope_dim, 2)
    rope = lax.bitcast_convert_type(rope_bytes, jnp.bfloat16).astype(jnp.float32)
    latent = (values.reshape(*lead, tiles, TILE) * scale[..., None]).reshape(*lead, v_dim)
    return jnp.concatenate([latent, rope], axis=-1)


def quantize_keys(keys: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Index keys ``[T, D]`` (already rotated) -> (e4m3 ``[T, D]``, float32 scales ``[T]``), one
    scale per key."""
    q, scale = _quantize_tiles(keys.astype(jnp.float32)[:, None, :])
    return q[:, 0], scale[:, 0]


@functools.cache
def _hadamard(n: int) -> np.ndarray:
    """Sylvester's Hadamard matrix of order ``n`` (natural order) divided by sqrt(n): orthogonal."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"Hadamard rotation: {n} is not a power of two")
    h = np.ones((1, 1))
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return h / np.sqrt(n)


def hadamard_rotate(x: jax.Array) -> jax.Array:
    """``x @ H_n / sqrt(n)`` over the last dim (n a power of two), in x's dtype with float32 sums."""
    h = jnp.asarray(_hadamard(x.shape[-1]), jnp.float32)
    y = jnp.einsum("...i,ij->...j", x.astype(jnp.float32), h, precision=lax.Precision.HIGHEST)
    return y.astype(x.dtype)
