"""The FP8 KV-cache formats of GLM-5.x / DeepSeek-V3.2 and DeepSeek-V4, as the released engines store
them (docs/models.md §5.2-§5.4, §5.8), and their exact quantizers.

**Latent rows.** A cached row ``[c (C values) | rope (Pr values)]`` is kept as three parts: the C
"nope" values in e4m3, one scale per tile of them, and the rope part in bfloat16 (not quantized).
Two formats (:class:`LatentFormat`):

* ``DS_MLA`` (FlashMLA's ``fp8_ds_mla``, GLM-5.x / V3.2): tiles of 128, float32 scales; 512 + 16 +
  128 = 656 bytes a token at the released 512 + 64, against 1,152 in bf16. Attention reads
  ``K = [c | k_pe]`` and ``V = c``.
* ``MODEL1`` (DeepSeek-V4's FlashMLA layout): tiles of 64, scales as ue8m0 exponent bytes (``s = 2^(e -
  127)``); 448 + 7 + 128 = 583 bytes of data a token at the released 448 + 64 (FlashMLA's record
  adds one pad byte: 584), against 1,024 in bf16. K = V = the whole row.

Dequantized, ``c[j] = f32(e4m3[j]) * s_{j // tile}`` and the rope part is the bf16 value. FlashMLA
interleaves the parts in one record per token; jaxdsa keeps each in an array of its own (same
bytes, same values), so that a kernel loads every part with vector loads of its own type: read
byte by byte from one record, the rope and scales held the H200's sparse-MLA decode to ~500 GB/s
(``benchmarks/results/kernels_mla_fp8-h200.md``). A nope part narrower than one tile (the tiny test
models) is one tile of its own width.

**Index keys.** One key of D values (D = 128 released) becomes D e4m3 values and one float32
scale: 132 bytes against 256. The key is rotated by the normalized Hadamard matrix before it is
quantized, as DeepSeek's reference and the engines do (the queries get the same rotation, so the
scores are unchanged in exact arithmetic and the rotation spreads outlier channels before the
rounding).

Scales follow DeepSeek's ``act_quant`` rule with ``scale_fmt = ue8m0``: ``amax = max(|x|, 1e-4)``
over the tile, ``s = amax / 448`` rounded *up* to a power of two, ``q = e4m3(x / s)`` (round to
nearest even; ``|x / s| <= 448`` by construction). A power-of-two scale makes ``x / s`` exact, so the
only rounding is e4m3's. Readers of float32 scales accept any positive value (vLLM's writer stores
the raw ``amax / 448``).

The kernels decode the parts in place (:mod:`pallas_kernels.quant.decode`); the functions here are
the writer and the reference decoder.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from pallas_kernels.quant import decode

TILE = 128  # values per scale in DS_MLA
E4M3_MAX = 448.0
AMAX_FLOOR = 1e-4
E8M0_BIAS = 127


@dataclasses.dataclass(frozen=True)
class LatentFormat:
    """How a latent row's nope values are scaled: ``tile`` values per scale, scales stored as
    float32 values or as ue8m0 exponent bytes (``scale_dtype`` uint8)."""

    name: str
    tile: int
    scale_dtype: Any

    def tile_width(self, nope: int) -> int:
        """Values per scale for a ``nope``-wide part: ``tile``, or the whole part when narrower."""
        if nope < self.tile:
            return nope
        if nope % self.tile:
            raise ValueError(f"FP8 latent ({self.name}): the width {nope} is not a multiple of {self.tile}")
        return self.tile

    def row_bytes(self, nope: int, rope: int) -> int:
        """Bytes one token's row takes (656 for DS_MLA at 512 + 64, 583 for MODEL1 at 448 + 64)."""
        scales = nope // self.tile_width(nope)
        return nope + scales * jnp.dtype(self.scale_dtype).itemsize + 2 * rope

    def quantize(self, rows: jax.Array, nope: int) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Rows ``[T, nope + Pr]`` (any float dtype) -> (values e4m3 ``[T, nope]``, scales
        ``[T, nope / tile]`` in ``scale_dtype``, rope bf16 ``[T, Pr]``)."""
        rows = rows.astype(jnp.float32)
        T, w = rows.shape[0], self.tile_width(nope)
        q, scale = _quantize_tiles(rows[:, :nope].reshape(T, nope // w, w))
        if jnp.dtype(self.scale_dtype) == jnp.uint8:
            scale = encode_e8m0(scale)
        return q.reshape(T, nope), scale, rows[:, nope:].astype(jnp.bfloat16)


DS_MLA = LatentFormat("fp8_ds_mla", TILE, jnp.float32)
MODEL1 = LatentFormat("model1", 64, jnp.uint8)


def latent_format(scale_dtype) -> LatentFormat:
    """The format whose scales are stored in ``scale_dtype`` (float32: DS_MLA, uint8: MODEL1)."""
    return MODEL1 if jnp.dtype(scale_dtype) == jnp.uint8 else DS_MLA


def latent_bytes(v_dim: int, rope_dim: int) -> int:
    """Bytes one token's DS_MLA latent row takes (656 at the released 512 + 64)."""
    if v_dim % TILE:
        raise ValueError(f"FP8 latent: the latent width {v_dim} is not a multiple of {TILE}")
    return DS_MLA.row_bytes(v_dim, rope_dim)


