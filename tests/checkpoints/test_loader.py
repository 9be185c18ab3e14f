"""Checkpoint loading: sharded files, INT4 pack-quantized weights, and clear errors on bad input."""

import json
import os
import shutil

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import save_file

from jaxdsa.checkpoints import CheckpointError
from jaxdsa.checkpoints.safetensors_io import CheckpointReader
from jaxdsa.checkpoints.tiny.make import make_tiny
from jaxdsa.config import ConfigError
from jaxdsa.loading import load_model
from pallas_kernels.quant.layout import QuantizedWeight, dequantize
from tests.checkpoints.test_quant import _pack_along
from tests.conftest import FIXTURES


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny("glm_moe_dsa", str(tmp_path_factory.mktemp("tiny")), seed=3, preset="glm5")


def _copy(src, tmp_path):
    dst = tmp_path / "ckpt"
    shutil.copytree(src, dst)
    return dst


def _rewrite(directory, edit):
    """Load every tensor of model.safetensors, let ``edit`` change the dict, write it back."""
    reader = CheckpointReader(str(directory))
    tensors = {k: np.array(reader.get(k)) for k in reader.keys()}
    del reader
    edit(tensors)
    save_file(tensors, str(directory / "model.safetensors"))


def load_params(path, **kwargs):
    """Every parameter of the float32 model of ``path``: {state path: array}; weights kept quantized
    as their dequantized values (in the model's layout)."""
    _, _, model = load_model(path, dtype=jnp.float32, progress=False, **kwargs)
    value = lambda w: dequantize(w) if isinstance(w, QuantizedWeight) else w  # noqa: E731
    return {
        path: np.asarray(value(v.get_value())) for path, v in nnx.to_flat_state(nnx.state(model, nnx.Param))
    }


def assert_same_params(a, b):
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=str(k))


def test_missing_tensor_names_it(tiny, tmp_path):
    ckpt = _copy(tiny, tmp_path)
    name = "model.layers.1.self_attn.kv_b_proj.weight"
    _rewrite(ckpt, lambda t: t.pop(name))
    with pytest.raises(CheckpointError) as err:
        load_params(ckpt)
    assert err.value.tensor == name and "missing" in str(err.value) and str(ckpt) in str(err.value)


def test_wrong_shape_names_file_and_tensor(tiny, tmp_path):
    ckpt = _copy(tiny, tmp_path)
    name = "model.layers.0.self_attn.q_a_proj.weight"
    _rewrite(ckpt, lambda t: t.update({name: np.ascontiguousarray(t[name].T)}))
    with pytest.raises(CheckpointError) as err:
        load_params(ckpt)
    assert err.value.tensor == name
    assert err.value.file.endswith("model.safetensors") and "shape" in str(err.value)


def test_truncated_file(tiny, tmp_path):
    ckpt = _copy(tiny, tmp_path)
    path = ckpt / "model.safetensors"
    os.truncate(path, os.path.getsize(path) - 100)
    with pytest.raises(CheckpointError) as err:
        load_params(ckpt)
    assert "truncated" in str(err.value) and err.value.file == str(path)
    os.truncate(path, 5)
    with pytest.raises(CheckpointError, match="too short"):
        load_params(ckpt)


def test_unknown_model_type(tiny, tmp_path):
    ckpt = _copy(tiny, tmp_path)
    cfg = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**cfg, "model_type": "qwen3_moe"}))
    with pytest.raises(ConfigError) as err:
        load_params(ckpt)
    assert err.value.field == "model_type" and "config.json" in str(err.value)


def test_fp8_weight_without_quantization_config(tiny, tmp_path):
    ckpt = _copy(tiny, tmp_path)
    name = "model.layers.0.mlp.up_proj.weight"
    _rewrite(ckpt, lambda t: t.update({name: t[name].astype(ml_dtypes.float8_e4m3fn)}))
    with pytest.raises(CheckpointError, match="no fp8 quantization_config") as err:
        load_params(ckpt)
    assert err.value.tensor == name


def test_sharded_checkpoint_loads_like_single_file(tmp_path):
    single = make_tiny("deepseek_v32", str(tmp_path / "single"), seed=5, preset="dsv32")
    sharded = make_tiny("deepseek_v32", str(tmp_path / "sharded"), seed=5, preset="dsv32", shards=3)
    assert os.path.exists(os.path.join(sharded, "model.safetensors.index.json"))
    assert_same_params(load_params(single), load_params(sharded))


def test_index_pointing_at_missing_shard(tmp_path):
    sharded = make_tiny("glm_moe_dsa", str(tmp_path / "s"), seed=5, preset="glm5", shards=2)
    victim = sorted(f for f in os.listdir(sharded) if f.endswith(".safetensors"))[-1]
    os.remove(os.path.join(sharded, victim))
    with pytest.raises(CheckpointError, match="missing") as err:
        load_params(sharded)
    assert victim in err.value.file


