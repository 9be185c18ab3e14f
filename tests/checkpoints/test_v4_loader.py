"""DeepSeek-V4 checkpoints: FP8 ue8m0 / FP4 decoding, both name forms, and loader errors."""

from __future__ import annotations

import json
import shutil

import jax
import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file

from checkpoints.errors import CheckpointError
from checkpoints.safetensors_io import CheckpointReader
from checkpoints.v4_formats import decode_e8m0, dequantize_fp4, dequantize_fp8, unpack_e2m1
from checkpoints.v4_loader import load_v4
from jaxdsa.models.deepseek_v4.params import release_name
from tests.conftest import FIXTURES


def test_e8m0_scales():
    raw = np.array([127, 128, 0, 254, 255], np.uint8)
    got = decode_e8m0(raw.view(ml_dtypes.float8_e8m0fnu))
    np.testing.assert_array_equal(got[:4], np.array([1.0, 2.0, 2.0**-127, 2.0**127], np.float32))
    assert np.isnan(got[4])


def test_e2m1_nibbles_low_first():
    # 0x21: low nibble 1 (0.5) is column 0, high nibble 2 (1.0) column 1; 0xF8: -0.0 then -6
    got = unpack_e2m1(np.array([[0x21, 0xF8 - 256]], np.int8))
    np.testing.assert_array_equal(got, np.array([[0.5, 1.0, -0.0, -6.0]], np.float32))
    assert np.signbit(got[0, 2])


def test_fp8_ceil_blocks():
    rng = np.random.default_rng(0)
    w = rng.standard_normal((40, 33)).astype(ml_dtypes.float8_e4m3fn)  # partial last row and column blocks
    exponents = rng.integers(120, 135, size=(2, 2)).astype(np.uint8)
    got = dequantize_fp8(w, exponents.view(ml_dtypes.float8_e8m0fnu), (32, 32))
    want = np.empty((40, 33), np.float32)
    for i in range(40):
        for j in range(33):
            want[i, j] = float(w[i, j]) * 2.0 ** (int(exponents[i // 32, j // 32]) - 127)
    np.testing.assert_array_equal(got, want)
    with pytest.raises(ValueError, match="scale"):
        dequantize_fp8(w, exponents[:1].view(ml_dtypes.float8_e8m0fnu), (32, 32))


def test_fp4_per_32_scales():
    rng = np.random.default_rng(1)
    codes = rng.integers(0, 16, size=(3, 64)).astype(np.uint8)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).view(np.int8)
    exponents = rng.integers(120, 130, size=(3, 2)).astype(np.uint8)
    got = dequantize_fp4(packed, exponents.view(ml_dtypes.float8_e8m0fnu))
    magnitude = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], np.float32)[codes & 7] * np.where(codes >= 8, -1, 1)
    np.testing.assert_array_equal(
        got, magnitude * 2.0 ** (np.repeat(exponents, 32, axis=1).astype(np.int32) - 127)
    )


def test_hf_saved_names_are_release_names():
    """HF's save_pretrained names (dsv4) map onto exactly the release names (dsv4_sharded)."""
    hf = {release_name(n) for n in CheckpointReader(str(FIXTURES / "dsv4")).keys()}
    release = set(CheckpointReader(str(FIXTURES / "dsv4_sharded")).keys())
    assert hf == release
    assert release_name("model.layers.3.attn.norm.weight") == "layers.3.attn.kv_norm.weight"
    assert (
        release_name("model.layers.3.attn.compressor.norm.weight") == "layers.3.attn.compressor.norm.weight"
    )


def _tensors(directory):
    reader = CheckpointReader(str(directory))
    return {name: np.array(reader.get(name)) for name in reader.keys()}


def _write(directory, tensors, config_from):
    directory.mkdir()
    shutil.copy(config_from / "config.json", directory / "config.json")
    save_file(tensors, str(directory / "model.safetensors"))
    return directory


def test_both_name_forms_load_the_same_params(tmp_path):
    """The HF-saved dsv4 checkpoint, rewritten under release names, loads into identical params."""
    tensors = _tensors(FIXTURES / "dsv4")
    renamed = _write(
        tmp_path / "release", {release_name(k): v for k, v in tensors.items()}, FIXTURES / "dsv4"
    )
    cfg_a, a = load_v4(FIXTURES / "dsv4")
    cfg_b, b = load_v4(renamed)
    assert cfg_a == cfg_b
    leaves_a, leaves_b = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
    assert jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b)
    assert all(np.array_equal(x, y) for x, y in zip(leaves_a, leaves_b))


def test_quantized_checkpoint_decodes(tmp_path):
    cfg, params = load_v4(FIXTURES / "dsv4_fp8")
    assert cfg.expert_dtype == "fp4" and params["layers"][3]["ffn"]["experts"]["gate_up"].dtype == np.float32
    # fp8 weights without a quantization_config are refused
    (tmp_path / "plain").mkdir()
    for f in (FIXTURES / "dsv4_fp8").iterdir():
        shutil.copy(f, tmp_path / "plain" / f.name)
    config = json.loads((tmp_path / "plain" / "config.json").read_text())
    del config["quantization_config"], config["expert_dtype"]
    (tmp_path / "plain" / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="float8 weight|packed int8"):
        load_v4(tmp_path / "plain")


@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda t: t.pop("layers.2.attn.compressor.ape"), "layers.2.attn.compressor.ape.*missing"),
        (
            lambda t: t.update({"layers.0.attn.typo.weight": np.zeros(2, np.float32)}),
            "not a DeepSeek-V4 tensor",
        ),
        (
            lambda t: t.update({"layers.1.attn.wkv.weight": np.zeros((31, 32), np.float32)}),
            r"shape \[31, 32\]",
        ),
        (
            lambda t: t.update({"layers.0.ffn.gate.tid2eid": np.full((128, 2), 8, np.int64)}),
            "expert ids outside",
        ),
        (lambda t: t.update({"model.embed_tokens.weight": t["embed.weight"]}), "same tensor"),
    ],
    ids=["missing", "unknown", "shape", "tid2eid_range", "duplicate_forms"],
)
def test_errors_name_the_tensor(tmp_path, edit, match):
    tensors = {release_name(k): v for k, v in _tensors(FIXTURES / "dsv4").items()}
    edit(tensors)
    with pytest.raises(CheckpointError, match=match):
        load_v4(_write(tmp_path / "bad", tensors, FIXTURES / "dsv4"))
