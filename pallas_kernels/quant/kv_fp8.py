"""The FP8 KV-cache formats of GLM-5.x / DeepSeek-V3.2, as the released engines store them
(docs/models.md §5.2, §5.4, §5.8), and their exact quantizers.

**Latent rows** (FlashMLA's ``fp8_ds_mla`` fields; 656 bytes a token at the released widths). One
cached MLA row ``[c (C values) | k_pe (Pr values)]`` is kept as three parts::

    values  C e4m3 = c / s_k, tile k = c[128k : 128k + 128]      (512 B)
    scales  C/128 float32 s_k                                    (16 B)
    rope    k_pe in bfloat16 (not quantized)                     (128 B)

against 1,152 bytes in bf16. Dequantized, ``c[j] = f32(e4m3[j]) * s_{j // 128}`` and ``k_pe`` is the
bf16 value: attention reads ``K = [c | k_pe]`` and ``V = c``. FlashMLA interleaves the three in one
656-byte record per token; jaxdsa keeps each in an array of its own (same bytes, same values), so
that a kernel loads every part with vector loads of its own type: read byte by byte from one
record, the rope and scales held the H200's sparse-MLA decode to ~500 GB/s
(``benchmarks/results/kernels_mla_fp8-h200.md``). A record is the concatenation of the parts' bytes
(float32 little-endian), so either form converts to the other without rounding.

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

The kernels decode the parts in place (:mod:`pallas_kernels.quant.decode`); the functions here are
the writer and the reference decoder.
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


def latent_bytes(v_dim: int, rope_dim: int) -> int:
    """Bytes one token's latent row takes in FP8 (656 at the released 512 + 64)."""
    if v_dim % TILE:
        raise ValueError(f"FP8 latent: the latent width {v_dim} is not a multiple of {TILE}")
    return v_dim + 4 * (v_dim // TILE) + 2 * rope_dim


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


def quantize_latent(rows: jax.Array, v_dim: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Cached MLA rows ``[T, v_dim + Pr]`` (any float dtype) -> (values e4m3 ``[T, v_dim]``, scales
    float32 ``[T, v_dim / 128]``, rope bf16 ``[T, Pr]``)."""
    rows = rows.astype(jnp.float32)
    T = rows.shape[0]
    q, scale = _quantize_tiles(rows[:, :v_dim].reshape(T, v_dim // TILE, TILE))
    return q.reshape(T, v_dim), scale, rows[:, v_dim:].astype(jnp.bfloat16)


def dequantize_latent(values: jax.Array, scales: jax.Array, rope: jax.Array) -> jax.Array:
    """The rows that FP8 latent parts ``[..., C]``, ``[..., C/128]``, ``[..., Pr]`` hold, float32
    ``[..., C + Pr]``."""
    lead, v_dim = values.shape[:-1], values.shape[-1]
    tiles = values.astype(jnp.float32).reshape(*lead, v_dim // TILE, TILE) * scales[..., None]
    return jnp.concatenate([tiles.reshape(*lead, v_dim), rope.astype(jnp.float32)], axis=-1)


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
