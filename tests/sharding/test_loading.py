"""Shard-local loading on meshes of CPU devices: (tp=2, ep=4) on 4 devices (attention replicated
twice), and the same widths as dp attention over all 8 (tp=2 per group, ep=8).

Every parameter lands sharded exactly as its logical axes declare, each device holds what the
planner says it will, and the host never holds more than a few slices while the files stream in.
"""

from __future__ import annotations

import os
import tracemalloc

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from jaxdsa import plan, sharding
from jaxdsa.checkpoints.tiny.make import make_tiny
from jaxdsa.loading import device_param_bytes, load_model
from jaxdsa.models import family as families

LAYOUTS = {
    "tp2-ep4": sharding.Parallelism(tp=2, ep=4),
    "dp4-tp2-ep8": sharding.Parallelism(tp=2, ep=8, dp=4, dp_attention=True),
}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    """About 100 MB of float32: wide enough that weights, not the interpreter, dominate."""
    wide = {
        "hidden_size": 512,
        "moe_intermediate_size": 256,
        "n_routed_experts": 32,
        "intermediate_size": 512,
    }
    return make_tiny("deepseek_v32", tmp_path_factory.mktemp("dsv32") / "ckpt", shards=3, overrides=wide)


def checkpoint_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path) if f.endswith(".safetensors"))


@pytest.fixture(scope="module", params=sorted(LAYOUTS))
def loaded(checkpoint, request):
    par = LAYOUTS[request.param]
    mesh = sharding.make_mesh(par)
    tracemalloc.start()
    try:
        family, cfg, model = load_model(
            checkpoint, dtype=jnp.bfloat16, parallelism=par, mesh=mesh, mtp=False, progress=False
        )
        jax.block_until_ready(nnx.state(model))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return family, cfg, model, par, mesh, peak


def test_every_parameter_sharded_as_declared(loaded):
    _, _, model, _, mesh, _ = loaded
    axes = families.param_axes(model)
    for path, variable in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        value = variable.get_value()
        want = sharding.named(mesh, axes[path])
        assert value.sharding.is_equivalent_to(want, value.ndim), (path, value.sharding, want)


def device_bytes(model, mesh) -> dict:
    """Bytes of the model's parameters on each device of ``mesh`` (0 where it holds none)."""
    return dict.fromkeys(mesh.devices.flat, 0) | device_param_bytes(model)


def test_device_bytes_match_the_planner(loaded):
    family, cfg, model, par, mesh, _ = loaded
    assert mesh.devices.size == par.num_devices
    per_device = device_bytes(model, mesh)
    planned = plan.device_weight_bytes(family, cfg, par, "bf16")
    for device, nbytes in per_device.items():
        assert abs(nbytes - planned) <= 0.05 * planned, (device, nbytes, planned)


def test_host_holds_a_few_slices_at_a_time(loaded, checkpoint):
    """Peak Python/numpy allocation during the load: a small fraction of the checkpoint (the
    float32 files are never read whole; each device's slice is converted and handed over)."""
    *_, peak = loaded
    assert peak < 0.25 * checkpoint_bytes(checkpoint), (peak, checkpoint_bytes(checkpoint))
