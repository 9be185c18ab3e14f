"""The shared expert run as one more routed expert, at load (SGLang's shared-experts fusion).

A MoE layer's shared expert is a SwiGLU MLP of the routed experts' shape that every token passes
through with weight 1. Run on its own at decode it is four kernel launches per layer (the gate|up
projection, the add of its K-split partial sums, the SwiGLU, the down projection), each a few
microseconds of GPU time and, inside a CUDA graph, a few of the host's to launch. Held as expert
``E`` of the routed experts' stacks, with every token routed to it at weight 1, it rides in the
grouped kernels' launches: their programs for expert ``E`` read its weights as they read any
other's, and its output joins the routed experts' weighted sum (:meth:`jaxdsa.layers.mlp.Experts.partials`).
The sum is the same: the shared expert's output was added to the routed experts' before their
common all-reduce already.

:func:`fuse_shared_experts` works on the abstract model and its parameter spec, before anything is
read (:func:`jaxdsa.loading.load_model`): each module with ``experts`` and ``shared`` whose shared
expert can join grows its expert stacks by one, its spec names the shared expert's tensors for the
last position (``shared`` of :class:`jaxdsa.checkpoints.spec.ExpertGateUp`) and the separate MLP is gone.
A shared expert joins when it has the routed experts' width, clamp, dtype and stored format (a
checkpoint that keeps it in another format, as DeepSeek-V4-Flash's FP8 beside FP4 experts, keeps
it apart: repacking it would change its values), and when the experts are not split over devices
(each expert shard would need its own copy) or between the GPUs and host RAM.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
from flax import nnx

from jaxdsa.checkpoints.quant import WeightFormat
from jaxdsa.checkpoints.spec import Spec, Stacked
from jaxdsa.layers.mlp import MLP, Experts
from jaxdsa.layers.params import axes_of

Path = tuple[Any, ...]
_PROJECTIONS = ("gate", "up", "down")


def fuse_shared_experts(
    model: nnx.Module,
    specs: dict[Path, Spec],
    formats: dict[Path, WeightFormat],
    shards: Callable[[str], int] = lambda _: 1,
) -> tuple[nnx.Module, dict[Path, Spec], dict[Path, WeightFormat]]:
    """(the abstract model with each joinable shared expert held in its routed experts' stacks, its
    specs, the formats of the weights kept quantized): see the module docstring. ``shards(name)``:
    how many pieces the mesh splits a logical axis into."""
    specs, formats = dict(specs), dict(formats)
    shapes: dict[Path, tuple[int, ...]] = {}
    for path, node in list(nnx.iter_graph(model)):
        if not _joinable(path, node, formats, shards):
            continue
        experts = node.experts
        axes = axes_of(experts.down)
        count = experts.down.get_value().shape[axes.index("experts")]
        for name in ("gate_up", "down"):
            p, value = (*path, "experts", name), getattr(experts, name).get_value()
            at = axes_of(getattr(experts, name)).index("experts")
            shapes[p] = (*value.shape[:at], count + 1, *value.shape[at + 1 :])
            specs[p] = _with_shared(
                specs[p], [specs[(*path, "shared", proj, "weight")] for proj in _PROJECTIONS]
            )
        for proj in _PROJECTIONS:
            specs.pop((*path, "shared", proj, "weight"))
            formats.pop((*path, "shared", proj, "weight"), None)
        node.shared = None
        experts.shared_slot = count
    graphdef, state = nnx.split(model)
    flat = [
        (p, v.replace(jax.ShapeDtypeStruct(shapes[p], v.get_value().dtype)) if p in shapes else v)
        for p, v in nnx.to_flat_state(state)
    ]
    return nnx.merge(graphdef, nnx.from_flat_state(flat)), specs, formats


def _joinable(path: Path, node: Any, formats: dict[Path, WeightFormat], shards: Callable[[str], int]) -> bool:
    """Whether ``node``'s shared expert can be held as one more of its routed experts."""
    experts, shared = getattr(node, "experts", None), getattr(node, "shared", None)
    if not isinstance(experts, Experts) or not isinstance(shared, MLP):
        return False
    if experts.host is not None or experts.shared_slot is not None or shards("experts") != 1:
        return False
    if shared.swiglu_limit != experts.swiglu_limit:
        return False
    down, gate = experts.down.get_value(), shared.gate.weight.get_value()
    if gate.shape[-1] != down.shape[-2] or gate.dtype != down.dtype:
        return False
    fmt = lambda *p: formats.get((*path, *p))  # noqa: E731
    routed = (fmt("experts", "gate_up"), fmt("experts", "down"))
    return fmt("shared", "gate", "weight") == fmt("shared", "up", "weight") == routed[0] and (
        fmt("shared", "down", "weight") == routed[1]
    )


def _with_shared(spec: Spec, shared: list[Spec]) -> Spec:
    """An expert stack's ``spec`` naming the shared expert (its gate, up and down linears'
    ``shared`` specs, layer by layer when stacked) for the position after the routed experts."""
    if isinstance(spec, Stacked):
        layers = zip(spec.items, *(s.items for s in shared))
        items = tuple(
            dataclasses.replace(leaf, shared=tuple(s.name for s in linears)) for leaf, *linears in layers
        )
        return dataclasses.replace(spec, items=items)
    return dataclasses.replace(spec, shared=tuple(s.name for s in shared))
