"""Dequantization of the quantized weight formats found in GLM-5.x / DeepSeek-V3.2 checkpoints.

- FP8 block scaling (models.md §4.5): ``float8_e4m3fn`` weight with a float32 ``weight_scale_inv``
  per (b0 x b1) block; edge blocks may be partial (a 576-row weight has 5 row blocks of 128).
- compressed-tensors pack-quantized INT4 (models.md §4.7): eight 4-bit values per int32 along
  the input dim (offset +8), per-group scales, and zero points packed along the output dim.
"""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class QuantConfig:
    """Weight quantization of the checkpoint files (``quantization_config`` in config.json)."""

    method: str  # "fp8" (block-scaled e4m3) or "compressed-tensors" (pack-quantized int)
    weight_block_size: tuple[int, int] = (128, 128)
    num_bits: int = 4
    group_size: int = 32
    symmetric: bool = False
    ignore: tuple[str, ...] = ()


def dequantize_fp8_block(weight: np.ndarray, scale: np.ndarray, block: tuple[int, int]) -> np.ndarray:
    """W[i, j] = fp32(q[i, j]) * scale[i // b0, j // b1] -> float32 [out, in]."""
    out, inp = weight.shape
    b0, b1 = block
    expected = (-(-out // b0), -(-inp // b1))
    if scale.shape != expected:
        raise ValueError(
            f"scale shape {scale.shape} != {expected} for a {weight.shape} weight in {b0}x{b1} blocks"
        )
    full = np.repeat(np.repeat(scale.astype(np.float32), b0, axis=0)[:out], b1, axis=1)[:, :inp]
    return weight.astype(np.float32) * full


def unpack_int4(packed: np.ndarray, count: int, axis: int) -> np.ndarray:
    """Unpack int32 words holding eight 4-bit fields (element k at bits 4k..4k+3) along ``axis``.

    Returns the signed values (stored offset +8 removed), trimmed to ``count`` along ``axis``.
    """
    words = packed.astype(np.uint32)
    nibbles = np.stack([(words >> (4 * k)) & 0xF for k in range(8)], axis=axis + 1)
    shape = list(packed.shape)
    shape[axis] *= 8
    values = nibbles.reshape(shape).astype(np.int32) - 8
    return np.take(values, np.arange(count), axis=axis)


def dequantize_int4_packed(
    packed: np.ndarray,
    scale: np.ndarray,
    zero_point: np.ndarray | None,
    shape: tuple[int, int],
    group_size: int,
) -> np.ndarray:
    """W[i, j] = (q[i, j] - zp[i, j // G]) * scale[i, j // G] -> float32 [out, in]."""
    out, inp = shape
    groups = -(-inp // group_size)
    if packed.shape != (out, -(-inp // 8)):
        raise ValueError(f"weight_packed shape {packed.shape} != {(out, -(-inp // 8))} for shape {shape}")
    if scale.shape != (out, groups):
        raise ValueError(
            f"weight_scale shape {scale.shape} != {(out, groups)} for shape {shape}, group {group_size}"
        )
    q = unpack_int4(packed, inp, axis=1)
    zp = np.zeros((out, groups), np.int32)
    if zero_point is not None:
        if zero_point.shape != (-(-out // 8), groups):
            raise ValueError(f"weight_zero_point shape {zero_point.shape} != {(-(-out // 8), groups)}")
        zp = unpack_int4(zero_point, out, axis=0)
    per_col = lambda a: np.repeat(a, group_size, axis=1)[:, :inp]  # noqa: E731
    return (q - per_col(zp)).astype(np.float32) * per_col(scale.astype(np.float32))
