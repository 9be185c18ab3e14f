"""Splitting a model's routed experts between the GPUs and host RAM, at load.

Two steps around the loader's own (:func:`jaxdsa.loading.load_model`):

1. :func:`plan`, on the abstract model: every :class:`~jaxdsa.layers.mlp.Experts` stack shrinks to the
   experts the placement keeps on the GPUs, its parameter spec names only those (``ids`` of
   :class:`jaxdsa.checkpoints.spec.ExpertGateUp`), and the host side gets specs and targets of its own:
   the other experts, in the same format, on JAX's CPU device.
2. :func:`attach`, on the loaded model: each such module gets its :class:`HostExperts` (read by the
   same walker, from the same files, or drawn as dummy weights) and its routing-slot table.

Nothing else in the model changes: the router still scores every expert, and the slot table turns
its ids into GPU or host slots inside the step (:meth:`jaxdsa.layers.mlp.Experts.partials`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxdsa import quantization as quant
from jaxdsa.checkpoints.quant import WeightFormat
from jaxdsa.checkpoints.spec import Spec, Stacked
from jaxdsa.layers.mlp import Experts, ExpertSlots
from jaxdsa.layers.params import axes_of
from jaxdsa.offload.placement import ExpertPlacement, slot_table

Path = tuple[Any, ...]
_NAMES = ("gate_up", "down")


@dataclasses.dataclass
class HostPlan:
    """The host side of a split model, before any weight is read: per Experts module path, its GPU
    expert count and slot tables; the host stacks' specs and targets (paths as the model's)."""

    gpu: dict[Path, int]
    tables: dict[Path, np.ndarray]
    specs: dict[Path, Spec]
    targets: dict[Path, Any]
    cpu_threads: int = 1


def plan(
    model: nnx.Module,
    specs: dict[Path, Spec],
    formats: dict[Path, WeightFormat],
    placement: ExpertPlacement,
    shards: Callable[[str], int] = lambda _: 1,
) -> tuple[nnx.Module, dict[Path, Spec], HostPlan]:
    """(the abstract model with its expert stacks cut to the GPU experts, its specs, the host plan).
    ``formats``: the weights kept quantized (:func:`jaxdsa.quantization.formats`), host ones alike;
    ``shards(name)``: how many pieces the mesh splits a logical axis into (the GPU experts split
    over the expert shards as all of them would)."""
    cpu = jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0])
    specs = dict(specs)
    host = HostPlan({}, {}, {}, {}, placement.cpu_threads)
    shapes: dict[Path, tuple[int, ...]] = {}
    for path, node in nnx.iter_graph(model):
        if not isinstance(node, Experts):
            continue
        spec = specs[(*path, "gate_up")]
        leaves = spec.items if isinstance(spec, Stacked) else (spec,)
        num = leaves[0].num
        sides = [
            (placement.gpu_experts(s.prefix, num), placement.host_experts(s.prefix, num)) for s in leaves
        ]
        n_gpu = len(sides[0][0])
        if n_gpu == num:
            continue
        if n_gpu % shards("experts"):
            pieces = shards("experts")
            raise ValueError(
                f"num_gpu_experts {n_gpu}: the mesh splits routed experts over {pieces} devices; "
                f"choose a multiple of {pieces} (e.g. {n_gpu // pieces * pieces or pieces})"
            )
        host.gpu[path] = n_gpu
        tables = np.stack([slot_table(g, h) for g, h in sides])
        host.tables[path] = tables if isinstance(spec, Stacked) else tables[0]
        for name in _NAMES:
            p = (*path, name)
            variable = getattr(node, name)
            axes, value = axes_of(variable), variable.get_value()
            at = axes.index("experts")
            gpu_spec, host_spec = (_restrict(specs[p], [side[i] for side in sides]) for i in (0, 1))
            specs[p], host.specs[p] = gpu_spec, host_spec
            shapes[p] = (*value.shape[:at], n_gpu, *value.shape[at + 1 :])
            host_shape = (*value.shape[:at], num - n_gpu, *value.shape[at + 1 :])
            slot = quant.Slot(host_shape, axes, 2 if name == "gate_up" else 1, experts=True)
            if p in formats:
                target = quant.abstract_weight(formats[p], slot, lambda _: 1, "/".join(map(str, p)))
            else:
                target = jax.ShapeDtypeStruct(host_shape, value.dtype)
            host.targets[p] = jax.tree.map(
                lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=cpu), target
            )
    graphdef, state = nnx.split(model)
    flat = [
        (path, v.replace(jax.ShapeDtypeStruct(shapes[path], v.get_value().dtype)) if path in shapes else v)
        for path, v in nnx.to_flat_state(state)
    ]
    return nnx.merge(graphdef, nnx.from_flat_state(flat)), specs, host


def _restrict(spec: Spec, ids: list[tuple[int, ...]]) -> Spec:
    """``spec`` holding only the experts ``ids`` (one tuple per stacked layer)."""
    if isinstance(spec, Stacked):
        items = tuple(dataclasses.replace(leaf, ids=i) for leaf, i in zip(spec.items, ids))
        return dataclasses.replace(spec, items=items)
    return dataclasses.replace(spec, ids=ids[0])


def attach(model: nnx.Module, host: HostPlan, arrays: dict[Path, Any], mesh) -> None:
    """Give each split Experts module of the loaded ``model`` its host experts (``arrays``: the host
    stacks as the walker read or drew them) and its slot table, replicated over ``mesh``."""
    try:  # the CPU kernel needs Numba, an optional dependency: only a split model imports it
        from jaxdsa.offload.host_experts import HostExperts
    except ImportError as e:
        need = "routed experts in host RAM need Numba: pip install 'jaxdsa[offload]'"
        raise ImportError(f"{need} ({e})") from e
    home = jax.tree.leaves(nnx.state(model, nnx.Param))[0].sharding
    placed = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()) if mesh is not None else home
    for path, node in nnx.iter_graph(model):
        if path not in host.gpu:
            continue
        table = host.tables[path]
        node.host = HostExperts(
            {name: arrays[(*path, name)] for name in _NAMES},
            gpu=host.gpu[path],
            stacked=table.ndim == 2,
            swiglu_limit=node.swiglu_limit,
            threads=host.cpu_threads,
        )
        node.slots = ExpertSlots(jax.device_put(jnp.asarray(table), placed))
