"""make_tiny writes the Hub layout of docs/models.md §4.1/§4.2, deterministically, with sane weights.

The expected names and shapes below are written out from docs/models.md for the tiny presets, not
computed by make_tiny's own code, so a naming slip shows up here.
"""

from __future__ import annotations

import json
import pathlib

import ml_dtypes
import numpy as np
import pytest
from tokenizers import Tokenizer

from jaxdsa.checkpoints.quant import dequantize_nvfp4
from jaxdsa.checkpoints.safetensors_io import CheckpointReader
from jaxdsa.checkpoints.tiny.cli import main
from jaxdsa.checkpoints.tiny.make import make_tiny
from jaxdsa.checkpoints.tiny.presets import TINY_PRESETS
from jaxdsa.models.registry import load_config
from tests.checkpoints.conftest import check_shards_and_bfloat16, read_tensors

FAMILY = {"glm5": "glm_moe_dsa", "glm52": "glm_moe_dsa", "dsv32": "deepseek_v32"}


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> dict[str, pathlib.Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {p: pathlib.Path(make_tiny(FAMILY[p], root / p, preset=p)) for p in FAMILY}


@pytest.fixture(scope="module")
def tensors(ckpts) -> dict[str, dict[str, tuple[np.ndarray, str]]]:
    return {p: read_tensors(path) for p, path in ckpts.items()}


# Shapes for the glm5 preset (D=64, V=512, H=4, nope 16, rope 8, v 24, q_lora 32, kv_lora 128,
# 16 index heads x 32, dense 128, 8 experts x 32): docs/models.md §4.1 formulas evaluated by hand.
GLM5_LAYER0 = {
    "input_layernorm.weight": (64,),
    "post_attention_layernorm.weight": (64,),
    "self_attn.q_a_proj.weight": (32, 64),
    "self_attn.q_a_layernorm.weight": (32,),
    "self_attn.q_b_proj.weight": (96, 32),
    "self_attn.kv_a_proj_with_mqa.weight": (136, 64),
    "self_attn.kv_a_layernorm.weight": (128,),
    "self_attn.kv_b_proj.weight": (160, 128),
    "self_attn.o_proj.weight": (64, 96),
    "self_attn.indexer.wq_b.weight": (512, 32),
    "self_attn.indexer.wk.weight": (32, 64),
    "self_attn.indexer.k_norm.weight": (32,),
    "self_attn.indexer.k_norm.bias": (32,),
    "self_attn.indexer.weights_proj.weight": (16, 64),
    "mlp.gate_proj.weight": (128, 64),
    "mlp.up_proj.weight": (128, 64),
    "mlp.down_proj.weight": (64, 128),
}
GLM5_MOE = {
    "mlp.gate.weight": (8, 64),
    "mlp.gate.e_score_correction_bias": (8,),
    "mlp.experts.0.gate_proj.weight": (32, 64),
    "mlp.experts.7.up_proj.weight": (32, 64),
    "mlp.experts.7.down_proj.weight": (64, 32),
    "mlp.shared_experts.gate_proj.weight": (32, 64),
    "mlp.shared_experts.up_proj.weight": (32, 64),
    "mlp.shared_experts.down_proj.weight": (64, 32),
}
MTP_EXTRA = {
    "enorm.weight": (64,),
    "hnorm.weight": (64,),
    "eh_proj.weight": (64, 128),
    "shared_head.norm.weight": (64,),
}
# 3 top-level + per layer 9 attention (+5 indexer) + dense 3 / MoE 2 + 3 * (E + 1) (+4 MTP).
TENSOR_COUNT = {"glm5": 170, "glm52": 160, "dsv32": 242}


def test_glm5_names_and_shapes(tensors):
    t = tensors["glm5"]
    shapes = {name: value.shape for name, (value, _) in t.items()}
    assert len(shapes) == TENSOR_COUNT["glm5"]
    assert shapes["model.embed_tokens.weight"] == (512, 64)
    assert shapes["lm_head.weight"] == (512, 64)
    assert shapes["model.norm.weight"] == (64,)
    for name, shape in GLM5_LAYER0.items():
        assert shapes[f"model.layers.0.{name}"] == shape, name
    for layer in (2, 3, 4):  # MoE layers, the MTP layer (4) included
        for name, shape in GLM5_MOE.items():
            assert shapes[f"model.layers.{layer}.{name}"] == shape, (layer, name)
        assert f"model.layers.{layer}.mlp.gate_proj.weight" not in shapes
    for name, shape in MTP_EXTRA.items():
        assert shapes[f"model.layers.4.{name}"] == shape
    assert not any(n.startswith("model.layers.5.") for n in shapes)
    assert not any(f"model.layers.{layer}.{name}" in shapes for layer in range(4) for name in MTP_EXTRA)


def test_dsv32_shapes(tensors):
    shapes = {name: value.shape for name, (value, _) in tensors["dsv32"].items()}
    assert len(shapes) == TENSOR_COUNT["dsv32"]
    assert shapes["model.layers.1.self_attn.kv_b_proj.weight"] == (128, 128)  # 4 * (16 + 16)
    assert shapes["model.layers.1.self_attn.o_proj.weight"] == (64, 64)
    assert shapes["model.layers.2.mlp.gate.weight"] == (16, 64)
    assert shapes["model.layers.2.mlp.experts.15.down_proj.weight"] == (64, 32)
    assert shapes["model.layers.4.eh_proj.weight"] == (64, 128)
    for layer in range(5):  # DeepSeek-V3.2: every layer has an indexer
        assert f"model.layers.{layer}.self_attn.indexer.wk.weight" in shapes


def test_glm52_indexer_only_on_full_layers(tensors):
    names = tensors["glm52"]
    assert len(names) == TENSOR_COUNT["glm52"]
    with_indexer = {int(n.split(".")[2]) for n in names if ".indexer." in n}
    assert with_indexer == {0, 1, 4}  # indexer_types full, full, shared, shared; MTP layer always full
    assert {n.split("indexer.")[1] for n in names if n.startswith("model.layers.4.self_attn.indexer.")} == {
        "wq_b.weight",
        "wk.weight",
        "k_norm.weight",
        "k_norm.bias",
        "weights_proj.weight",
    }


@pytest.mark.parametrize("preset", sorted(FAMILY))
def test_dtypes_and_weight_scales(tensors, preset):
    for name, (value, dtype) in tensors[preset].items():
        assert dtype == "F32", name
        if name.endswith("e_score_correction_bias"):
            assert np.all(value != 0) and 0.02 < value.std() < 0.3, name
        elif name.endswith("norm.weight"):
            assert abs(value.mean() - 1) < 0.1 and value.std() < 0.3, name
        elif name == "model.embed_tokens.weight":
            assert abs(value.std() - 1) < 0.05
        elif value.ndim == 2 and value.size >= 2048:  # linear [out, in]: std 1/sqrt(in)
            assert abs(value.std() * np.sqrt(value.shape[1]) - 1) < 0.1, name


@pytest.mark.parametrize("preset", sorted(FAMILY))
def test_config_and_generation_config(ckpts, preset):
    path = ckpts[preset]
    raw = json.loads((path / "config.json").read_text())
    assert raw == {**TINY_PRESETS[preset], "vocab_size": 512, "dtype": "float32"}
    cfg = load_config(path)
    assert cfg.vocab_size == Tokenizer.from_file(str(path / "tokenizer.json")).get_vocab_size() == 512
    generation = json.loads((path / "generation_config.json").read_text())
    if FAMILY[preset] == "glm_moe_dsa":  # <|endoftext|>, <|user|>, <|observation|>
        assert generation == {"eos_token_id": [492, 499, 501], "pad_token_id": 492}
    else:
        assert generation == {"bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 1}
        assert (cfg.bos_token_id, cfg.eos_token_ids) == (0, (1,))  # the preset's ids are the tokenizer's
    tok_cfg = json.loads((path / "tokenizer_config.json").read_text())
    assert tok_cfg["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert tok_cfg["model_max_length"] == 256 and tok_cfg["chat_template"]


def test_deterministic_for_a_seed(ckpts, tmp_path):
    again = pathlib.Path(make_tiny("glm_moe_dsa", tmp_path / "again", preset="glm5"))
    for file in ckpts["glm5"].iterdir():
        assert (again / file.name).read_bytes() == file.read_bytes(), file.name
    other = read_tensors(pathlib.Path(make_tiny("glm_moe_dsa", tmp_path / "seed1", preset="glm5", seed=1)))
    base = read_tensors(ckpts["glm5"])
    assert all(not np.array_equal(other[n][0], base[n][0]) for n in base)


def test_shards_and_bfloat16(tensors, tmp_path):
    path = pathlib.Path(make_tiny("deepseek_v32", tmp_path / "sharded", dtype="bfloat16", shards=3))
    check_shards_and_bfloat16(path, 3, tensors["dsv32"], fp32=("e_score_correction_bias",))


def test_rewrite_removes_stale_shards(tmp_path):
    make_tiny("glm_moe_dsa", tmp_path, shards=2)
    make_tiny("glm_moe_dsa", tmp_path)
    assert sorted(p.name for p in tmp_path.glob("model*")) == ["model.safetensors"]


def test_cli_and_errors(tmp_path, capsys):
    main(["--family", "deepseek_v32", "--out", str(tmp_path / "cli"), "--seed", "3"])
    assert capsys.readouterr().out.strip() == str(tmp_path / "cli")
    assert (tmp_path / "cli" / "model.safetensors").exists()
    with pytest.raises(ValueError, match="not glm_moe_dsa"):
        make_tiny("glm_moe_dsa", tmp_path / "x", preset="dsv32")
    with pytest.raises(ValueError, match="unknown family"):
        make_tiny("llama", tmp_path / "x")
    with pytest.raises(ValueError, match="dtype"):
        make_tiny("glm_moe_dsa", tmp_path / "x", dtype="float16")
    with pytest.raises(ValueError, match="shards"):
        make_tiny("glm_moe_dsa", tmp_path / "x", shards=171)
    assert not (tmp_path / "x").exists()  # arguments are checked before anything is written


def test_the_command_line_names_presets_and_sets_the_context(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["--family", "glm_moe_dsa", "--out", str(tmp_path / "a"), "--preset", "nope"])
    err = capsys.readouterr().err  # one usage line and the error, no traceback
    assert e.value.code == 2 and "unknown glm_moe_dsa preset 'nope'; choose from ['glm5', 'glm52']" in err
    assert "Traceback" not in err
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "glm_moe_dsa: glm5, glm52, default glm5" in " ".join(capsys.readouterr().out.split())
    main(["--family", "glm_moe_dsa", "--out", str(tmp_path / "b"), "--max-model-len", "4096"])
    config = json.loads((tmp_path / "b" / "config.json").read_text())
    assert (
        config["max_position_embeddings"] == 4096
        and load_config(tmp_path / "b").max_position_embeddings == 4096
    )
    assert json.loads((tmp_path / "b" / "tokenizer_config.json").read_text())["model_max_length"] == 4096
    with pytest.raises(SystemExit) as e:
        main(["--family", "glm_moe_dsa", "--out", str(tmp_path / "c"), "--max-model-len", "0"])
    assert e.value.code == 2 and "--max-model-len must be >= 1" in capsys.readouterr().err


def test_nvfp4_checkpoint(tmp_path, capsys):
    """``--quant nvfp4``: every linear but the head and the routers as ModelOpt NVFP4 (uint8 codes,
    e4m3 scales per 16, float32 global and input scales), both config files; the values are the
    float checkpoint's quantized: the NumPy decoder gives them back within NVFP4's error."""
    main(["--family", "glm_moe_dsa", "--out", str(tmp_path / "q"), "--seed", "3", "--quant", "nvfp4"])
    main(["--family", "glm_moe_dsa", "--out", str(tmp_path / "f"), "--seed", "3"])
    capsys.readouterr()
    quant, dense = (CheckpointReader(str(tmp_path / d)) for d in ("q", "f"))
    m = "model.layers.2.mlp.experts.3.up_proj"
    assert quant.dtype(m + ".weight") == np.uint8 and quant.shape(m + ".weight") == (32, 32)
    assert quant.dtype(m + ".weight_scale") == ml_dtypes.float8_e4m3fn and quant.shape(
        m + ".weight_scale"
    ) == (32, 4)
    assert quant.shape(m + ".weight_scale_2") == quant.shape(m + ".input_scale") == ()
    for plain in ("lm_head.weight", "model.layers.2.mlp.gate.weight", "model.norm.weight"):
        assert quant.dtype(plain) == np.float32
    w = dequantize_nvfp4(*(quant.get(f"{m}.{t}") for t in ("weight", "weight_scale", "weight_scale_2")))
    want = dense.get(m + ".weight")
    assert np.linalg.norm(w - want) / np.linalg.norm(want) < 0.15
    assert (tmp_path / "q" / "hf_quant_config.json").exists()
    assert (
        json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]["quant_algo"]
        == "NVFP4"
    )
    with pytest.raises(ValueError, match="glm_moe_dsa and deepseek_v32"):
        make_tiny("deepseek_v4", str(tmp_path / "v4"), quant="nvfp4")
