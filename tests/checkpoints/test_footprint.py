"""Weights kept quantized take about the checkpoint's own bytes on the device: each quantized
fixture, loaded on one device in float32 and in bfloat16, holds at most 1.3x the bytes of the
checkpoint's tensors, its 16-bit tensors counted at the requested float width (a float32 model
widens the bf16 norms, embeddings and LM head: that is the dtype asked for, not quantization's
doing), and so is ``kv_b``, which is dense by design (the absorbed MLA form uses its parts as arrays:
:mod:`jaxdsa.quantization`). Dense at load, V4's FP4 experts made the fixture 2.2x.
The planner (``python -m jaxdsa.plan --weights fp8|int4``) counts what the loader holds."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from jaxdsa import plan
from jaxdsa.checkpoints.safetensors_io import CheckpointReader
from jaxdsa.loading import load_model
from jaxdsa.sharding import Parallelism
from tests.conftest import FIXTURES

QUANTIZED = ["glm5_int4", "glm5_fp8", "dsv32_fp8", "dsv32_int4", "dsv4_fp8"]
_16_BIT = (np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16))


def checkpoint_bytes(path, width: int) -> int:
    """Bytes of every tensor of the checkpoint, 16-bit floats counted at ``width`` bytes, and
    ``kv_b``'s quantized weight as its dense values at ``width`` (its scales and zero points not)."""
    reader = CheckpointReader(str(path))

    def held(name: str) -> int:
        size, dtype = math.prod(reader.shape(name)), reader.dtype(name)
        if ".kv_b_proj." in name:
            leaf = name.rsplit(".", 1)[1]
            return {"weight": size, "weight_packed": 8 * size}.get(leaf, 0) * width
        return size * (width if dtype in _16_BIT else dtype.itemsize)

    return sum(held(name) for name in reader.keys())


def held_bytes(model) -> int:
    return sum(a.nbytes for a in jax.tree.leaves(nnx.state(model, nnx.Param)))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", QUANTIZED)
def test_device_bytes_within_1_3x_of_the_checkpoint(name, dtype):
    dtype = jnp.dtype(dtype)
    _, _, model = load_model(FIXTURES / name, dtype=dtype, progress=False)
    held = held_bytes(model)
    stored = checkpoint_bytes(FIXTURES / name, dtype.itemsize)
    assert held <= 1.3 * stored, (held, stored, held / stored)


@pytest.mark.parametrize("name", QUANTIZED)
def test_planner_counts_what_the_loader_holds(name):
    """From the fixture's config.json alone, in bf16 without the MTP layers: exactly the loaded bytes
    (V4 within 0.1 %: the planner takes FP8 scales as float32, its files store ue8m0 bytes)."""
    family, cfg, model = load_model(FIXTURES / name, dtype=jnp.bfloat16, mtp=False, progress=False)
    weights = "fp8" if cfg.quantization.method == "fp8" else "int4"
    planned = plan.device_weight_bytes(family, cfg, Parallelism(), weights)
    assert planned == pytest.approx(held_bytes(model), rel=1e-3)
