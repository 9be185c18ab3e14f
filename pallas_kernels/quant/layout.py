"""The quantized-weight container the kernels read, and the packers that build it.

:class:`QuantizedWeight` holds one matrix (or a stack of them, e.g. routed experts ``[E, K, N]``) in
the orientation the model multiplies, ``y = x @ W`` with ``W [K, N]`` (HF stores ``[N, K]``; the
packers transpose). It is a JAX pytree: ``codes``, ``scales`` and ``zeros`` are leaves, the format,
group and chunk size are static. Every leaf keeps the weight's axes in the same order, ``[..., K', N']``,
so one ``PartitionSpec`` (or ``NamedSharding``) applies to all of them; a split along K or N then
cuts codes, scales and zero points at the same places, provided it cuts at group boundaries
(:func:`check_split`). The logical shape is derived from the codes (never stored), so it stays right
for the per-shard leaves inside a ``shard_map``.

Formats (docs/models.md §4.5-4.7), ``group = (gk, gn)`` elements of K x N sharing one scale:

- ``int4`` (compressed-tensors pack-quantized): ``codes`` ``[..., K/8, N]`` int32 words of eight 4-bit
  codes ``q + 8`` (or ``[..., K/2, N]`` uint8, two per byte, when K is not a multiple of 256);
  ``scales`` ``[..., K/g, N]`` in the checkpoint's dtype (bf16); ``zeros`` uint8 ``[..., K/g, N]``
  holding ``zp + 8`` (None when symmetric: zero point 0). Group ``(g, 1)``.
  ``W = round_to_scale_dtype((q - zp) * scale)``, as the library dequantizes.
- ``fp8`` (block-scaled e4m3): ``codes`` float8_e4m3fn ``[..., K, N]``; ``scales`` float32
  (``weight_scale_inv``) or float8_e8m0fnu (ue8m0) ``[..., ceil(K/b1), ceil(N/b0)]``; group
  ``(b1, b0)``; partial last blocks allowed. ``W = fp32(q) * s``.
- ``fp4`` (DeepSeek-V4 routed experts): ``codes`` uint8 ``[..., K/2, N]`` of e2m1 codes; ``scales``
  float8_e8m0fnu ``[..., K/32, N]``; group ``(32, 1)``. ``W = e2m1(q) * 2^(e - 127)``.
- ``nvfp4`` (NVIDIA ModelOpt): ``codes`` as ``fp4``; ``scales`` float8_e4m3fn ``[..., K/16, N]``, group
  ``(16, 1)``; ``global_scales`` float32 ``[..., K/gk', N/gn']``, each entry the ``weight_scale_2`` of the
  matrix it covers, ``global_group = (gk', gn')`` powers of two (a matrix's largest, narrowed where a
  split or a join needs): ``W = e2m1(q) * fl32(fp32(s) * g)``, the block's product rounded first
  (docs/models.md §4.8). The global scales stay float32 and apart: folded into the e4m3 scales they
  would be rounded to 4 bits. Leading axes (experts) keep one global scale per matrix, and the
  ``[gate | up]`` join keeps each half's, whose scales need not agree.

4-bit codes are packed in K chunks of ``kpack`` rows, cut into 32-row (``kpack/2``-row for bytes)
pieces that one code row holds side by side:

- ``kpack`` = 256 (:data:`WORD_KPACK`; INT4 with K a multiple of 256, the model's routed experts, see
  :func:`default_kpack`): word row ``r`` of chunk ``c`` holds row ``c*256 + 32*j + r`` in nibble ``j``
  (bits ``4j .. 4j+3``), j = 0..7;
- ``kpack`` = 64 or 32 (FP4, and other INT4 weights): byte row ``r`` of chunk ``c`` holds row
  ``c*kpack + r`` in its low nibble and row ``c*kpack + kpack/2 + r`` in its high nibble.

A kernel unpacks each piece with a shift and a mask and multiplies it with one column slice of the
activations: no interleave, which Pallas-Triton could not express (no concatenate or gather on
values). Words are the faster layout: Triton decodes codes in the tensor-core operand layout, where
a thread holds K-consecutive codes of one column, and reads them from shared memory one code row
at a time, so a word row serves eight weights per load where a byte row serves two
(``benchmarks/results/profile-h100-moe-4bit.md``; the INT4 MoE 1.14-1.21x faster on the H100 at
T <= 512, ``quant-h100-int4-words.md``).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from pallas_kernels.quant.decode import e8m0_to_f32

FORMATS = ("int4", "fp8", "fp4", "nvfp4")
E8M0 = np.dtype(ml_dtypes.float8_e8m0fnu)
E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
FP4_GROUP = 32
NVFP4_GROUP = 16
WORD_KPACK = 256  # 4-bit chunk of 8 x 32 rows held in int32 words (module docstring)
WORD_PIECE = WORD_KPACK // 8  # rows per nibble of a word chunk


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["codes", "scales", "zeros", "global_scales"],
    meta_fields=["format", "group", "kpack", "global_group"],
)
@dataclasses.dataclass(frozen=True)
class QuantizedWeight:
    """One quantized ``[..., K, N]`` weight in the kernels' layout (see the module docstring)."""

    codes: Any
    scales: Any
    zeros: Any = None
    format: str = "int4"
    group: tuple[int, int] = (32, 1)
    kpack: int = 0  # K rows per packed chunk (4-bit formats); 0 for fp8
    global_scales: Any = None  # nvfp4 only: float32 weight_scale_2 per global_group
    global_group: tuple[int, int] = (0, 0)

    def __post_init__(self):
        if self.format not in FORMATS:
            raise ValueError(f"unknown weight format {self.format!r}; choose one of {', '.join(FORMATS)}")

    @property
    def packed(self) -> bool:
        """4-bit codes, several per code element along K."""
        return self.format != "fp8"

    @property
    def rows_per_code(self) -> int:
        """Weight rows (K) per code row: 8 (int32 words), 2 (bytes) or 1 (fp8)."""
        return codes_per_element(self.kpack) if self.packed else 1

    @property
    def shape(self) -> tuple[int, ...]:
        """Logical ``(..., K, N)``."""
        *lead, k, n = self.codes.shape
        return (*lead, k * self.rows_per_code, n)

    @property
    def nbytes(self) -> int:
        return sum(int(np.prod(a.shape)) * np.dtype(a.dtype).itemsize for a in jax.tree.leaves(self))

    def replace(self, **changes: Any) -> QuantizedWeight:
        return dataclasses.replace(self, **changes)


