"""Loading ModelOpt NVFP4 checkpoints (docs/models.md §4.8) written by ``make_tiny --quant nvfp4``:
weights kept packed hold exactly the values ``quantization="dequantize"`` loads, every matrix (each
expert's gate and up) with its own global scale from its file; hf_quant_config.json alone configures
the same model; files that contradict their config, or lack a tensor, are refused by name."""

import json
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import save_file

from jaxdsa.checkpoints import CheckpointError
from jaxdsa.checkpoints.quant import dequantize_nvfp4
from jaxdsa.checkpoints.safetensors_io import CheckpointReader
from jaxdsa.checkpoints.tiny.make import make_tiny
from jaxdsa.loading import load_model
from pallas_kernels.quant.layout import QuantizedWeight
from tests.checkpoints.test_loader import load_params


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny(
        "glm_moe_dsa", str(tmp_path_factory.mktemp("nvfp4")), seed=4, preset="glm5", quant="nvfp4"
    )


def _copy(src, tmp_path):
    dst = tmp_path / "ckpt"
    shutil.copytree(src, dst)
    return dst


def _rewrite(directory, edit):
    reader = CheckpointReader(str(directory))
    tensors = {k: np.array(reader.get(k)) for k in reader.keys()}
    del reader
    edit(tensors)
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})


def _kept(path, **kwargs) -> dict[tuple, QuantizedWeight]:
    _, _, model = load_model(path, dtype=jnp.float32, progress=False, **kwargs)
    return {
        p: v.get_value()
        for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))
        if isinstance(v.get_value(), QuantizedWeight)
    }


def test_kept_weights_hold_the_dequantized_values(tiny):
    kept = _kept(tiny)
    assert {w.format for w in kept.values()} == {"nvfp4"}
    assert {p[-2] for p in kept} >= {"q_a", "q_b", "kv_a", "o", "experts", "wq_b", "wk"}
    assert not {p[-2] for p in kept} & {"w_uk", "w_uv", "weights_proj", "router", "lm_head"}
    dense, values = load_params(tiny, quantization="dequantize"), load_params(tiny)
    assert dense.keys() == values.keys()
    for path, value in values.items():
        np.testing.assert_array_equal(value.reshape(dense[path].shape), dense[path], err_msg=str(path))


def test_each_expert_matrix_keeps_its_global_scale(tiny):
    """gate | up of every expert: the first half's columns carry the file's gate weight_scale_2, the
    second half's the up's (they differ: each quantized on its own); the shared expert, held as one
    more expert (:mod:`jaxdsa.shared_experts`), its own."""
    kept = _kept(tiny)
    [g] = [w.global_scales for p, w in kept.items() if p[-1] == "gate_up" and p[0] == "groups"]
    reader = CheckpointReader(tiny)
    half, prefix = g.shape[-1] // 2, "model.layers.2.mlp."  # layer 2: the preset's first MoE layer
    modules = [f"{prefix}experts.{e}." for e in range(g.shape[1] - 1)] + [prefix + "shared_experts."]
    for e, module in enumerate(modules):
        gate, up = (reader.get(f"{module}{proj}_proj.weight_scale_2") for proj in ("gate", "up"))
        assert gate != up
        np.testing.assert_array_equal(np.asarray(g[0, e, :, :half]), gate)
        np.testing.assert_array_equal(np.asarray(g[0, e, :, half:]), up)


def test_hf_quant_config_alone(tiny, tmp_path):
    """config.json without quantization_config: ModelOpt's hf_quant_config.json beside it decides."""
    ckpt = _copy(tiny, tmp_path)
    cfg = json.loads((ckpt / "config.json").read_text())
    del cfg["quantization_config"]
    (ckpt / "config.json").write_text(json.dumps(cfg))
    kept = _kept(ckpt)
    assert {w.format for w in kept.values()} == {"nvfp4"} and len(kept) == len(_kept(tiny))


def test_numpy_decoder_reads_the_files(tiny):
    """The loader's dense values of one linear are the NumPy decoder's on its file tensors."""
    reader = CheckpointReader(tiny)
    m = "model.layers.0.self_attn.q_a_proj"
    w = dequantize_nvfp4(*(reader.get(f"{m}.{t}") for t in ("weight", "weight_scale", "weight_scale_2")))
    params = load_params(tiny, quantization="dequantize")
    (q_a,) = [v for p, v in params.items() if p[-2:] == ("q_a", "weight") and p[:2] == ("groups", 0)]
    np.testing.assert_array_equal(q_a[0], w.T)  # the first stack's layer 0


def test_excluded_module_stored_nvfp4_is_refused(tiny, tmp_path):
    ckpt = _copy(tiny, tmp_path)
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["quantization_config"]["ignore"].append("model.layers.1.self_attn.o_proj")
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"o_proj\.weight.*exclusions name it"):
        load_params(ckpt)


@pytest.mark.parametrize(
    "edit, tensor, message",
    [
        (
            lambda t: t.pop("model.layers.0.self_attn.o_proj.weight_scale_2"),
            "o_proj.weight_scale_2",
            "missing",
        ),
        (
            lambda t: t.update({"model.layers.0.self_attn.o_proj.input_scale": np.ones(2, np.float32)}),
            "o_proj.input_scale",
            "expected one float",
        ),
        (
            lambda t: t.update(
                {"model.layers.0.self_attn.o_proj.weight_scale": np.ones((64, 6), np.float32)}
            ),
            "o_proj.weight_scale",
            "float8_e4m3fn",
        ),
    ],
    ids=["no-global-scale", "input-scale-shape", "scale-dtype"],
)
def test_bad_tensors_are_named(tiny, tmp_path, edit, tensor, message):
    ckpt = _copy(tiny, tmp_path)
    _rewrite(ckpt, edit)
    with pytest.raises(CheckpointError, match=message) as err:
        load_params(ckpt)
    assert err.value.tensor.endswith(tensor)


def test_input_scale_is_ignored(tiny, tmp_path):
    """W4A16: a W4A4 checkpoint's activation scales change nothing (W4A16_NVFP4 files have none)."""
    ckpt = _copy(tiny, tmp_path)
    _rewrite(ckpt, lambda t: [t.pop(k) for k in list(t) if k.endswith(".input_scale")])
    a, b = load_params(tiny), load_params(ckpt)
    for path in a:
        np.testing.assert_array_equal(a[path], b[path])
