"""Which weights stay quantized on the device, and their abstract layout (weights kept quantized).

``quantization`` (an argument of :class:`jaxdsa.LLM` and :func:`jaxdsa.loading.load_model`):

- ``"auto"`` (default): every linear and routed-expert stack the checkpoint stores as FP8 or INT4
  stays so on the device; dummy weights take the config's ``quantization_config``.
- ``"dequantize"``: every weight dequantized to the model dtype at load (dense, as before).
- ``"fp8"`` / ``"int4"`` / ``"nvfp4"``: as ``"auto"``, asserting the checkpoint's format (jaxdsa
  never quantizes at load); dummy weights are drawn in that format whatever the config says (FP8
  128x128 blocks with float32 scales; INT4 as the config's compressed-tensors scheme, else
  asymmetric group 32 with bf16 scales, as the GLM-5.x AWQ releases; NVFP4 as ModelOpt's, every
  linear and expert).

vLLM's ``--quantization`` names a method and defaults to the checkpoint's; ``"auto"`` is that
default, and vLLM has no ``"dequantize"``.

What can stay quantized is decided by the modules: a :class:`~jaxdsa.layers.linear.Linear` that is
``quantizable`` (no float32 compute or wider output: not the router, the indexer's
``weights_proj`` or the LM head) and :class:`~jaxdsa.layers.mlp.Experts`. ``kv_b``'s two parts,
``w_uk`` and ``w_uv``, are linears built ``quantizable=False`` (except with dp attention, which
holds every head's on every device): the absorbed MLA form multiplies each head by its own slice,
so they are dequantized at load, as vLLM does. A scanned stack whose layers are stored in different
formats (an ``ignore`` entry naming one layer) is dequantized: one stacked parameter has one format.

:func:`quantize` replaces each chosen parameter of the abstract model by a
:class:`~jaxdsa.quantized_weight.QuantizedWeight` of ShapeDtypeStructs: a linear's
``[*in, *out]`` weight becomes the ``[K, N]`` matrix (axes :attr:`Linear.matrix_axes`), an
expert stack keeps its ``[E, K, N]`` shape and axes, and every leaf (codes, scales, zero points)
carries the same logical axes, so one sharding splits them at the same places. Scale groups are
narrowed (exactly: each scale repeated) until every shard and every expert-TP ``[gate_j | up_j]``
piece holds whole groups; a split that would cut a 4-bit packed chunk is an error naming the
parameter. Heads padded for tensor parallelism are zero weights appended to the matrix (a 4-bit K
only by whole 64-row chunks: else an error naming the tensor).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any

import jax
import ml_dtypes
import numpy as np
from flax import nnx

from jaxdsa import quantized_weight
from jaxdsa.checkpoints.quant import NVFP4_GROUP, QuantConfig, WeightFormat, fp4_format, weight_format
from jaxdsa.checkpoints.spec import ExpertDown, ExpertGateUp, Leaf, Linear, Spec, Stacked
from jaxdsa.layers.linear import Linear as LinearLayer
from jaxdsa.layers.mlp import Experts
from jaxdsa.layers.params import axes_of
from jaxdsa.quantized_weight import QuantizedWeight
from jaxdsa.sharding import Axes

QUANTIZATION = ("auto", "dequantize", "fp8", "int4", "nvfp4")
Path = tuple[Any, ...]
_METHODS = {"fp8": "fp8", "int4": "compressed-tensors", "nvfp4": "nvfp4"}


def requested(quantization: str, checkpoint: QuantConfig | None, *, dummy: bool) -> QuantConfig | None:
    """The quantization config the weights are kept in (None: all dense). For files,
    ``"fp8"`` / ``"int4"`` must name the checkpoint's own method; for dummy weights they choose it."""
    if quantization not in QUANTIZATION:
        raise ValueError(f"quantization {quantization!r}: choose one of {', '.join(QUANTIZATION)}")
    if quantization == "dequantize":
        return None
    if quantization == "auto":
        return checkpoint
    method = _METHODS[quantization]
    if checkpoint is not None and checkpoint.method == method:
        return checkpoint
    if not dummy:
        stored = checkpoint.method if checkpoint else "no quantization_config (plain floats)"
        raise ValueError(
            f"quantization={quantization!r}, but the checkpoint is {stored}: jaxdsa keeps a checkpoint's "
            "own format and does not quantize at load (use 'auto' or 'dequantize')"
        )
    if method == "compressed-tensors":
        return QuantConfig(method, group_size=32, symmetric=False)
    return QuantConfig(method, group_size=NVFP4_GROUP) if method == "nvfp4" else QuantConfig(method)


