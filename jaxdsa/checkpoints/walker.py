"""The one walker over a family's parameter spec: load a checkpoint, or draw dummy weights.

Both fill a flat mapping ``path -> jax.ShapeDtypeStruct`` (with its sharding: the abstract
model) from a mapping ``path -> spec`` (:mod:`jaxdsa.checkpoints.spec`).

Loading is shard-local. Every array is made with ``jax.make_array_from_callback``: each device's
callback reads only that device's slice from the memory-mapped files and puts it straight on that
device. A parameter whose target is a
:class:`~pallas_kernels.quant.layout.QuantizedWeight` (weights kept quantized) gets its
codes, scales and zero points that way, each device its slice of each, repacked one tensor at a
time into the kernels' layout (groups narrowed to the target's, exactly); a dense target of a
quantized tensor is dequantized first, one tensor at a time. Stacked
(scanned) parameters are filled one layer at a time into a preallocated stack, in place. Nothing
is materialized whole on one device, and the host holds one layer's slices at a time. Every
failure names the file and the tensor.

Dummy weights (like vLLM's ``--load-format dummy``) are drawn on the devices in their final
layout by one compiled init per distinct (shape, dtype, sharding, distribution), from keys
derived from the parameter's path: every parallel layout of the same seed holds the same model
(quantized targets: random codes and constant scales, drawn directly in their format).
"""

from __future__ import annotations

import collections
import functools
import math
import zlib
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from jaxdsa.checkpoints.errors import CheckpointError
from jaxdsa.checkpoints.quant import (
    E4M3,
    NVFP4_GROUP,
    QuantConfig,
    WeightFormat,
    dequantize_fp4,
    dequantize_fp8_block,
    dequantize_int4_packed,
    dequantize_nvfp4,
    fp4_format,
    int4_values,
    nvfp4_format,
    unpack_fp4,
    weight_format,
)
from jaxdsa.checkpoints.safetensors_io import CheckpointReader
from jaxdsa.checkpoints.spec import ExpertDown, ExpertGateUp, IndexTable, Leaf, Linear, Spec, Stacked
from jaxdsa.progress import Progress
from pallas_kernels.quant import layout
from pallas_kernels.quant.layout import QuantizedWeight

Path = tuple[Any, ...]
_FLOATS = (np.dtype(np.float32), np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16), np.dtype(np.float64))
_INTS = (np.dtype(np.int64), np.dtype(np.int32))
_PACKED_FP4 = (np.dtype(np.int8), np.dtype(np.uint8))
_UINT8 = np.dtype(np.uint8)


def path_name(path: Path) -> str:
    return "/".join(map(str, path))


