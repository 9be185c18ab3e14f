"""Decoding DeepSeek-V4's quantized weight formats to float32, in NumPy (models.md §4.4-§4.6).

- **FP8 with ue8m0 scales**: ``float8_e4m3fn`` weight ``[out, in]`` plus ``X.scale`` in
  ``float8_e8m0fnu`` (one power of two per ``b0 x b1`` block, ceil blocks: edge blocks may be
  partial): ``W[i, j] = fp32(q[i, j]) * 2^(e[i // b0, j // b1] - 127)``.
- **FP4 routed experts (MXFP4-style)**: int8 ``[out, in / 2]``, two e2m1 codes per byte (low nibble
  = even column), plus ``X.scale`` e8m0 ``[out, in / 32]``: ``W[i, j] = e2m1(code[i, j]) * 2^(e - 127)``.

Every product is exact in float32 (a 4-bit or 8-bit significand times a power of two), so these
decoders reproduce the reference dequantization bit for bit. Scales stored as float32 (already
decoded) are accepted as well.

Overlap: ``checkpoints/quant.py`` (branch ``quant``) decodes the GLM / V3.2 formats (fp32
``weight_scale_inv`` blocks, compressed-tensors INT4); this module only adds what V4 needs and
shares no code with it, so the two merge without conflicts.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

FP4_BLOCK = 32

# e2m1 code -> value: sign bit 3, then exponent (2 bits, bias 1) and one mantissa bit.
E2M1_VALUES = np.array(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32
)


def decode_e8m0(scale: np.ndarray) -> np.ndarray:
    """ue8m0 scales -> float32 powers of two: byte e -> 2^(e - 127); 255 -> NaN. float32 passes through."""
    if scale.dtype == np.float32:
        return scale
    if scale.dtype == np.dtype(ml_dtypes.float8_e8m0fnu):
        scale = scale.view(np.uint8)
    if scale.dtype != np.uint8:
        raise ValueError(f"expected float8_e8m0fnu, uint8 or float32 scales, got {scale.dtype}")
    exponent = scale.astype(np.int32) - 127
    values = np.ldexp(np.float32(1.0), exponent).astype(np.float32)
    return np.where(scale == 255, np.float32(np.nan), values)


def _expand(scale: np.ndarray, rows: int, cols: int, b0: int, b1: int) -> np.ndarray:
    """Scale grid -> one scale per element (ceil blocks, the partial edge blocks trimmed)."""
    return np.repeat(np.repeat(scale, b0, axis=0)[:rows], b1, axis=1)[:, :cols]


def dequantize_fp8(weight: np.ndarray, scale: np.ndarray, block: tuple[int, int]) -> np.ndarray:
    """e4m3 ``[out, in]`` with a ``[ceil(out/b0), ceil(in/b1)]`` scale grid -> float32 ``[out, in]``."""
    if weight.dtype != np.dtype(ml_dtypes.float8_e4m3fn):
        raise ValueError(f"expected a float8_e4m3fn weight, got {weight.dtype}")
    rows, cols = weight.shape
    b0, b1 = block
    expected = (-(-rows // b0), -(-cols // b1))
    if scale.shape != expected:
        raise ValueError(f"scale {scale.shape} != {expected} for a {weight.shape} weight in {b0}x{b1} blocks")
    return weight.astype(np.float32) * _expand(decode_e8m0(scale), rows, cols, b0, b1)


def unpack_e2m1(packed: np.ndarray) -> np.ndarray:
    """int8 / uint8 ``[out, in/2]`` -> float32 values ``[out, in]`` (low nibble = even column)."""
    if packed.dtype not in (np.int8, np.uint8):
        raise ValueError(f"expected packed int8 / uint8 e2m1 codes, got {packed.dtype}")
    b = packed.view(np.uint8)
    codes = np.stack([b & 0xF, b >> 4], axis=-1).reshape(b.shape[0], -1)
    return E2M1_VALUES[codes]


def dequantize_fp4(packed: np.ndarray, scale: np.ndarray, block: int = FP4_BLOCK) -> np.ndarray:
    """Packed e2m1 ``[out, in/2]`` with ``[out, in/block]`` ue8m0 scales -> float32 ``[out, in]``."""
    rows, half = packed.shape
    cols = 2 * half
    if scale.shape != (rows, -(-cols // block)):
        raise ValueError(f"scale {scale.shape} != {(rows, -(-cols // block))} for fp4 [{rows}, {cols}]")
    return unpack_e2m1(packed) * _expand(decode_e8m0(scale), rows, cols, 1, block)