def take_layer(stack: Any, layer: jax.Array) -> Any:
    """Layer ``layer`` (a traced int32 scalar) of a weight stacked over layers ``[L, ...]``: an array, a
    :class:`QuantizedWeight`, or a dict of them (every leaf sliced along its leading dim). What a
    reference implementation does with a stack the kernels index in place."""
    return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, layer, 0, keepdims=False), stack)


def _xp(a):
    return jnp if isinstance(a, jax.Array) else np


def _weight(
    codes,
    scales,
    zeros,
    fmt: str,
    group: tuple[int, int],
    kpack: int,
    global_scales=None,
    global_group=(0, 0),
) -> QuantizedWeight:
    """A QuantizedWeight whose NumPy leaves are contiguous (ready to be sliced and put on devices)."""
    tidy = lambda a: np.ascontiguousarray(a) if isinstance(a, np.ndarray) else a  # noqa: E731
    return QuantizedWeight(
        *(None if a is None else tidy(a) for a in (codes, scales, zeros)),
        fmt,
        group,
        kpack,
        None if global_scales is None else tidy(global_scales),
        global_group,
    )


def _pow2(n: int, what: str) -> int:
    if n < 1 or n & (n - 1):
        raise ValueError(f"{what} must be a power of two, got {n}")
    return n


def codes_per_element(kpack: int) -> int:
    """4-bit codes per code element for chunks of ``kpack`` rows: 8 per int32 word, 2 per byte."""
    return 8 if kpack == WORD_KPACK else 2


def codes_dtype(kpack: int) -> np.dtype:
    """The dtype 4-bit codes are packed in for chunks of ``kpack`` rows."""
    return np.dtype(np.int32 if kpack == WORD_KPACK else np.uint8)


