"""Decoding of the quantized weight formats of GLM-5.x / DeepSeek-V3.2 / DeepSeek-V4 checkpoints.

Every function here reproduces one format's own definition bit for bit (NumPy only):

- FP8 block scaling (docs/models.md §4.5): ``float8_e4m3fn`` weight, one scale per (b0 x b1) block,
  float32 ``weight_scale_inv`` or ue8m0 (``float8_e8m0fnu`` bytes, 2^(e - 127)); ``W = fp32(q) * s``
  in float32. Edge blocks may be partial (a 576-row weight has 5 row blocks of 128).
- DeepSeek-V4 FP4 experts (§4.6): e2m1 codes packed two per byte along the input dim (low nibble =
  even column), one ue8m0 scale per 32 inputs; ``W = fp32(e2m1) * 2^(e - 127)`` (exact in float32).
- NVIDIA ModelOpt NVFP4 (§4.8): e2m1 codes packed as V4's FP4, one e4m3 scale per 16 inputs of a row
  and one float32 ``weight_scale_2`` per tensor; ``W = e2m1 * fl32(fp32(s) * weight_scale_2)``, the
  per-block product rounded first as ModelOpt's ``NVFP4QTensor.dequantize`` forms it.
- compressed-tensors pack-quantized INT4 (§4.7): eight 4-bit values per int32 along the input dim
  (offset +8), per-group scales, zero points packed along the output dim. ``W = (q - zp) * scale``
  computed **in the scale's dtype and rounded there** (the library's ``_dequantize``: bf16 for the
  GLM-5.x releases). A float32 product differs by up to half a bf16 ulp per weight, enough to flip
  router and indexer top-k choices of a small model (rel-L2 0.17-0.23 on a tiny GLM-5).

The element decoders are written from the bit layouts, not with ml_dtypes casts, so the tests can
hold ml_dtypes, the kernels and these against each other.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import re

import ml_dtypes
import numpy as np

# The ``quantization_config`` of DeepSeek's FP8 releases (V3.2, V4): e4m3 weights in 128x128 blocks
# with ue8m0 (power-of-two) scales. The released configs (the models' ``presets`` modules) carry it.
DEEPSEEK_FP8_QUANTIZATION: dict = {
    "activation_scheme": "dynamic",
    "fmt": "e4m3",
    "quant_method": "fp8",
    "scale_fmt": "ue8m0",
    "weight_block_size": [128, 128],
}


@dataclasses.dataclass(frozen=True)
class QuantConfig:
    """Weight quantization of the checkpoint files (``quantization_config`` in config.json)."""

    method: str  # "fp8" (block-scaled e4m3), "compressed-tensors" (pack-quantized int) or "nvfp4" (ModelOpt)
    weight_block_size: tuple[int, int] = (128, 128)
    num_bits: int = 4
    group_size: int = 32
    symmetric: bool = False
    ignore: tuple[str, ...] = ()
    targets: tuple[str, ...] = ("Linear",)  # compressed-tensors config_groups targets

    def quantizes(self, module: str) -> bool:
        """Whether the Linear layer ``module`` (HF name without ``.weight``) is stored quantized:
        compressed-tensors matches a target or ignore entry when it equals the module name, is the
        class name ``Linear``, or is ``re:<pattern>`` with ``re.match`` (a prefix match) on the name.
        ModelOpt's exclusions are ``fnmatch`` wildcards (docs/models.md §4.8), here matched against the
        module and each module above it (``model.layers.0.self_attn`` excludes that attention's
        linears, as vLLM's matching does)."""
        if self.method == "nvfp4":
            parts = module.split(".")
            names = [".".join(parts[:i]) for i in range(1, len(parts) + 1)]
            return not any(fnmatch.fnmatchcase(name, p) for name in names for p in self.ignore)
        if self.method != "compressed-tensors":
            return True

        def hit(entry: str) -> bool:
            return entry in ("Linear", module) or bool(
                entry.startswith("re:") and re.match(entry[3:], module)
            )

        return any(map(hit, self.targets)) and not any(map(hit, self.ignore))


E8M0 = np.dtype(ml_dtypes.float8_e8m0fnu)
E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
NVFP4_GROUP = 16  # inputs per e4m3 scale of an NVFP4 weight (docs/models.md §4.8)


@dataclasses.dataclass(frozen=True)
class WeightFormat:
    """How one quantized linear is stored, in the kernels' orientation (``W [K, N]``, K = inputs):
    ``format`` "int4", "fp8", "fp4" or "nvfp4"; ``group = (gk, gn)`` elements of K x N per scale;
    ``scale_dtype`` the scales' dtype (bf16 INT4 scales, float32 ``weight_scale_inv``, ue8m0 or e4m3
    bytes); ``zeros``: asymmetric INT4 (zero points stored); ``global_group``: NVFP4's elements per
    global-scale entry, :data:`WHOLE` (as coarse as the weight allows) until narrowed for a layout."""

    format: str
    group: tuple[int, int]
    scale_dtype: np.dtype
    zeros: bool = False
    global_group: tuple[int, int] = (0, 0)  # NVFP4: elements per global scale (narrowed to fit, §4.8)


def weight_format(quant: QuantConfig, scale_dtype=None) -> WeightFormat:
    """The format of a linear that ``quant`` quantizes; ``scale_dtype`` from the file if known
    (else the releases': float32 FP8 ``weight_scale_inv``, bf16 INT4 scales)."""
    if quant.method == "fp8":
        b0, b1 = quant.weight_block_size
        return WeightFormat("fp8", (b1, b0), np.dtype(scale_dtype or np.float32))
    if quant.method == "nvfp4":
        return nvfp4_format()
    return WeightFormat(
        "int4", (quant.group_size, 1), np.dtype(scale_dtype or ml_dtypes.bfloat16), not quant.symmetric
    )


def fp4_format(scale_dtype=None) -> WeightFormat:
    """DeepSeek-V4 FP4 routed experts (§4.6): one scale (ue8m0 in the releases) per 32 inputs."""
    return WeightFormat("fp4", (32, 1), np.dtype(scale_dtype or E8M0))


WHOLE = 1 << 30  # a power of two above any dimension: "one global scale for the whole matrix"


def nvfp4_format() -> WeightFormat:
    """ModelOpt NVFP4 (§4.8): an e4m3 scale per 16 inputs, one float32 global scale per matrix."""
    return WeightFormat("nvfp4", (NVFP4_GROUP, 1), E4M3, global_group=(WHOLE, WHOLE))


def _bytes(a: np.ndarray) -> np.ndarray:
    """The raw bytes of a one-byte array (float8 dtypes viewed as uint8, ints taken mod 256)."""
    a = np.asarray(a)
    if a.dtype.itemsize == 1:
        return a.view(np.uint8)
    return (a & 0xFF).astype(np.uint8)


def decode_e4m3(codes: np.ndarray) -> np.ndarray:
    """float8_e4m3fn bytes -> float32: sign, 4 exponent bits (bias 7), 3 mantissa bits; exponent 0 is
    subnormal (m * 2^-9); no infinities; 0x7F and 0xFF are NaN."""
    u = _bytes(codes).astype(np.int32)
    e, m = (u >> 3) & 0xF, u & 0x7
    mag = np.where(e == 0, np.ldexp(m.astype(np.float32), -9), np.ldexp((8 + m).astype(np.float32), e - 10))
    val = np.where(u & 0x80, -mag, mag).astype(np.float32)
    return np.where((u & 0x7F) == 0x7F, np.float32(np.nan), val)


def decode_e2m1(codes: np.ndarray) -> np.ndarray:
    """4-bit e2m1 codes (0..15) -> float32: sign, 2 exponent bits (bias 1), 1 mantissa bit; exponent 0
    is subnormal (0 or 0.5). Values 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives; no NaN/inf."""
    n = np.asarray(codes).astype(np.int32) & 0xF
    e, m = (n >> 1) & 0x3, n & 0x1
    mag = np.where(e == 0, 0.5 * m, np.ldexp((2 + m).astype(np.float32), e - 2)).astype(np.float32)
    return np.where(n & 0x8, -mag, mag).astype(np.float32)


def decode_e8m0(scale: np.ndarray) -> np.ndarray:
    """ue8m0 scale bytes -> float32 ``2^(e - 127)`` (exact, 2^-127 included); e = 255 is NaN."""
    e = _bytes(scale).astype(np.int32)
    return np.where(e == 255, np.float32(np.nan), np.ldexp(np.float32(1.0), e - 127)).astype(np.float32)


def block_scales(scale: np.ndarray, shape: tuple[int, int], block: tuple[int, int]) -> np.ndarray:
    """The float32 scale of every element of a ``shape`` weight in ``block`` blocks (ceil grid).

    ``scale`` is float (``weight_scale_inv``) or ``float8_e8m0fnu`` (V4 ``.scale``)."""
    out, inp = shape
    b0, b1 = block
    expected = (-(-out // b0), -(-inp // b1))
    if scale.shape != expected:
        raise ValueError(f"scale shape {scale.shape} != {expected} for a {shape} weight in {b0}x{b1} blocks")
    s = decode_e8m0(scale) if scale.dtype == E8M0 else np.asarray(scale, np.float32)
    return np.repeat(np.repeat(s, b0, axis=0)[:out], b1, axis=1)[:, :inp]


def dequantize_fp8_block(weight: np.ndarray, scale: np.ndarray, block: tuple[int, int]) -> np.ndarray:
    """W[i, j] = fp32(q[i, j]) * scale[i // b0, j // b1] -> float32 [out, in]."""
    return decode_e4m3(weight) * block_scales(scale, weight.shape, block)


def unpack_fp4(packed: np.ndarray) -> np.ndarray:
    """V4 FP4 bytes ``[..., out, in / 2]`` -> e2m1 codes ``[..., out, in]`` (uint8 0..15): the low nibble
    of byte k is column 2k, the high nibble column 2k + 1."""
    u = _bytes(packed)
    return np.stack([u & 0xF, u >> 4], axis=-1).reshape(*u.shape[:-1], 2 * u.shape[-1])


def dequantize_fp4(packed: np.ndarray, scale: np.ndarray, group: int = 32) -> np.ndarray:
    """W[i, j] = e2m1(code[i, j]) * 2^(e[i, j // group] - 127) -> float32 [out, in]."""
    codes = unpack_fp4(packed)
    groups = -(-codes.shape[-1] // group)
    if scale.shape != codes.shape[:-1] + (groups,):
        raise ValueError(f"scale shape {scale.shape} != {codes.shape[:-1] + (groups,)} for FP4 {codes.shape}")
    s = np.repeat(decode_e8m0(scale), group, axis=-1)[..., : codes.shape[-1]]
    return decode_e2m1(codes) * s


def dequantize_nvfp4(packed: np.ndarray, scale: np.ndarray, global_scale) -> np.ndarray:
    """W[i, j] = e2m1(code[i, j]) * fl32(fp32(s[i, j // 16]) * g) -> float32 ``[..., out, in]``.

    ``packed`` uint8 ``[..., out, in / 2]`` (low nibble = even column); ``scale`` e4m3 bytes
    ``[..., out, in / 16]``; ``global_scale`` (``weight_scale_2``) a float32 scalar, or one per
    leading index (``[...]``, e.g. per expert). The block's scale times g is rounded to float32
    once, then the product with the e2m1 value once more, as ModelOpt's ``dequantize`` computes."""
    codes = unpack_fp4(packed)
    groups = -(-codes.shape[-1] // NVFP4_GROUP)
    if scale.shape != codes.shape[:-1] + (groups,):
        raise ValueError(
            f"weight_scale shape {scale.shape} != {codes.shape[:-1] + (groups,)} for {codes.shape}"
        )
    g = np.asarray(global_scale, np.float32).reshape(np.shape(global_scale) + (1, 1))
    block = decode_e4m3(scale) * g  # float32 * float32: one rounding per block
    return decode_e2m1(codes) * np.repeat(block, NVFP4_GROUP, axis=-1)[..., : codes.shape[-1]]


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


def int4_values(
    packed: np.ndarray,
    scale: np.ndarray,
    zero_point: np.ndarray | None,
    shape: tuple[int, int],
    group_size: int,
) -> tuple[np.ndarray, np.ndarray | None]:
    """The signed INT4 values ``q [out, in]`` and zero points ``zp [out, groups]`` (None when
    symmetric) of a compressed-tensors pack-quantized weight, with every shape checked."""
    out, inp = shape
    groups = -(-inp // group_size)
    if packed.shape != (out, -(-inp // 8)):
        raise ValueError(f"weight_packed shape {packed.shape} != {(out, -(-inp // 8))} for shape {shape}")
    if scale.shape != (out, groups):
        raise ValueError(
            f"weight_scale shape {scale.shape} != {(out, groups)} for shape {shape}, group {group_size}"
        )
    q = unpack_int4(packed, inp, axis=1)
    if zero_point is None:
        return q, None
    if zero_point.shape != (-(-out // 8), groups):
        raise ValueError(f"weight_zero_point shape {zero_point.shape} != {(-(-out // 8), groups)}")
    return q, unpack_int4(zero_point, out, axis=0)


def dequantize_int4_values(
    q: np.ndarray, scale: np.ndarray, zero_point: np.ndarray | None, group_size: int
) -> np.ndarray:
    """``(q - zp) * scale`` in the scale's dtype, as compressed-tensors' ``_dequantize`` computes it.

    ``q - zp`` is an integer in [-15, 15], exact in any float type; its product with a bf16 / f16
    scale is exact in float32 (at most 4 + 11 significant bits), so rounding the float32 product to
    the scale's dtype equals the library's rounded bf16 / f16 multiply. Float32 scales round once,
    in float32, as the library does. Returns an array of ``scale.dtype``; ``q [..., out, in]``,
    ``scale`` / ``zero_point [..., out, groups]``.
    """
    inp = q.shape[-1]
    per_col = lambda a: np.repeat(a, group_size, axis=-1)[..., :inp]  # noqa: E731
    diff = q.astype(np.int32) - (0 if zero_point is None else per_col(zero_point.astype(np.int32)))
    return (diff.astype(np.float32) * per_col(scale.astype(np.float32))).astype(scale.dtype)


def dequantize_int4_packed(
    packed: np.ndarray,
    scale: np.ndarray,
    zero_point: np.ndarray | None,
    shape: tuple[int, int],
    group_size: int,
) -> np.ndarray:
    """W[i, j] = (q[i, j] - zp[i, j // G]) * scale[i, j // G] in the scale's dtype -> [out, in]."""
    q, zp = int4_values(packed, scale, zero_point, shape, group_size)
    return dequantize_int4_values(q, scale, zp, group_size)