@dataclasses.dataclass(frozen=True)
class Slot:
    """A parameter that may hold a QuantizedWeight: its ``[..., K, N]`` shape and logical axes, and
    how many pieces its N dim joins (2 for gate|up)."""

    shape: tuple[int, ...]
    axes: Axes
    parts: int = 1
    experts: bool = False  # a routed-expert stack (INT4 ones take the word layout: default_kpack)


def slots(model: nnx.Module) -> dict[Path, Slot]:
    """Every parameter of ``model`` that a quantized weight may replace, by state path."""
    out = {}
    for path, node in nnx.iter_graph(model):
        if isinstance(node, LinearLayer) and node.quantizable:
            variable = node.weight
            shape, axes = variable.get_value().shape, axes_of(variable)
            lead = len(shape) - node.in_ndim - len(node.out_shape)
            k = math.prod(shape[lead : lead + node.in_ndim])
            out[(*path, "weight")] = Slot(
                (*shape[:lead], k, math.prod(node.out_shape)), (*axes[:lead], *node.matrix_axes)
            )
        elif isinstance(node, Experts):
            for name, parts in (("gate_up", 2), ("down", 1)):
                variable = getattr(node, name)
                out[(*path, name)] = Slot(
                    tuple(variable.get_value().shape), axes_of(variable), parts, experts=True
                )
    return out


def formats(
    model: nnx.Module, specs: Mapping[Path, Spec], stored: Callable[[Leaf], WeightFormat | None]
) -> dict[Path, WeightFormat]:
    """The format of every slot that stays quantized: ``stored(leaf)`` of its source (every layer
    of a stack must agree), a linear's as :func:`_linear_format` fits it to the slot."""
    out = {}
    for path, slot in slots(model).items():
        spec = specs[path]
        leaves = spec.items if isinstance(spec, Stacked) else (spec,)
        found = {stored(leaf) for leaf in leaves}
        if len(found) != 1 or None in found:
            continue
        leaf, fmt = leaves[0], found.pop()
        out[path] = _linear_format(leaf, fmt, slot) if isinstance(leaf, Linear) else fmt
    return out


def _linear_format(leaf: Linear, fmt: WeightFormat, slot: Slot) -> WeightFormat:
    """``fmt`` for the linear ``leaf`` held as ``slot``: its ``[K, N]`` matrix, or that with zero
    heads appended (heads padded for tensor parallelism: a 4-bit K only by whole 64-row packed
    chunks of whole groups, :func:`~pallas_kernels.quant.layout.pad_k`), scale groups
    narrowed to whole per-head parts (``kv_b``'s W_UK / W_UV), NVFP4's global-scale groups likewise."""
    k, n = slot.shape[-2:]
    gk, gn = fmt.group
    if (k, n) != (leaf.inp, leaf.kept_out):
        if not leaf.pad or k < leaf.inp or n < leaf.kept_out:
            raise ValueError(
                f"{leaf.name}: a [{leaf.kept_out}, {leaf.inp}] weight for a [{n}, {k}] parameter"
            )
        if k > leaf.inp and fmt.format != "fp8" and leaf.inp % math.lcm(64, gk):
            raise ValueError(
                f"{leaf.name}: a 4-bit weight of K = {leaf.inp} is padded to {k} rows (heads padded for "
                f"tensor parallelism) only by whole 64-row packed chunks of whole {gk}-row groups; choose "
                "a tp that divides the heads, or quantization='dequantize'"
            )
    ggk, ggn = fmt.global_group
    if leaf.rows is not None:
        gn = _narrow(gn, math.gcd(*leaf.rows))
        ggn = ggn and _narrow(ggn, math.gcd(*leaf.rows))
    return dataclasses.replace(fmt, group=(gk, gn), global_group=(ggk, ggn))