def default_kpack(k: int, fmt: str = "int4", *, words: bool = True) -> int:
    """The packed chunk for a 4-bit weight of K rows: :data:`WORD_KPACK` for INT4 and FP4 with K a
    multiple of it (unless ``words`` is False), else 64, or 32 when K is not a multiple of 64 (K must
    be a multiple of 32). The model asks for words for routed experts only: on the H100 they made the
    INT4 MoE 1.14-1.21x faster at T = 1..512 (4096: 2 % slower), while GLM-5's linears came out
    mixed (o_proj and the dense / shared MLPs faster, kv_a, kv_b, q_b and the indexer's wq_b slower;
    ``benchmarks/results/quant-h100-int4-words*.md``); FP4 experts with the packed-register decode
    1.2-1.3x faster on the H200 at T = 1..128 (``quant-h200-fp4-ptx.md``). NVFP4 stays in bytes: its
    16-row scale groups want 16-row pieces, and a word's nibble holds 32 rows."""
    candidates = ((WORD_KPACK,) if fmt in ("int4", "fp4") and words else ()) + (64, 32)
    for kpack in candidates:
        if k % kpack == 0:
            return kpack
    raise ValueError(f"4-bit weights need K (the input dim) to be a multiple of 32, got {k}")


def pack_nibbles(codes, kpack: int):
    """``codes [..., K, N]`` (values 0..15) -> ``[..., K/8, N]`` int32 words (``kpack`` 256) or
    ``[..., K/2, N]`` bytes, in K chunks of ``kpack`` (module docstring)."""
    xp = _xp(codes)
    *lead, k, n = codes.shape
    per = codes_per_element(kpack)
    c = codes.astype(xp.uint32).reshape(*lead, k // kpack, per, kpack // per, n)
    packed = c[..., 0, :, :]
    for j in range(1, per):
        packed = packed | (c[..., j, :, :] << (4 * j))
    packed = packed.reshape(*lead, k // per, n)
    if per == 2:
        return packed.astype(xp.uint8)
    return packed.view(np.int32) if xp is np else jax.lax.bitcast_convert_type(packed, jnp.int32)


def unpack_nibbles(packed, kpack: int):
    """Inverse of :func:`pack_nibbles`: words or bytes -> codes ``[..., K, N]`` (uint8)."""
    xp = _xp(packed)
    *lead, rows, n = packed.shape
    per = codes_per_element(kpack)
    p = packed.astype(xp.int32).reshape(*lead, per * rows // kpack, 1, kpack // per, n)
    nibbles = [(p >> (4 * j)) & 0xF for j in range(per)]
    return xp.concatenate(nibbles, axis=-3).reshape(*lead, per * rows, n).astype(xp.uint8)


def pack_int4(q, scale, zero_point=None, *, group_size: int, kpack: int | None = None) -> QuantizedWeight:
    """compressed-tensors INT4 in HF orientation -> the kernels' layout.

    ``q [..., N, K]`` signed values in [-8, 7]; ``scale [..., N, ceil(K/g)]`` (kept in its dtype);
    ``zero_point`` signed ``[..., N, ceil(K/g)]`` or None (symmetric). NumPy in, NumPy out; jax in,
    jax out.
    """
    xp = _xp(q)
    *_, n, k = q.shape
    _pow2(group_size, "the INT4 group size")
    if scale.shape[-2:] != (n, -(-k // group_size)):
        raise ValueError(f"scale {scale.shape} does not match a {q.shape} weight in groups of {group_size}")
    kpack = kpack or default_kpack(k, "int4")
    codes = pack_nibbles(xp.swapaxes(q + 8, -1, -2), kpack)
    zeros = None if zero_point is None else xp.swapaxes(zero_point + 8, -1, -2).astype(xp.uint8)
    return _weight(codes, xp.swapaxes(scale, -1, -2), zeros, "int4", (group_size, 1), kpack)


def pack_fp8(q, scale, *, block: tuple[int, int]) -> QuantizedWeight:
    """Block-scaled e4m3 in HF orientation -> the kernels' layout.

    ``q [..., N, K]`` float8_e4m3fn; ``scale [..., ceil(N/b0), ceil(K/b1)]`` float32 or
    float8_e8m0fnu; ``block = (b0, b1)`` as in ``weight_block_size`` (rows, columns of ``q``).
    """
    xp = _xp(q)
    b0, b1 = (_pow2(b, "the FP8 block size") for b in block)
    *_, n, k = q.shape
    if scale.shape[-2:] != (-(-n // b0), -(-k // b1)):
        raise ValueError(f"scale {scale.shape} does not match a {q.shape} weight in {b0}x{b1} blocks")
    return _weight(xp.swapaxes(q, -1, -2), xp.swapaxes(scale, -1, -2), None, "fp8", (b1, b0), 0)


def pack_fp4(codes, scale, *, kpack: int | None = None) -> QuantizedWeight:
    """DeepSeek-V4 FP4 in HF orientation -> the kernels' layout.

    ``codes [..., N, K]`` e2m1 codes (0..15, e.g. from ``jaxdsa.checkpoints.quant.unpack_fp4``);
    ``scale [..., N, K/32]`` float8_e8m0fnu.
    """
    xp = _xp(codes)
    *_, n, k = codes.shape
    if scale.shape[-2:] != (n, -(-k // FP4_GROUP)):
        raise ValueError(f"scale {scale.shape} does not match a {codes.shape} FP4 weight")
    kpack = kpack or default_kpack(k, "fp4")
    packed = pack_nibbles(xp.swapaxes(codes, -1, -2), kpack)
    return _weight(packed, xp.swapaxes(scale, -1, -2), None, "fp4", (FP4_GROUP, 1), kpack)


def pack_nvfp4(
    codes, scale, global_scale, *, kpack: int | None = None, global_group: tuple[int, int] | None = None
) -> QuantizedWeight:
    """ModelOpt NVFP4 in HF orientation -> the kernels' layout.

    ``codes [..., N, K]`` e2m1 codes (0..15, e.g. ``jaxdsa.checkpoints.quant.unpack_fp4`` of the
    ``weight`` bytes); ``scale [..., N, K/16]`` float8_e4m3fn (``weight_scale``); ``global_scale``
    (``weight_scale_2``) a float32 scalar or one per leading index ``[...]`` (experts). The global
    scales cover blocks of ``global_group`` (powers of two; default the largest that divide K and N),
    the last ones partial where they do not divide: each matrix has one value, so any grid holds it.
    """
    xp = _xp(codes)
    *lead, n, k = codes.shape
    if scale.shape[-2:] != (n, -(-k // NVFP4_GROUP)):
        raise ValueError(f"scale {scale.shape} does not match a {codes.shape} NVFP4 weight")
    kpack = kpack or default_kpack(k, "nvfp4")
    gk, gn = global_group or (k & -k, n & -n)  # the largest powers of two dividing K and N
    g = xp.asarray(global_scale, xp.float32)[..., None, None]
    global_scales = xp.broadcast_to(g, (*lead, -(-k // gk), -(-n // gn)))
    packed = pack_nibbles(xp.swapaxes(codes, -1, -2), kpack)
    return _weight(
        packed, xp.swapaxes(scale, -1, -2), None, "nvfp4", (NVFP4_GROUP, 1), kpack, global_scales, (gk, gn)
    )


def reblock_global(w: QuantizedWeight, group: tuple[int, int]) -> QuantizedWeight:
    """The same NVFP4 weight with its global scales over ``group`` (divisors of the current): each
    entry repeated. Exact (the values are copies); lets a weight be split or joined inside a
    matrix's global-scale block."""
    if w.global_scales is None or tuple(group) == tuple(w.global_group):
        return w
    (ok, on), (nk, nn) = w.global_group, group
    if ok % nk or on % nn:
        raise ValueError(f"cannot reblock {w.global_group} global-scale groups into {tuple(group)}")
    xp = _xp(w.global_scales)
    k, n = w.shape[-2:]
    g = xp.repeat(w.global_scales, ok // nk, axis=-2)[..., : -(-k // nk), :]
    g = xp.repeat(g, on // nn, axis=-1)[..., : -(-n // nn)]
    return w.replace(global_scales=g, global_group=tuple(group))


def reblock_n(w: QuantizedWeight, gn: int) -> QuantizedWeight:
    """The same weight with ``gn`` (a divisor of the current) output columns per scale: each scale
    column repeated. Exact; lets FP8 weights whose widths are not multiples of the block be joined
    or split along N."""
    old = w.group[1]
    if gn == old:
        return w
    if old % gn:
        raise ValueError(f"cannot reblock {old}-column scale groups into groups of {gn}")
    xp = _xp(w.scales)
    n = w.shape[-1]
    repeat = lambda a: xp.repeat(a, old // gn, axis=-1)[..., : -(-n // gn)]  # noqa: E731
    zeros = None if w.zeros is None else repeat(w.zeros)
    return w.replace(scales=repeat(w.scales), zeros=zeros, group=(w.group[0], gn))


def reblock_k(w: QuantizedWeight, gk: int) -> QuantizedWeight:
    """The same weight with ``gk`` (a divisor of the current) input rows per scale: each scale (and
    zero-point) row repeated. Exact; lets a weight be split along K (row-parallel) into shards that
    are not whole groups of the checkpoint's block."""
    old = w.group[0]
    if gk == old:
        return w
    if old % gk:
        raise ValueError(f"cannot reblock {old}-row scale groups into groups of {gk}")
    xp = _xp(w.scales)
    k = w.shape[-2]
    repeat = lambda a: xp.repeat(a, old // gk, axis=-2)[..., : -(-k // gk), :]  # noqa: E731
    zeros = None if w.zeros is None else repeat(w.zeros)
    return w.replace(scales=repeat(w.scales), zeros=zeros, group=(gk, w.group[1]))


def _zero_pad(a, axis: int, extra: int):
    """``a`` with ``extra`` zero bytes / values appended along ``axis`` (float8 types through their
    bytes: e4m3 +0, ue8m0 2^-127). NumPy in, NumPy out; jax in, jax out."""
    widths = [(0, 0)] * a.ndim
    widths[axis] = (0, extra)
    dtype = np.dtype(a.dtype)
    if dtype not in (E4M3, E8M0):
        return _xp(a).pad(a, widths)
    if isinstance(a, np.ndarray):
        return np.pad(a.view(np.uint8), widths).view(dtype)
    return jax.lax.bitcast_convert_type(jnp.pad(jax.lax.bitcast_convert_type(a, jnp.uint8), widths), dtype)


def _pad(w: QuantizedWeight, axis: int, size: int) -> QuantizedWeight:
    """``w`` grown to ``size`` along ``axis`` (-2: K, -1: N) with zero code bytes, and zero scales
    (and zero points) for the new scale groups."""
    extra = size - w.shape[axis]
    if extra <= 0:
        return w
    groups = -(-size // w.group[axis]) - w.scales.shape[axis]
    pad = lambda a: None if a is None else _zero_pad(a, axis, groups)  # noqa: E731
    rows = extra // w.rows_per_code if axis == -2 else extra
    global_scales = w.global_scales
    if global_scales is not None:  # the new weights' e4m3 scales are 0: any global scale gives 0
        more = -(-size // w.global_group[axis]) - global_scales.shape[axis]
        global_scales = _zero_pad(global_scales, axis, more)
    return w.replace(
        codes=_zero_pad(w.codes, axis, rows),
        scales=pad(w.scales),
        zeros=pad(w.zeros),
        global_scales=global_scales,
    )


def pad_n(w: QuantizedWeight, n: int) -> QuantizedWeight:
    """``w`` widened to ``n`` output columns whose weights are 0: zero codes (e4m3 +0) and zero
    scales for columns in new scale groups (every 4-bit column is one: groups are ``(g, 1)``), so
    every format's value there is exactly 0 (NVFP4's new global scales are 0 too)."""
    return _pad(w, -1, n)


def pad_k(w: QuantizedWeight, k: int) -> QuantizedWeight:
    """``w`` lengthened to ``k`` input rows whose weights are 0. FP8: +0 codes, 0 under any scale. A
    4-bit weight's zero byte is not a zero INT4 weight, so its rows come in whole packed chunks and
    whole scale groups, whose zero scales make them 0: its K and ``k`` must be multiples of both."""
    kk, gk = w.shape[-2], w.group[0]
    if w.packed and k > kk and (kk % w.kpack or kk % gk or k % w.kpack):
        raise ValueError(
            f"a {w.format} weight of K = {kk} is padded to {k} rows only in whole {w.kpack}-row packed "
            f"chunks and {gk}-row scale groups"
        )
    return _pad(w, -2, k)


def concat_n(*parts: QuantizedWeight) -> QuantizedWeight:
    """Join weights of one format along N (e.g. an expert's gate and up into gate|up). Scale groups
    (and NVFP4's global-scale groups, each part keeping its own values) are narrowed
    (:func:`reblock_n`, :func:`reblock_global`) until every part but the last ends on a group
    boundary."""
    first = parts[0]
    if any(
        (p.format, p.group[0], p.kpack, p.shape[:-1])
        != (first.format, first.group[0], first.kpack, first.shape[:-1])
        for p in parts
    ):
        raise ValueError("concat_n needs parts of one format, K group, chunk size and leading shape")
    gn = first.group[1]
    while any(p.shape[-1] % gn for p in parts[:-1]):
        gn //= 2
    parts = tuple(reblock_n(p, gn) for p in parts)
    global_group = first.global_group
    if first.global_scales is not None:
        gk, ggn = min(p.global_group[0] for p in parts), min(p.global_group[1] for p in parts)
        while any(p.shape[-1] % ggn for p in parts[:-1]):
            ggn //= 2
        global_group = (gk, ggn)
        parts = tuple(reblock_global(p, global_group) for p in parts)
    xp = _xp(first.codes)
    cat = lambda name: (
        None
        if getattr(first, name) is None
        else xp.concatenate(  # noqa: E731
            [getattr(p, name) for p in parts], axis=-1
        )
    )
    return first.replace(
        codes=cat("codes"),
        scales=cat("scales"),
        zeros=cat("zeros"),
        global_scales=cat("global_scales"),
        group=(first.group[0], gn),
        global_group=global_group,
    )


def check_split(w: QuantizedWeight, axis: str, parts: int) -> None:
    """Raise ValueError unless splitting ``w`` into ``parts`` equal shards along ``axis`` ('k' or 'n')
    cuts codes, scales (zero points, global scales) at the same boundaries: every shard must hold
    whole scale groups (whole global-scale groups, and along K whole packed chunks)."""
    k, n = w.shape[-2:]
    (gk, gn), (ggk, ggn) = w.group, w.global_group
    size, group = (k, math.lcm(gk, w.kpack or 1, ggk or 1)) if axis == "k" else (n, math.lcm(gn, ggn or 1))
    if size % parts or (size // parts) % group:
        raise ValueError(
            f"a {w.format} weight of {axis.upper()} = {size} does not split into {parts} shards of whole "
            f"{group}-element groups"
        )


_E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float32)


def scales_f32(w: QuantizedWeight) -> jax.Array:
    """The scales as float32 (ue8m0 decoded exactly)."""
    if np.dtype(w.scales.dtype) == E8M0:
        return e8m0_to_f32(jax.lax.bitcast_convert_type(jnp.asarray(w.scales), jnp.uint8))
    return jnp.asarray(w.scales).astype(jnp.float32)


def _per_element(a, w: QuantizedWeight, group: tuple[int, int] | None = None):
    """A per-group ``[..., K/gk, N/gn]`` array (groups of ``group``, default ``w.group``) expanded to
    ``[..., K, N]``."""
    k, n = w.shape[-2:]
    gk, gn = group or w.group
    return jnp.repeat(jnp.repeat(a, gk, axis=-2)[..., :k, :], gn, axis=-1)[..., :n]


def dequantize(w: QuantizedWeight, dtype=jnp.float32) -> jax.Array:
    """``[..., K, N]`` in ``dtype``: each format's own definition, computed in float32 (INT4 rounded
    to its scale's dtype first, as compressed-tensors does; NVFP4's block scale times its global
    scale rounded before the e2m1 value multiplies it), then cast once to ``dtype``."""
    s = _per_element(scales_f32(w), w)
    if w.format == "nvfp4":  # the same product per element as per block: the same rounding
        s = s * _per_element(jnp.asarray(w.global_scales, jnp.float32), w, w.global_group)
    if w.format == "fp8":
        u8 = jax.lax.bitcast_convert_type(jnp.asarray(w.codes), jnp.uint8)
        value = jax.lax.bitcast_convert_type(u8, jnp.float8_e4m3fn).astype(jnp.float32) * s
    else:
        codes = unpack_nibbles(jnp.asarray(w.codes), w.kpack).astype(jnp.int32)
        if w.format in ("fp4", "nvfp4"):
            value = jnp.asarray(_E2M1)[codes] * s
        else:
            zero = 8 if w.zeros is None else _per_element(jnp.asarray(w.zeros).astype(jnp.int32), w)
            value = ((codes - zero).astype(jnp.float32) * s).astype(w.scales.dtype)
    return value.astype(dtype)