def _quantize_int4(w: np.ndarray, group: int):
    """Asymmetric per-group INT4 quantization in the compressed-tensors pack-quantized layout."""
    out, inp = w.shape
    g = w.reshape(out, inp // group, group)
    lo, hi = g.min(-1), g.max(-1)
    scale = np.maximum(hi - lo, 1e-6) / 15.0
    zp = np.clip(np.round(-lo / scale) - 8, -8, 7).astype(np.int64)
    q = np.clip(np.round(g / scale[..., None]) + zp[..., None], -8, 7).astype(np.int64).reshape(out, inp)
    scale = scale.astype(ml_dtypes.bfloat16)
    # compressed-tensors' definition: the product is rounded to the scale's dtype (bf16)
    deq = ((q - np.repeat(zp, group, 1)) * np.repeat(scale.astype(np.float32), group, 1)).astype(scale.dtype)
    return {
        "weight_packed": _pack_along(q, 1),
        "weight_scale": scale,
        "weight_zero_point": _pack_along(zp, 0),
        "weight_shape": np.array([out, inp], np.int64),
    }, deq.astype(np.float32)


def test_int4_pack_quantized_checkpoint(tiny, tmp_path):
    """Experts stored as compressed-tensors INT4 load to exactly their dequantized values."""
    group = 32
    quant, plain = _copy(tiny, tmp_path / "q"), _copy(tiny, tmp_path / "p")

    def quantize(tensors, keep_float):
        for name in [n for n in tensors if ".mlp.experts." in n]:
            packed, deq = _quantize_int4(tensors[name].astype(np.float32), group)
            if keep_float:
                tensors[name] = deq
            else:
                del tensors[name]
                tensors.update({name.replace(".weight", "." + k): v for k, v in packed.items()})

    _rewrite(quant, lambda t: quantize(t, False))
    _rewrite(plain, lambda t: quantize(t, True))
    cfg = json.loads((quant / "config.json").read_text())
    cfg["quantization_config"] = {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "config_groups": {
            "group_0": {
                "weights": {
                    "num_bits": 4,
                    "type": "int",
                    "symmetric": False,
                    "strategy": "group",
                    "group_size": group,
                },
                "targets": ["re:.*mlp\\.experts\\."],
            }
        },
        "ignore": ["lm_head"],
    }
    (quant / "config.json").write_text(json.dumps(cfg))
    assert_same_params(load_params(quant, quantization="dequantize"), load_params(plain))
    # kept quantized (the default), the experts are INT4 on the device with exactly those values
    _, _, model = load_model(quant, dtype=jnp.float32, progress=False)
    kept = {
        p
        for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))
        if isinstance(v.get_value(), QuantizedWeight)
    }
    assert kept and all(p[-1] in ("gate_up", "down") and "experts" in p for p in kept)
    # (its dense shared expert stays apart from the INT4 experts: jaxdsa.shared_experts)
    assert_same_params(load_params(quant), load_params(plain, fuse_shared_experts=False))
    # a file that disagrees with its config is refused: every Linear targeted, experts alone packed
    cfg["quantization_config"]["config_groups"]["group_0"]["targets"] = ["Linear"]
    (quant / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="stored unpacked, but the quantization_config quantizes it"):
        load_params(quant)
    cfg["quantization_config"]["config_groups"]["group_0"]["targets"] = ["re:.*mlp\\.experts\\."]
    cfg["quantization_config"]["ignore"] = ["re:.*experts\\.0\\."]
    (quant / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="stored packed, but the quantization_config ignores it"):
        load_params(quant)


@pytest.mark.parametrize("name", ["glm5_fp8", "dsv32_fp8", "glm5_int4", "glm5_nvfp4"])
def test_kept_quantized_weights_hold_the_dequantized_values(name):
    """Every weight kept quantized dequantizes to exactly what ``quantization='dequantize'`` loads (the
    linears as their [K, N] matrices); ``kv_b``'s per-head W_UK / W_UV parts are dense (the absorbed
    MLA form uses them as arrays), dequantized at load to the same values."""
    _, _, model = load_model(FIXTURES / name, dtype=jnp.float32, progress=False)
    kept = {
        p
        for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))
        if isinstance(v.get_value(), QuantizedWeight)
    }
    assert {p[-2] for p in kept} >= {"q_b", "o", "experts"}
    assert not {p[-2] for p in kept} & {"w_uk", "w_uv"}
    dense, values = load_params(FIXTURES / name, quantization="dequantize"), load_params(FIXTURES / name)
    assert dense.keys() == values.keys()
    for path, value in values.items():
        np.testing.assert_array_equal(value.reshape(dense[path].shape), dense[path], err_msg=str(path))