def configured(quant: QuantConfig | None) -> Callable[[Leaf], WeightFormat | None]:
    """``stored`` for weights made from a config (dummy weights, the planner): the modules its
    targets / ignore list quantize (every linear for FP8), in its format; routed experts that may
    be FP4 (DeepSeek-V4's ``expert_dtype: fp4``, beside an FP8 config) in FP4, as released."""

    def stored(leaf: Leaf) -> WeightFormat | None:
        if quant is None:
            return None
        if isinstance(leaf, ExpertGateUp | ExpertDown):
            if leaf.fp4 and quant.method == "fp8":
                return fp4_format()
            name = leaf.module(leaf.projections[0], 0)
        elif isinstance(leaf, Linear):
            name = leaf.name
        else:
            return None
        return weight_format(quant) if quant.quantizes(name) else None

    return stored


def _narrow(group: int, size: int) -> int:
    """The largest power-of-two divisor of ``group`` that divides ``size``."""
    while size % group:
        group //= 2
    return group


def abstract_weight(
    fmt: WeightFormat, slot: Slot, shards: Callable[[str], int], what: str
) -> QuantizedWeight:
    """The QuantizedWeight (ShapeDtypeStruct leaves) holding ``slot`` in ``fmt``, its groups narrowed
    for the shards of its K and N axes (``shards(name)``) and for gate|up pieces."""
    *lead, k, n = slot.shape
    k_shards, n_shards = shards(slot.axes[-2]), shards(slot.axes[-1])
    gk, gn = fmt.group
    if k % k_shards:
        raise ValueError(f"{what}: K = {k} does not split into {k_shards} shards")
    local_k = k // k_shards
    kpack = 0
    if fmt.format != "fp8":
        try:
            kpack = quantized_weight.default_kpack(local_k, fmt.format, words=slot.experts)
        except ValueError:
            raise ValueError(
                f"{what}: a 4-bit weight of K = {k} split into {k_shards} shards needs shards of whole "
                "32-row packed chunks; choose another tp or quantization='dequantize'"
            ) from None
    if k_shards > 1:
        gk = _narrow(gk, local_k)
    piece = n // slot.parts
    if n_shards > 1 or slot.parts > 1:
        if piece % n_shards:
            raise ValueError(f"{what}: N = {n} does not split into {n_shards} shards")
        gn = _narrow(gn, piece // n_shards)
    packed = fmt.format != "fp8"
    codes_dtype = quantized_weight.codes_dtype(kpack) if packed else np.dtype(ml_dtypes.float8_e4m3fn)
    rows = k // quantized_weight.codes_per_element(kpack) if packed else k
    groups = (*lead, -(-k // gk), -(-n // gn))
    global_scales, global_group = None, (0, 0)
    if fmt.format == "nvfp4":  # every shard and gate|up piece whole blocks of global scales
        global_group = (
            _narrow(fmt.global_group[0], local_k),
            _narrow(fmt.global_group[1], piece // n_shards),
        )
        shape = (*lead, k // global_group[0], n // global_group[1])
        global_scales = jax.ShapeDtypeStruct(shape, np.dtype(np.float32))
    return QuantizedWeight(
        jax.ShapeDtypeStruct((*lead, rows, n), codes_dtype),
        jax.ShapeDtypeStruct(groups, fmt.scale_dtype),
        jax.ShapeDtypeStruct(groups, np.dtype(np.uint8)) if fmt.zeros else None,
        fmt.format,
        (gk, gn),
        kpack,
        global_scales,
        global_group,
    )


def quantize(
    model: nnx.Module, chosen: Mapping[Path, WeightFormat], shards: Callable[[str], int]
) -> nnx.Module:
    """``model`` (abstract) with each parameter of ``chosen`` replaced by its abstract QuantizedWeight."""
    if not chosen:
        return model
    found = slots(model)
    graphdef, state = nnx.split(model)
    flat = []
    for path, variable in nnx.to_flat_state(state):
        if path in chosen:
            slot = found[path]
            w = abstract_weight(chosen[path], slot, shards, "/".join(map(str, path)))
            variable = variable.replace(w, out_sharding=slot.axes)
        flat.append((path, variable))
    return nnx.merge(graphdef, nnx.from_flat_state(flat))