class _Source:
    """Tensors of one checkpoint in the file's layout: plain ones as lazily mapped views,
    quantized linears dequantized (FP8 blocks in float32, INT4 in its scale's dtype as
    compressed-tensors does, then held as float32) (the last few kept, since every device of a mesh
    asks for its slice of the same tensor in turn)."""

    def __init__(self, reader: CheckpointReader, quant: QuantConfig | None):
        self.reader, self.quant = reader, quant
        self._dequantized: collections.OrderedDict[str, np.ndarray] = collections.OrderedDict()

    def fail(self, tensor: str, message: str) -> CheckpointError:
        return CheckpointError(self.reader.file_of(tensor), tensor, message)

    def missing(self, tensor: str, why: str = "missing from the checkpoint") -> CheckpointError:
        return CheckpointError(self.reader.directory, tensor, why)

    def plain(self, tensor: str, shape: tuple[int, ...]) -> np.ndarray:
        if tensor not in self.reader:
            raise self.missing(tensor)
        got = self.reader.shape(tensor)
        if got != tuple(shape):
            raise self.fail(tensor, f"shape {list(got)} != expected {list(shape)}")
        if self.reader.dtype(tensor) not in _FLOATS:
            raise self.fail(tensor, f"dtype {self.reader.dtype(tensor)} is not a float type")
        return self.reader.get(tensor)

    def index_table(self, leaf: IndexTable) -> np.ndarray:
        if leaf.name not in self.reader:
            raise self.missing(leaf.name)
        if self.reader.dtype(leaf.name) not in _INTS or self.reader.shape(leaf.name) != leaf.shape:
            raise self.fail(leaf.name, f"expected integers of shape {list(leaf.shape)}")
        table = np.asarray(self.reader.get(leaf.name))
        if table.min() < 0 or table.max() >= leaf.bound:
            raise self.fail(leaf.name, f"values outside [0, {leaf.bound})")
        return table.astype(np.int32)

    def linear(self, name: str, out: int, inp: int, *, fp4: bool = False) -> np.ndarray:
        """The [out, in] matrix of an HF linear layer: a mapped view, or dequantized float32.
        ``fp4``: the weight may be stored as DeepSeek-V4 FP4 (packed e2m1 bytes)."""
        weight, packed = name + ".weight", name + ".weight_packed"
        if weight not in self.reader and packed not in self.reader:
            raise self.missing(weight)
        self._check_quantized_as_configured(name)
        stored = self.reader.dtype(weight) if weight in self.reader else None
        is_fp8 = stored == np.dtype(ml_dtypes.float8_e4m3fn)
        is_nvfp4 = stored == _UINT8 and self._nvfp4_config()
        is_fp4 = stored in _PACKED_FP4 and not is_nvfp4
        if is_fp4 and not fp4:
            raise self.fail(weight, f"packed {stored} weight, but config.json does not say expert_dtype fp4")
        if weight in self.reader and not (is_fp8 or is_fp4 or is_nvfp4):
            return self.plain(weight, (out, inp))
        if name in self._dequantized:
            self._dequantized.move_to_end(name)
            return self._dequantized[name]
        if is_nvfp4:
            value = dequantize_nvfp4(*self._nvfp4_tensors(name, out, inp))[:, :inp]
        elif is_fp4:
            value = self._fp4(name, out, inp)
        else:
            value = self._fp8(name, out, inp) if is_fp8 else self._int4(name, out, inp)
        self._dequantized[name] = value
        if len(self._dequantized) > 4:
            self._dequantized.popitem(last=False)
        return value

    def _nvfp4_config(self) -> bool:
        return self.quant is not None and self.quant.method == "nvfp4"

    def _check_quantized_as_configured(self, module: str) -> None:
        """compressed-tensors: a module the config's targets / ignore list quantize must be stored
        packed, any other plainly. ModelOpt NVFP4: a module its exclusions name must be stored
        plainly (a module they do not name may be plain too: ModelOpt quantizes only the module types
        it knows, so a router or a norm is stored as it is whatever the list says). A file that
        disagrees with its config is refused rather than guessed at."""
        if self._nvfp4_config():
            weight = module + ".weight"
            if (
                weight in self.reader
                and self.reader.dtype(weight) == _UINT8
                and not self.quant.quantizes(module)
            ):
                raise self.fail(weight, "stored as NVFP4, but the quantization_config's exclusions name it")
            return
        if self.quant is None or self.quant.method != "compressed-tensors":
            return
        packed = module + ".weight_packed"
        if packed in self.reader and not self.quant.quantizes(module):
            raise self.fail(
                packed, "stored packed, but the quantization_config ignores it or no target matches"
            )
        if module + ".weight" in self.reader and self.quant.quantizes(module):
            raise self.fail(module + ".weight", "stored unpacked, but the quantization_config quantizes it")

    def _nvfp4_tensors(self, name: str, out: int, inp: int) -> tuple[np.ndarray, np.ndarray, np.float32]:
        """A ModelOpt NVFP4 linear's ``weight`` bytes ``[out, in / 2]``, ``weight_scale`` e4m3
        ``[out, in / 16]`` and ``weight_scale_2`` (a float32 scalar), every shape and dtype checked.
        An ``input_scale`` (W4A4 checkpoints) is read and checked, then ignored: jaxdsa runs W4A16
        (docs/models.md §4.8)."""
        weight, scale, global_scale = (
            name + suffix for suffix in (".weight", ".weight_scale", ".weight_scale_2")
        )
        for tensor in (scale, global_scale):
            if tensor not in self.reader:
                raise self.missing(tensor, f"missing: needed with the NVFP4 {weight}")
        expected = {
            weight: ((out, -(-inp // 2)), (_UINT8,)),
            scale: ((out, -(-inp // NVFP4_GROUP)), (E4M3,)),
        }
        for tensor, (shape, dtypes) in expected.items():
            if self.reader.shape(tensor) != shape or self.reader.dtype(tensor) not in dtypes:
                raise self.fail(
                    tensor,
                    f"{self.reader.dtype(tensor)} {list(self.reader.shape(tensor))}, expected "
                    f"{dtypes[0]} {list(shape)} (NVFP4)",
                )
        scalars = [global_scale] + [t for t in (name + ".input_scale",) if t in self.reader]
        for tensor in scalars:
            if math.prod(self.reader.shape(tensor)) != 1 or self.reader.dtype(tensor) not in _FLOATS:
                raise self.fail(
                    tensor,
                    f"expected one float, got {self.reader.dtype(tensor)} {list(self.reader.shape(tensor))}",
                )
        g = np.float32(np.asarray(self.reader.get(global_scale)).reshape(()))
        return self.reader.get(weight), self.reader.get(scale), g

    def _fp8(self, name: str, out: int, inp: int) -> np.ndarray:
        weight = name + ".weight"
        if self.quant is None or self.quant.method != "fp8":
            raise self.fail(weight, "float8 weight but config.json has no fp8 quantization_config")
        scale = self._scale_of(weight)
        w = self.reader.get(weight)
        if w.shape != (out, inp):
            raise self.fail(weight, f"shape {list(w.shape)} != expected {[out, inp]}")
        try:
            return dequantize_fp8_block(w, scale, self.quant.weight_block_size)
        except ValueError as e:
            raise self.fail(weight + "_scale_inv", str(e)) from None

    def _scale_of(self, weight: str) -> np.ndarray:
        scale = weight + "_scale_inv"
        if scale not in self.reader:
            raise self.missing(scale, f"missing: needed to dequantize {weight}")
        return self.reader.get(scale)

    def _fp4_bytes(self, name: str, out: int, inp: int) -> np.ndarray:
        """The packed FP4 bytes ``[out, ceil(in / 2)]`` of ``name``, their shape checked."""
        weight = name + ".weight"
        w = self.reader.get(weight)
        if w.shape != (out, -(-inp // 2)):
            raise self.fail(
                weight, f"shape {list(w.shape)} != expected {[out, -(-inp // 2)]} (FP4, 2 per byte)"
            )
        return w

    def _fp4(self, name: str, out: int, inp: int) -> np.ndarray:
        try:
            return dequantize_fp4(self._fp4_bytes(name, out, inp), self._scale_of(name + ".weight"))[:, :inp]
        except ValueError as e:
            raise self.fail(name + ".weight_scale_inv", str(e)) from None

    def _int4(self, name: str, out: int, inp: int) -> np.ndarray:
        packed = name + ".weight_packed"
        if self.quant is None or self.quant.method != "compressed-tensors":
            raise self.fail(
                packed, "INT4-packed weight but config.json has no compressed-tensors quantization_config"
            )
        shape_name = name + ".weight_shape"
        if shape_name in self.reader:
            shape = tuple(int(s) for s in self.reader.get(shape_name))
            if shape != (out, inp):
                raise self.fail(shape_name, f"{list(shape)} != expected {[out, inp]}")
        zp_name = name + ".weight_zero_point"
        if not self.quant.symmetric and zp_name not in self.reader:
            raise self.missing(zp_name, "missing: the scheme is asymmetric")
        try:
            w = dequantize_int4_packed(
                self.reader.get(packed),
                self.reader.get(name + ".weight_scale"),
                None if self.quant.symmetric else self.reader.get(zp_name),
                (out, inp),
                self.quant.group_size,
            )
            return w.astype(np.float32)  # the library's values (bf16 for bf16 scales), exactly
        except ValueError as e:
            raise self.fail(packed, str(e)) from None

    def packed(
        self,
        name: str,
        out: int,
        inp: int,
        like: QuantizedWeight,
        rows: tuple[int, int, int] | None = None,
        size: tuple[int, int] | None = None,
    ) -> QuantizedWeight:
        """The HF linear ``name`` [out, in] as a NumPy QuantizedWeight ``[in, out]`` in the format,
        groups and chunk size of ``like`` (the target): repacked, never dequantized; only the
        ``rows`` of :attr:`Linear.rows <jaxdsa.checkpoints.spec.Linear.rows>` if given, then zero-padded
        to ``size`` ``[K, N]`` if larger (heads padded for tensor parallelism). The last few are
        kept, as :meth:`linear` keeps its dequantized tensors."""
        key = (name, like.format, like.group, like.kpack, like.global_group, rows, size)
        if key in self._dequantized:
            self._dequantized.move_to_end(key)
            return self._dequantized[key]
        self._check_quantized_as_configured(name)
        found = stored_format(self.reader, self.quant, name, fp4=like.format == "fp4")
        if found is None or found.format != like.format:
            stored = "plain" if found is None else found.format
            raise self.fail(name + ".weight", f"stored {stored}, but the model keeps it {like.format}")
        if like.format == "fp8":
            weight, scale = name + ".weight", name + ".weight_scale_inv"
            if scale not in self.reader:
                raise self.missing(scale, f"missing: needed with the float8 {weight}")
            q = self.reader.get(weight)
            if q.shape != (out, inp):
                raise self.fail(weight, f"shape {list(q.shape)} != expected {[out, inp]}")
            try:
                w = layout.pack_fp8(q, self.reader.get(scale), block=self.quant.weight_block_size)
            except ValueError as e:
                raise self.fail(scale, str(e)) from None
        elif like.format == "fp4":
            try:
                w = layout.pack_fp4(
                    unpack_fp4(self._fp4_bytes(name, out, inp))[:, :inp],
                    self._scale_of(name + ".weight"),
                    kpack=like.kpack,
                )
            except ValueError as e:
                raise self.fail(name + ".weight_scale_inv", str(e)) from None
        elif like.format == "nvfp4":
            packed, scale, g = self._nvfp4_tensors(name, out, inp)
            w = layout.pack_nvfp4(
                unpack_fp4(packed)[:, :inp], scale, g, kpack=like.kpack, global_group=like.global_group
            )
        else:
            w = self._int4_packed(name, out, inp, like.kpack)
        w = layout.reblock_k(layout.reblock_n(w, like.group[1]), like.group[0])
        if rows is not None:
            period, start, stop = rows
            heads = range(0, out, period)
            w = layout.concat_n(*(_columns(w, h + start, h + stop) for h in heads))
        if size is not None:
            w = layout.pad_k(layout.pad_n(w, size[1]), size[0])
        self._dequantized[key] = w
        if len(self._dequantized) > 4:
            self._dequantized.popitem(last=False)
        return w

    def _int4_packed(self, name: str, out: int, inp: int, kpack: int) -> QuantizedWeight:
        packed, zp_name = name + ".weight_packed", name + ".weight_zero_point"
        if not self.quant.symmetric and zp_name not in self.reader:
            raise self.missing(zp_name, "missing: the scheme is asymmetric")
        scale = self.reader.get(name + ".weight_scale")
        try:
            q, zp = int4_values(
                self.reader.get(packed),
                scale,
                None if self.quant.symmetric else self.reader.get(zp_name),
                (out, inp),
                self.quant.group_size,
            )
            return layout.pack_int4(q, scale, zp, group_size=self.quant.group_size, kpack=kpack)
        except ValueError as e:
            raise self.fail(packed, str(e)) from None

    def expert(self, spec: ExpertGateUp | ExpertDown, proj: str, e: int) -> np.ndarray:
        """The HF [out, in] matrix (``proj`` gate / up / down) of the expert held at position ``e``."""
        fused = spec.prefix + (".down_proj" if proj == "down" else ".gate_up_proj")
        if (
            not spec.is_shared(e)
            and spec.module(proj, 0) + ".weight" not in self.reader
            and fused in self.reader
        ):
            # transformers 5.x in-memory layout: gate_up [E, 2N, D] (gate rows first), down [E, D, N].
            if proj == "down":
                return self.plain(fused, (spec.num, spec.hidden, spec.inter))[spec.source(e)]
            rows = self.plain(fused, (spec.num, 2 * spec.inter, spec.hidden))[spec.source(e)]
            return rows[: spec.inter] if proj == "gate" else rows[spec.inter :]
        out, inp = (spec.hidden, spec.inter) if proj == "down" else (spec.inter, spec.hidden)
        return self.linear(spec.module(proj, e), out, inp, fp4=spec.fp4)


def _slice_padded(value: np.ndarray, index: tuple[slice, ...], shape: tuple[int, ...], dtype) -> np.ndarray:
    """``value`` zero-padded to ``shape``, sliced at ``index``: only the slice is materialized."""
    bounds = [s.indices(n) for s, n in zip(index, shape)]
    out = np.zeros([stop - start for start, stop, _ in bounds], dtype)
    have = tuple(slice(start, min(stop, n)) for (start, stop, _), n in zip(bounds, value.shape))
    if all(h.stop > h.start for h in have):
        out[tuple(slice(0, h.stop - h.start) for h in have)] = value[have]
    return out


def _no_experts(index: tuple[slice, ...], shape: tuple[int, ...], dtype) -> np.ndarray:
    """The empty slice ``index`` of an expert stack that holds no expert (all of them in host RAM)."""
    return np.zeros([len(range(*s.indices(n))) for s, n in zip(index, shape)], dtype)


def _leaf_slice(source: _Source, leaf: Leaf, index: tuple[slice, ...], shape: tuple[int, ...], dtype):
    """The slice ``index`` of one (unstacked) parameter of ``shape``, read from the files."""
    if isinstance(leaf, ExpertGateUp | ExpertDown) and shape[0] == 0:
        return _no_experts(index, shape, dtype)
    if isinstance(leaf, ExpertGateUp):
        experts, rows, cols = (s.indices(n) for s, n in zip(index, shape))
        width = cols[1] - cols[0]
        piece, half = cols[0] // width, width // 2  # this device's [gate_j | up_j] columns
        parts = []
        for e in range(*experts[:2]):
            gate, up = (
                source.expert(leaf, proj, e)[piece * half : (piece + 1) * half] for proj in ("gate", "up")
            )
            parts.append(np.concatenate([gate.T[rows[0] : rows[1]], up.T[rows[0] : rows[1]]], axis=1))
        return np.asarray(np.stack(parts), dtype)
    if isinstance(leaf, ExpertDown):
        experts = index[0].indices(shape[0])
        return np.asarray(
            np.stack([source.expert(leaf, "down", e).T[index[1:]] for e in range(*experts[:2])]), dtype
        )
    if isinstance(leaf, IndexTable):
        return np.asarray(source.index_table(leaf)[index], dtype)
    if isinstance(leaf, Linear):
        value = leaf.view(source.linear(leaf.name, leaf.out, leaf.inp))
        name = leaf.name + ".weight"
    else:
        value = source.plain(leaf.name, leaf.shape)
        value = leaf.view(value) if leaf.view else value
        name = leaf.name
    if value.shape != tuple(shape):
        padded = getattr(leaf, "pad", False) and all(v <= s for v, s in zip(value.shape, shape))
        if not padded or value.ndim != len(shape):
            raise source.fail(
                name, f"gives a parameter of shape {list(value.shape)}, the model needs {list(shape)}"
            )
        return _slice_padded(value, index, shape, dtype)
    return np.asarray(value[index], dtype)


def stored_format(
    reader: CheckpointReader, quant: QuantConfig | None, leaf: Leaf | str, *, fp4: bool = False
) -> WeightFormat | None:
    """The format a linear (or routed experts: their expert 0) is stored in, None if plain or if
    ``quant`` is None (every weight dense). Read from the tensors' names and dtypes, the config
    supplying group and block sizes. Packed bytes are DeepSeek-V4 FP4 where ``fp4`` (or the expert
    leaf's own flag) allows them."""
    if isinstance(leaf, ExpertGateUp | ExpertDown):
        fp4, leaf = leaf.fp4, leaf.module(leaf.projections[0], 0)
    name = leaf.name if isinstance(leaf, Linear) else leaf
    if not isinstance(name, str) or quant is None:
        return None
    weight, scale = name + ".weight", name + ".weight_scale_inv"
    if quant.method == "nvfp4":
        return nvfp4_format() if weight in reader and reader.dtype(weight) == _UINT8 else None
    if fp4 and weight in reader and reader.dtype(weight) in _PACKED_FP4:
        return fp4_format(reader.dtype(scale) if scale in reader else None)
    if name + ".weight_packed" in reader and quant.method == "compressed-tensors":
        return weight_format(quant, reader.dtype(name + ".weight_scale"))
    if weight in reader and reader.dtype(weight) == E4M3 and quant.method == "fp8":
        return weight_format(quant, reader.dtype(scale) if scale in reader else None)
    return None


def _columns(w: QuantizedWeight, start: int, stop: int) -> QuantizedWeight:
    """Output columns ``[start, stop)`` of ``w`` (both on scale-group and global-scale-group boundaries)."""
    gn = w.group[1]
    cut = lambda a, unit: None if a is None else a[..., start // unit : -(-stop // unit)]  # noqa: E731
    return w.replace(
        codes=cut(w.codes, 1),
        scales=cut(w.scales, gn),
        zeros=cut(w.zeros, gn),
        global_scales=cut(w.global_scales, w.global_group[1]),
    )


def _packed_matrix(source: _Source, leaf: Leaf, e: int, like: QuantizedWeight, pieces: int):
    """One matrix of a quantized parameter (expert ``e`` of a stack) in the model's layout."""
    if isinstance(leaf, Linear):
        return source.packed(leaf.name, leaf.out, leaf.inp, like, leaf.rows, like.shape)
    if isinstance(leaf, ExpertDown):
        return source.packed(leaf.module("down", e), leaf.hidden, leaf.inter, like)
    gate, up = (source.packed(leaf.module(proj, e), leaf.inter, leaf.hidden, like) for proj in ("gate", "up"))
    width = leaf.inter // pieces  # [gate_j | up_j] per expert-TP piece, as ExpertGateUp says
    parts = [_columns(w, j * width, (j + 1) * width) for j in range(pieces) for w in (gate, up)]
    return layout.concat_n(*parts)


def _quantized_from_files(source: _Source, leaf: Leaf, target: QuantizedWeight) -> QuantizedWeight:
    """Each leaf of a quantized parameter made shard-locally: a device's callback repacks the
    tensor (one expert at a time for stacks; cached, since every device asks in turn) and hands
    over its slice. Codes, scales and zero points share one sharding, so the slices match."""
    codes = target.codes
    pieces = codes.shape[-1] // codes.sharding.shard_shape(codes.shape)[-1]
    experts = not isinstance(leaf, Linear)

    def piece(name: str, index: tuple[slice, ...]) -> np.ndarray:
        if not experts:
            return np.asarray(getattr(_packed_matrix(source, leaf, 0, target, pieces), name)[index])
        first, stop, _ = index[0].indices(codes.shape[0])
        if first == stop:
            struct = getattr(target, name)
            return _no_experts(index, struct.shape, struct.dtype)
        return np.stack(
            [
                getattr(_packed_matrix(source, leaf, e, target, pieces), name)[index[1:]]
                for e in range(first, stop)
            ]
        )

    def make(name: str, struct):
        if struct is None:
            return None
        return jax.make_array_from_callback(struct.shape, struct.sharding, lambda index: piece(name, index))

    return target.replace(
        **{name: make(name, getattr(target, name)) for name in ("codes", "scales", "zeros", "global_scales")}
    )


def _layer_target(target):
    """One layer of a stacked target (a ShapeDtypeStruct, or a QuantizedWeight of them)."""
    return jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype, sharding=_layer_sharding(a.sharding)), target
    )


@functools.cache
def _zeros(shape: tuple[int, ...], dtype, sharding) -> Callable[[], jax.Array]:
    return jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)


@functools.cache
def _set_layer(sharding) -> Callable[[jax.Array, jax.Array, int], jax.Array]:
    """``stack.at[i].set(part)`` in place (the stack is donated)."""
    return jax.jit(
        lambda stack, part, i: jax.lax.dynamic_update_index_in_dim(stack, part, i, 0),
        donate_argnums=0,
        out_shardings=sharding,
    )


def _layer_sharding(sharding: jax.sharding.Sharding) -> jax.sharding.Sharding:
    """The sharding of one layer of a stack (the stacked axis is never split)."""
    if isinstance(sharding, jax.sharding.NamedSharding):
        return jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(*sharding.spec[1:]))
    return sharding


def _from_files(source: _Source, leaf: Leaf, target):
    if isinstance(target, QuantizedWeight):
        return _quantized_from_files(source, leaf, target)
    shape, dtype = tuple(target.shape), np.dtype(target.dtype)
    return jax.make_array_from_callback(
        shape, target.sharding, lambda index: _leaf_slice(source, leaf, index, shape, dtype)
    )


def load(
    reader: CheckpointReader,
    specs: Mapping[Path, Spec],
    targets: Mapping[Path, Any],
    *,
    quant: QuantConfig | None = None,
    progress: bool = True,
) -> dict[Path, Any]:
    """Read every parameter of ``targets`` (shape, dtype, sharding; or a QuantizedWeight of them)
    as ``specs`` say."""
    _check_covered(specs, targets)
    source = _Source(reader, quant)
    out: dict[Path, jax.Array] = {}
    by_layer: dict[int, list[tuple[Path, int]]] = collections.defaultdict(list)
    for path, spec in specs.items():
        target = targets[path]
        if isinstance(spec, Stacked):
            if len(spec.items) != target.shape[0]:
                raise ValueError(
                    f"{path_name(path)}: {len(spec.items)} stacked sources for {target.shape[0]} layers"
                )
            out[path] = jax.tree.map(lambda t: _zeros(tuple(t.shape), t.dtype, t.sharding)(), target)
            for i, layer in enumerate(spec.layers):
                by_layer[layer].append((path, i))
        else:
            out[path] = _from_files(source, spec, target)
    layers = sorted(by_layer)
    bar = Progress("loading weights", len(layers), enabled=progress)
    for layer in layers:
        for path, i in by_layer[layer]:
            target, spec = targets[path], specs[path]
            value = _from_files(source, spec.items[i], _layer_target(target))
            out[path] = jax.tree.map(
                lambda stack, part, t, i=i: _set_layer(t.sharding)(stack, part, i), out[path], value, target
            )
        bar.done(f"layer {layer}")
    return out


def _check_covered(specs: Mapping[Path, Spec], targets: Mapping[Path, Any]) -> None:
    missing = [path_name(p) for p in targets if p not in specs]
    extra = [path_name(p) for p in specs if p not in targets]
    if missing or extra:
        raise ValueError(
            f"parameter spec and model disagree: no source for {missing}, no parameter for {extra}"
        )


# ---- dummy weights ------------------------------------------------------------------------------


def _distribution(leaf: Leaf) -> tuple[str, float]:
    """(kind, scale) of a leaf's dummy values: linear weights ~ N(0, 1/fan_in)."""
    if isinstance(leaf, Linear):
        return "normal", leaf.inp**-0.5
    if isinstance(leaf, ExpertGateUp):
        return "gate_up", leaf.hidden**-0.5
    if isinstance(leaf, ExpertDown):
        return "normal", leaf.inter**-0.5
    if isinstance(leaf, IndexTable):
        return "index", float(leaf.bound)
    return {"embed": ("normal", 1.0), "norm": ("one_plus", 0.1), "bias": ("normal", 0.1)}[leaf.init]


def _real_shape(leaf: Leaf, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The part of a parameter the checkpoint would fill (the rest is zero padding)."""
    if isinstance(leaf, Linear) and leaf.pad:
        view = jax.eval_shape(leaf.view, jax.ShapeDtypeStruct((leaf.out, leaf.inp), jnp.float32))
        return (*shape[: len(shape) - view.ndim], *view.shape)
    return shape


@functools.cache
def _init(
    shape: tuple[int, ...], real: tuple[int, ...], dtype, sharding, kind: str, scale: float
) -> Callable[[jax.Array], jax.Array]:
    """One compiled init per distinct (shape, dtype, sharding, distribution): values of the
    ``real`` shape, zero-padded to ``shape`` (padded heads stay zero, as when loading)."""

    def draw(key):
        if kind == "index":  # shape[-1] distinct values in [0, scale) per row
            noise = jax.random.uniform(key, (*shape[:-1], int(scale)))
            return jnp.argsort(noise, axis=-1)[..., : shape[-1]].astype(dtype)
        if kind != "gate_up":
            x = jax.random.normal(key, real, dtype) * jnp.asarray(scale, dtype)
            x = x + jnp.asarray(1, dtype) if kind == "one_plus" else x
            return jnp.pad(x, [(0, s - r) for s, r in zip(shape, real)])
        # gate and up drawn apart, then laid out [gate_j | up_j] per expert-TP piece (ExpertGateUp)
        pieces = shape[-1] // sharding.shard_shape(shape)[-1]
        n = shape[-1] // 2
        gate, up = (
            jax.random.normal(k, (*shape[:-1], n), dtype) * jnp.asarray(scale, dtype)
            for k in jax.random.split(key)
        )
        split = lambda a: a.reshape(*shape[:-1], pieces, n // pieces)
        return jnp.concatenate([split(gate), split(up)], axis=-1).reshape(shape)

    return jax.jit(draw, out_shardings=sharding)


# The standard deviation of a uniform 4-bit code's value: INT4 minus 8 (-8 .. 7), sqrt((16^2 - 1) / 12);
# e2m1 (0, +-0.5, +-1, +-1.5, +-2, +-3, +-4, +-6), the root of their mean square.
_CODE_STD = {"int4": (255 / 12) ** 0.5, "fp4": (68.5 / 8) ** 0.5, "nvfp4": (68.5 / 8) ** 0.5}


@functools.cache
def _quantized_init(
    struct: tuple, fmt: tuple, sharding, std: float, real: tuple[int, int] | None
) -> Callable[[jax.Array], Any]:
    """One compiled init per distinct quantized parameter (``struct``: the leaves' shapes and
    dtypes; ``fmt``: format, group, chunk size, global group): codes drawn directly in their format,
    one scale value so that the weights have standard deviation ``std``. FP8: N(0, 1) codes rounded
    to e4m3, scale ``std``; INT4 and FP4: uniform codes (INT4 zero point 0, stored 8), scale ``std``
    over the codes' own (4.6 and 2.9; ue8m0 scales round it to a power of two); NVFP4: uniform codes,
    e4m3 scales 1 and that scale as the float32 global scale. Weights outside the ``real`` ``[K, N]``
    (padded heads) are 0, as when loading: FP8 codes +0, 4-bit scales 0 (their padding is whole
    groups)."""
    (codes_shape, codes_dtype), (scales_shape, scales_dtype), zeros, global_scales = struct
    format_, group, kpack, global_group = fmt

    def inside(shape: tuple[int, ...], unit: tuple[int, int]) -> jax.Array:
        """Which entries of a ``[..., K', N']`` leaf (each ``unit`` weights) start inside ``real``."""
        rows, cols = (jnp.arange(d) * u < r for d, u, r in zip(shape[-2:], unit, real))
        return rows[:, None] & cols[None, :]

    def draw(key):
        if format_ == "fp8":
            codes = jax.random.normal(key, codes_shape, jnp.float32).astype(codes_dtype)
            scale = std
        else:
            codes = jax.random.bits(key, codes_shape, jnp.uint32 if codes_dtype.itemsize == 4 else jnp.uint8)
            codes = jax.lax.bitcast_convert_type(codes, codes_dtype)  # uniform 4-bit codes, 8 or 2 each
            scale = std / _CODE_STD[format_]
        glob = None
        if global_scales is not None:  # NVFP4: unit e4m3 scales, the scale in the float32 global scales
            glob, scale = jnp.full(global_scales[0], scale, global_scales[1]), 1.0
        scales = jnp.full(scales_shape, scale, jnp.float32).astype(scales_dtype)
        if real is not None and format_ == "fp8":
            codes = jnp.where(inside(codes_shape, (1, 1)), codes, jnp.zeros_like(codes))
        elif real is not None:
            scales = jnp.where(inside(scales_shape, group), scales, jnp.zeros_like(scales))
        zero_points = None if zeros is None else jnp.full(zeros[0], 8, zeros[1])
        return QuantizedWeight(codes, scales, zero_points, format_, group, kpack, glob, global_group)

    some = lambda leaf: None if leaf is None else sharding  # noqa: E731
    shardings = QuantizedWeight(
        sharding, sharding, some(zeros), format_, group, kpack, some(global_scales), global_group
    )
    return jax.jit(draw, out_shardings=shardings)


def _random_quantized(leaf: Leaf, target: QuantizedWeight, key: jax.Array) -> QuantizedWeight:
    shape_of = lambda a: None if a is None else (tuple(a.shape), np.dtype(a.dtype))  # noqa: E731
    struct = tuple(shape_of(getattr(target, name)) for name in ("codes", "scales", "zeros", "global_scales"))
    fmt = (target.format, target.group, target.kpack, target.global_group)
    _, std = _distribution(leaf)
    real = None
    if isinstance(leaf, Linear) and target.shape[-2:] != (leaf.inp, leaf.kept_out):
        real = (leaf.inp, leaf.kept_out)
    return _quantized_init(struct, fmt, target.codes.sharding, std, real)(key)


def random(specs: Mapping[Path, Spec], targets: Mapping[Path, Any], *, seed: int = 0) -> dict[Path, Any]:
    """Dummy weights for every parameter of ``targets``, drawn on the devices."""
    _check_covered(specs, targets)
    out = {}
    for path, spec in specs.items():
        target = targets[path]
        leaf = spec.items[0] if isinstance(spec, Stacked) else spec
        key = jax.random.fold_in(jax.random.key(seed), zlib.crc32(path_name(path).encode()) & 0x7FFFFFFF)
        if isinstance(target, QuantizedWeight):
            out[path] = _random_quantized(leaf, target, key)
            continue
        shape = tuple(target.shape)
        real = _real_shape(leaf, shape)
        out[path] = _init(shape, real, target.dtype, target.sharding, *_distribution(leaf))(key)
    return out
