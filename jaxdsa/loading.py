"""Build a model of a checkpoint directory, through its family: abstract first, then filled.

The family's module tree is built abstractly (shapes and logical axes, no memory), the weights
kept quantized take their abstract quantized layout (:mod:`jaxdsa.quantization`), each
parameter's sharding comes from its axes, and the one checkpoint walker fills every parameter
from the files (shard-local) or with dummy weights drawn on the devices.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from typing import Any

import jax
from flax import nnx

from jaxdsa import offload, shared_experts
from jaxdsa import quantization as quant
from jaxdsa.checkpoints import walker
from jaxdsa.checkpoints.safetensors_io import CheckpointReader
from jaxdsa.models import family as families
from jaxdsa.models.family import ModelFamily
from jaxdsa.models.registry import family_for, load_config
from jaxdsa.offload import ExpertPlacement
from jaxdsa.offload.stats import ExpertStats, attach_recorders
from jaxdsa.sharding import Parallelism

LOAD_FORMATS = ("safetensors", "dummy")


def load_model(
    path: str | os.PathLike,
    *,
    dtype,
    parallelism: Parallelism | None = None,
    mesh=None,
    load_format: str = "safetensors",
    mtp: bool = True,
    seed: int = 0,
    progress: bool = True,
    scan_layers: bool = True,
    quantization: str = "auto",
    check_weights: Callable[[float], None] | None = None,
    placement: ExpertPlacement | None = None,
    expert_stats: ExpertStats | None = None,
    fuse_shared_experts: bool = True,
) -> tuple[ModelFamily, Any, nnx.Module]:
    """-> (family, config, model) of the checkpoint at ``path``, placed on ``mesh``.

    ``mtp``: also load the next-n layers the checkpoint ships (dummy weights: the config's).
    ``load_format="dummy"``: random weights of the config's shapes (``config.json`` is all that
    is read), like vLLM's ``--load-format dummy``. ``quantization``: which weights stay in their
    quantized format (:mod:`jaxdsa.quantization`; default: the checkpoint's FP8 / INT4 linears and
    experts). ``scan_layers``: see :class:`jaxdsa.LLM`. ``check_weights``: called with the bytes of
    weights one device will hold before any is read or drawn; it raises to stop the load.
    ``placement``: routed experts split between the GPUs and host RAM (:mod:`jaxdsa.offload`).
    ``expert_stats``: where the MoE layers' routing counts go (:mod:`jaxdsa.offload.stats`).
    ``fuse_shared_experts``: hold each MoE layer's shared expert as one more routed expert where it
    can join them (:mod:`jaxdsa.shared_experts`; not with experts in host RAM).
    """
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format {load_format!r}: choose one of {', '.join(LOAD_FORMATS)}")
    cfg = load_config(path)
    family = family_for(cfg.model_type)
    reader = CheckpointReader(os.fspath(path), family.tensor_name) if load_format == "safetensors" else None
    n_mtp = 0
    if mtp:
        n_mtp = (
            family.mtp_layers(cfg, reader.__contains__) if reader else family.mtp_layers(cfg, lambda _: True)
        )
    model = families.abstract(
        family, cfg, dtype=dtype, parallelism=parallelism, mtp=n_mtp, scan_layers=scan_layers
    )
    specs = family.param_spec(cfg, model)
    kept = quant.requested(quantization, family.quantization(cfg), dummy=reader is None)
    if reader is None:
        stored = quant.configured(kept)
    else:
        stored = lambda leaf: walker.stored_format(reader, kept, leaf)  # noqa: E731
    shards = parallelism.shards if parallelism is not None else lambda _: 1
    formats = quant.formats(model, specs, stored)
    if fuse_shared_experts and placement is None:
        model, specs, formats = shared_experts.fuse_shared_experts(model, specs, formats, shards)
    host = None
    if placement is not None:
        model, specs, host = offload.plan(model, specs, formats, placement, shards)
    model = quant.quantize(model, formats, shards)
    targets = families.targets(model, mesh)
    if check_weights is not None:
        check_weights(device_target_bytes(targets))
    model = families.fill(model, _read(reader, specs, targets, family.quantization(cfg), seed, progress))
    if host is not None:
        offload.attach(
            model,
            host,
            _read(reader, host.specs, host.targets, family.quantization(cfg), seed, progress),
            mesh,
        )
    if expert_stats is not None:
        attach_recorders(model, specs, expert_stats)
    return family, cfg, model


def _read(reader: CheckpointReader | None, specs, targets, quantization, seed: int, progress: bool) -> dict:
    """The arrays of ``targets``: read from the files, or dummy weights without a reader."""
    if reader is None:
        return walker.random(specs, targets, seed=seed)
    return walker.load(reader, specs, targets, quant=quantization, progress=progress)


def device_param_bytes(model: nnx.Module) -> dict[Any, int]:
    """Bytes of ``model``'s parameters held on each (addressable) device: what the planner predicts."""
    per_device: dict[Any, int] = {}
    for value in jax.tree.leaves(nnx.state(model, nnx.Param)):
        for shard in value.addressable_shards:
            per_device[shard.device] = per_device.get(shard.device, 0) + shard.data.nbytes
    return per_device


def device_target_bytes(targets: dict[Any, Any]) -> int:
    """Bytes one device holds of parameters laid out as ``targets`` (ShapeDtypeStructs with their
    shardings, :func:`jaxdsa.models.family.targets`), before any exists."""
    return sum(
        math.prod(leaf.sharding.shard_shape(leaf.shape)) * leaf.dtype.itemsize
        for leaf in jax.tree.leaves(targets)
    )