def pow2_scale(amax: jax.Array) -> jax.Array:
    """``act_quant``'s ue8m0 scale of tiles whose largest magnitude is ``amax``: the power of two
    at or above ``max(amax, 1e-4) / 448``, exactly (frexp, not a rounded log2)."""
    s = jnp.maximum(amax.astype(jnp.float32), AMAX_FLOOR) / E4M3_MAX
    mantissa, exponent = jnp.frexp(s)  # s = mantissa * 2**exponent, mantissa in [0.5, 1)
    return jnp.ldexp(jnp.float32(1.0), jnp.where(mantissa == 0.5, exponent - 1, exponent))


def encode_e8m0(scale: jax.Array) -> jax.Array:
    """Power-of-two float32 scales -> ue8m0 bytes ``log2(s) + 127`` (the float's exponent field)."""
    return (lax.bitcast_convert_type(scale.astype(jnp.float32), jnp.uint32) >> 23).astype(jnp.uint8)


def decode_scales(scales: jax.Array) -> jax.Array:
    """Stored scales as float32: float32 as they are, ue8m0 bytes ``e`` as ``2^(e - 127)``."""
    if scales.dtype == jnp.uint8:
        return lax.bitcast_convert_type(scales.astype(jnp.uint32) << 23, jnp.float32)
    return scales.astype(jnp.float32)


def _quantize_tiles(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """x [..., n, w] float32 -> (e4m3 [..., n, w], scales [..., n] float32), one scale per tile."""
    scale = pow2_scale(jnp.max(jnp.abs(x), axis=-1))
    q = jnp.clip(x / scale[..., None], -E4M3_MAX, E4M3_MAX).astype(jnp.float8_e4m3fn)
    return q, scale


def quantize_latent(rows: jax.Array, v_dim: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """DS_MLA parts of cached MLA rows ``[T, v_dim + Pr]``: :meth:`LatentFormat.quantize`."""
    return DS_MLA.quantize(rows, v_dim)


def dequantize_latent(values: jax.Array, scales: jax.Array, rope: jax.Array) -> jax.Array:
    """The rows that FP8 latent parts ``[..., C]``, ``[..., C / tile]`` (float32 or ue8m0 bytes),
    ``[..., Pr]`` hold, float32 ``[..., C + Pr]``; the tile is ``C`` over the scales' count."""
    lead, v_dim, n = values.shape[:-1], values.shape[-1], scales.shape[-1]
    # Both parts are decoded from their bits, not converted (``values.astype(float32)``): XLA:GPU
    # folds a float convert chain such as f32 -> e4m3 -> f32 or f32 -> bf16 -> f32 back to its input
    # (excess precision), which read a row quantized in the same step back unquantized (DeepSeek-V4's
    # step rows on the H200); bit moves are not folded.
    codes = lax.bitcast_convert_type(values, jnp.uint8)
    tiles = decode.e4m3_to_f32(codes, "software").reshape(*lead, n, v_dim // n)
    tiles = tiles * decode_scales(scales)[..., None]
    rope_bits = lax.bitcast_convert_type(rope.astype(jnp.bfloat16), jnp.uint16).astype(jnp.uint32) << 16
    rope32 = lax.bitcast_convert_type(rope_bits, jnp.float32)
    return jnp.concatenate([tiles.reshape(*lead, v_dim), rope32], axis=-1)


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
