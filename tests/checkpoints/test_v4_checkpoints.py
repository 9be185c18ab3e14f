"""DeepSeek-V4 checkpoints through the one walker: both name forms, FP8 + FP4, and errors naming the tensor.

(The FP8 ue8m0 and FP4 element decoders themselves are tested in test_quant.py.)
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import save_file

from jaxdsa.checkpoints.errors import CheckpointError
from jaxdsa.checkpoints.safetensors_io import CheckpointReader
from jaxdsa.loading import load_model
from jaxdsa.models.deepseek_v4.params import release_name, tensor_name
from pallas_kernels.quant.layout import QuantizedWeight, dequantize
from tests.conftest import FIXTURES


def _load(path):
    return load_model(path, dtype=jnp.float32, progress=False)


def test_hf_saved_names_read_as_release_names():
    """HF's save_pretrained names (dsv4) map onto exactly the release names (dsv4_sharded)."""
    hf = {tensor_name(n) for n in CheckpointReader(str(FIXTURES / "dsv4")).keys()}
    release = set(CheckpointReader(str(FIXTURES / "dsv4_sharded")).keys())
    assert hf == release
    assert release_name("model.layers.3.attn.norm.weight") == "layers.3.attn.kv_norm.weight"
    assert (
        release_name("model.layers.3.attn.compressor.norm.weight") == "layers.3.attn.compressor.norm.weight"
    )
    assert tensor_name("layers.0.ffn.experts.1.w2.scale") == "layers.0.ffn.experts.1.w2.weight_scale_inv"


def _tensors(directory):
    reader = CheckpointReader(str(directory))
    return {name: np.array(reader.get(name)) for name in reader.keys()}


def _write(directory, tensors, config_from, **config_changes):
    directory.mkdir()
    config = json.loads((config_from / "config.json").read_text())
    config = {k: v for k, v in (config | config_changes).items() if v is not None}
    (directory / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(directory / "model.safetensors"))
    return directory


def _leaves(model):
    return jax.tree.leaves(nnx.state(model, nnx.Param))


def test_both_name_forms_load_the_same_params(tmp_path):
    """The HF-saved dsv4 checkpoint, rewritten under release names, loads into identical parameters."""
    tensors = _tensors(FIXTURES / "dsv4")
    renamed = _write(
        tmp_path / "release", {release_name(k): v for k, v in tensors.items()}, FIXTURES / "dsv4"
    )
    _, cfg_a, a = _load(FIXTURES / "dsv4")
    _, cfg_b, b = _load(renamed)
    assert cfg_a == cfg_b and len(a.mtp) == len(b.mtp) == 1
    assert all(np.array_equal(x, y) for x, y in zip(_leaves(a), _leaves(b), strict=True))


def test_quantized_checkpoint_decodes_and_needs_its_config(tmp_path):
    """FP4 experts and FP8 linears are kept as they are stored, and hold exactly the values the
    dense load decodes; a file whose config does not say so is refused."""
    _, cfg, model = _load(FIXTURES / "dsv4_fp8")
    _, _, dense = load_model(  # its shared expert apart, as the FP8 one beside FP4 experts stays
        FIXTURES / "dsv4_fp8",
        dtype=jnp.float32,
        quantization="dequantize",
        progress=False,
        fuse_shared_experts=False,
    )
    flat = lambda m: {p: v.get_value() for p, v in nnx.to_flat_state(nnx.state(m, nnx.Param))}  # noqa: E731
    dense = flat(dense)
    for path, got in flat(model).items():
        want = dense[path]
        got = dequantize(got).reshape(want.shape) if isinstance(got, QuantizedWeight) else got
        np.testing.assert_array_equal(got, want, err_msg=str(path))
    experts = model.layer(3).ffn.experts
    assert cfg.expert_dtype == "fp4" and experts.gate_up.format == experts.down.format == "fp4"
    assert model.layer(3).attn.wq_b.weight.format == "fp8"
    tensors = _tensors(FIXTURES / "dsv4_fp8")
    plain = _write(
        tmp_path / "plain", tensors, FIXTURES / "dsv4_fp8", quantization_config=None, expert_dtype=None
    )
    with pytest.raises(CheckpointError, match="float8 weight but config.json has no fp8"):
        _load(plain)
    no_fp4 = _write(tmp_path / "no_fp4", tensors, FIXTURES / "dsv4_fp8", expert_dtype=None)
    with pytest.raises(CheckpointError, match="w1.weight.*does not say expert_dtype fp4"):
        _load(no_fp4)


@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda t: t.pop("layers.2.attn.compressor.ape"), "layers.2.attn.compressor.ape.*missing"),
        (
            lambda t: t.update({"layers.1.attn.wkv.weight": np.zeros((31, 32), np.float32)}),
            r"layers.1.attn.wkv.weight.*shape \[31, 32\]",
        ),
        (
            lambda t: t.update({"layers.0.ffn.gate.tid2eid": np.full((128, 2), 8, np.int64)}),
            r"tid2eid.*values outside \[0, 8\)",
        ),
        (lambda t: t.update({"model.embed_tokens.weight": t["embed.weight"]}), "same tensor"),
    ],
    ids=["missing", "shape", "tid2eid_range", "duplicate_forms"],
)
def test_errors_name_the_tensor(tmp_path, edit, match):
    tensors = {release_name(k): v for k, v in _tensors(FIXTURES / "dsv4").items()}
    edit(tensors)
    with pytest.raises(CheckpointError, match=match):
        _load(_write(tmp_path / "bad", tensors, FIXTURES / "dsv4"))
