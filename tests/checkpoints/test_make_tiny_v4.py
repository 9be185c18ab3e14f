"""make_tiny --family deepseek_v4 writes the release layout of docs/models.md §4.4, deterministically.

Expected names, shapes and dtypes are written out by hand for the dsv4 preset (D 32, vocab 512 from
the tokenizer, 4 heads x 32, q_lora 40, 2 groups x 16, 16 index heads x 16, 8 experts x 32, hc 4).
"""

from __future__ import annotations

import json
import pathlib

import jax.numpy as jnp
import pytest

from jaxdsa.checkpoints.tiny.cli import main
from jaxdsa.checkpoints.tiny.make import make_tiny
from jaxdsa.loading import load_model
from jaxdsa.models.deepseek_v4.config import CSA, HCA, SWA
from tests.checkpoints.conftest import read_tensors

CSA_LAYER_1 = {
    "layers.1.attn_norm.weight": ((32,), "BF16"),
    "layers.1.hc_attn_fn": ((24, 128), "F32"),
    "layers.1.hc_ffn_scale": ((3,), "F32"),
    "layers.1.attn.attn_sink": ((4,), "F32"),
    "layers.1.attn.wq_a.weight": ((40, 32), "BF16"),
    "layers.1.attn.wq_b.weight": ((128, 40), "BF16"),
    "layers.1.attn.wkv.weight": ((32, 32), "BF16"),
    "layers.1.attn.kv_norm.weight": ((32,), "BF16"),
    "layers.1.attn.wo_a.weight": ((32, 64), "BF16"),
    "layers.1.attn.wo_b.weight": ((32, 32), "BF16"),
    "layers.1.attn.compressor.wkv.weight": ((64, 32), "BF16"),
    "layers.1.attn.compressor.ape": ((4, 64), "F32"),
    "layers.1.attn.indexer.wq_b.weight": ((256, 40), "BF16"),
    "layers.1.attn.indexer.weights_proj.weight": ((16, 32), "BF16"),
    "layers.1.attn.indexer.compressor.wgate.weight": ((32, 32), "BF16"),
    "layers.1.attn.indexer.compressor.ape": ((4, 32), "F32"),
    "layers.1.attn.indexer.compressor.norm.weight": ((16,), "BF16"),
    "layers.1.ffn.gate.weight": ((8, 32), "BF16"),
    "layers.1.ffn.gate.tid2eid": ((512, 2), "I64"),
    "layers.1.ffn.experts.7.w2.weight": ((32, 32), "BF16"),
    "layers.1.ffn.shared_experts.w3.weight": ((32, 32), "BF16"),
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return pathlib.Path(make_tiny("deepseek_v4", tmp_path_factory.mktemp("v4"), dtype="bfloat16", shards=3))


def test_release_layout(tiny):
    config = json.loads((tiny / "config.json").read_text())
    assert config["compress_ratios"] == [0, 4, 8, 4, 0] and config["num_hash_layers"] == 2
    assert config["rope_scaling"]["type"] == "yarn" and config["qk_rope_head_dim"] == 8
    tensors = read_tensors(tiny)
    for name, (shape, dtype) in CSA_LAYER_1.items():
        assert (tensors[name][0].shape, tensors[name][1]) == (shape, dtype), name
    assert tensors["layers.2.attn.compressor.ape"][0].shape == (8, 32)  # HCA: no overlap, no indexer
    assert not any(n.startswith("layers.2.attn.indexer") for n in tensors)
    assert "layers.3.ffn.gate.bias" in tensors and "layers.3.ffn.gate.tid2eid" not in tensors
    assert tensors["mtp.0.e_proj.weight"][0].shape == (32, 32) and tensors["mtp.0.hc_head_fn"][1] == "F32"
    tid2eid = tensors["layers.0.ffn.gate.tid2eid"][0]
    assert all(len(set(row)) == 2 for row in tid2eid) and tid2eid.max() < 8  # distinct experts per token


def test_loads(tiny):
    _, cfg, model = load_model(tiny, dtype=jnp.float32, progress=False)
    assert cfg.layer_types == (SWA, CSA, HCA, CSA) and cfg.vocab_size == 512 and len(model.mtp) == 1
    assert cfg.bos_token_id == 0 and cfg.eos_token_ids == (1,)


def test_cli_is_deterministic(tiny, tmp_path):
    main(["--family", "deepseek_v4", "--out", str(tmp_path), "--dtype", "bfloat16", "--shards", "3"])
    for file in tiny.glob("model*.safetensors"):
        assert (tmp_path / file.name).read_bytes() == file.read_bytes()
