"""make_tiny --family glm5_next writes the Hugging Face layout of docs/models.md §9.8, deterministically.

Expected names, shapes and dtypes are written out by hand for the glm53 preset (D 64, vocab 512 from
the tokenizer, hc 4 -> HC mixes [24, 256]; KDA 4 heads x 32 = 128, conv 4; MLA 4 heads, q_lora 32,
kv_lora 128, nope 32, v 24; 16 index heads x 32, pools of 4; dense 128; 8 experts x 32; vision 2
blocks of 32, 2 heads, MLP 64, merged to 64 through a 48-wide MLP), so a naming slip in the maker
shows up here. That HF loads the result is tests/reference/check_make_tiny_hf_glm5_next.py's job.
"""

from __future__ import annotations

import json
import pathlib

import numpy as np
import pytest

from jaxdsa.checkpoints.tiny.cli import main
from jaxdsa.checkpoints.tiny.make import make_tiny
from jaxdsa.checkpoints.tiny.presets import GLM5_NEXT_TINY_PRESETS
from jaxdsa.models.glm5_next.config import load_glm5_next_config
from tests.checkpoints.conftest import check_shards_and_bfloat16, read_tensors

T = "model.language_model."
KDA_LAYER_0 = {  # KDA, dense FFN
    "input_layernorm.weight": (64,),
    "post_attention_layernorm.weight": (64,),
    "hc_attn_fn": (24, 256),
    "hc_attn_base": (24,),
    "hc_attn_scale": (3,),
    "hc_ffn_fn": (24, 256),
    "hc_ffn_base": (24,),
    "hc_ffn_scale": (3,),
    "self_attn.q_proj.weight": (128, 64),
    "self_attn.k_proj.weight": (128, 64),
    "self_attn.v_proj.weight": (128, 64),
    "self_attn.q_conv1d.weight": (128, 1, 4),
    "self_attn.k_conv1d.weight": (128, 1, 4),
    "self_attn.v_conv1d.weight": (128, 1, 4),
    "self_attn.f_a_proj.weight": (32, 64),
    "self_attn.f_b_proj.weight": (128, 32),
    "self_attn.dt_bias": (128,),
    "self_attn.A_log": (4,),
    "self_attn.b_proj.weight": (4, 64),
    "self_attn.g_a_proj.weight": (32, 64),
    "self_attn.g_b_proj.weight": (128, 32),
    "self_attn.o_norm.weight": (32,),
    "self_attn.o_proj.weight": (64, 128),
    "mlp.gate_proj.weight": (128, 64),
    "mlp.up_proj.weight": (128, 64),
    "mlp.down_proj.weight": (64, 128),
}
DSA_LAYER_1 = {  # DSA with its own indexer, dense FFN
    "self_attn.q_a_proj.weight": (32, 64),
    "self_attn.q_a_layernorm.weight": (32,),
    "self_attn.q_b_proj.weight": (128, 32),
    "self_attn.kv_a_proj_with_mqa.weight": (128, 64),
    "self_attn.kv_a_layernorm.weight": (128,),
    "self_attn.kv_b_proj.weight": (224, 128),
    "self_attn.o_proj.weight": (64, 96),
    "self_attn.indexer.wq_b.weight": (512, 32),
    "self_attn.indexer.wk.weight": (32, 64),
    "self_attn.indexer.k_norm.weight": (32,),
    "self_attn.indexer.k_norm.bias": (32,),
    "self_attn.indexer.weights_proj.weight": (16, 64),
    "self_attn.indexer.index_kpool_compress_ape": (4, 32),
    "self_attn.indexer.index_kpool_compress_gate": (32, 64),
    "mlp.gate_proj.weight": (128, 64),
}
MOE = {
    "mlp.gate.weight": (8, 64),
    "mlp.gate.e_score_correction_bias": (8,),
    "mlp.experts.0.gate_proj.weight": (32, 64),
    "mlp.experts.7.up_proj.weight": (32, 64),
    "mlp.experts.7.down_proj.weight": (64, 32),
    "mlp.shared_experts.gate_proj.weight": (32, 64),
    "mlp.shared_experts.down_proj.weight": (64, 32),
}
VISION = {
    "model.visual.patch_embed.proj.weight": (32, 3, 2, 14, 14),
    "model.visual.patch_embed.proj.bias": (32,),
    "model.visual.blocks.1.norm1.weight": (32,),
    "model.visual.blocks.1.attn.qkv.weight": (96, 32),
    "model.visual.blocks.1.attn.qkv.bias": (96,),
    "model.visual.blocks.1.attn.proj.bias": (32,),
    "model.visual.blocks.1.attn.q_norm.weight": (16,),
    "model.visual.blocks.1.mlp.up_proj.bias": (64,),
    "model.visual.blocks.1.mlp.down_proj.weight": (32, 64),
    "model.visual.post_layernorm.weight": (32,),
    "model.visual.downsample.weight": (64, 32, 2, 2),
    "model.visual.downsample.bias": (64,),
    "model.visual.merger.proj.weight": (64, 64),
    "model.visual.merger.post_projection_norm.bias": (64,),
    "model.visual.merger.gate_proj.weight": (48, 64),
    "model.visual.merger.down_proj.weight": (64, 48),
}
# Per layer 8 (norms, HC) + KDA 15 / DSA 7 (+ 7 indexer) + dense 3 / MoE 2 + 3 * (8 + 1); layers
# 0 KDA dense 26, 1 DSA dense 25, 2 shared DSA MoE 44, 3 / 4 / 6 KDA MoE 52, 5 / 7 DSA MoE 51;
# 3 top-level; vision 2 + 2 x 14 + 1 + 2 + 6.
TENSOR_COUNT = 26 + 25 + 44 + 3 * 52 + 2 * 51 + 3 + 39
# Stored float32 in a bfloat16 checkpoint: what HF keeps in float32.
FP32 = ("e_score_correction_bias", "_conv1d.weight", ".dt_bias", ".A_log", "_base", "_scale")


@pytest.fixture(scope="module")
def single(tmp_path_factory) -> pathlib.Path:
    return pathlib.Path(make_tiny("glm5_next", tmp_path_factory.mktemp("glm53")))


@pytest.fixture(scope="module")
def sharded(tmp_path_factory) -> pathlib.Path:
    path = tmp_path_factory.mktemp("glm53-bf16")
    return pathlib.Path(make_tiny("glm5_next", path, dtype="bfloat16", shards=3))


def test_names_and_shapes(single):
    shapes = {name: value.shape for name, (value, _) in read_tensors(single).items()}
    assert len(shapes) == TENSOR_COUNT
    assert shapes[T + "embed_tokens.weight"] == shapes["lm_head.weight"] == (512, 64)
    assert shapes[T + "norm.weight"] == (64,)
    for name, shape in KDA_LAYER_0.items():
        assert shapes[f"{T}layers.0.{name}"] == shape, name
    for name, shape in DSA_LAYER_1.items():
        assert shapes[f"{T}layers.1.{name}"] == shape, name
    for layer in range(2, 8):
        for name, shape in MOE.items():
            assert shapes[f"{T}layers.{layer}.{name}"] == shape, (layer, name)
        assert f"{T}layers.{layer}.mlp.gate_proj.weight" not in shapes
    for name, shape in VISION.items():
        assert shapes[name] == shape, name
    with_indexer = {int(n.split(".")[3]) for n in shapes if ".indexer." in n}
    assert with_indexer == {1, 5, 7}  # layer 2 is the shared DSA layer
    kda = {int(n.split(".")[3]) for n in shapes if n.endswith("A_log")}
    assert kda == {0, 3, 4, 6} and not any(".layers.8." in n for n in shapes)  # no next-n layer


def test_values_random_and_scaled(single):
    for name, (value, dtype) in read_tensors(single).items():
        assert dtype == "F32", name
        assert np.unique(value).size > 1, name  # nothing HF sets to a constant stays constant
        if name.endswith(("norm.weight", "_scale")):
            assert abs(value.mean() - 1) < 0.2 and value.std() < 0.3, name
        elif name.endswith("dt_bias"):
            assert abs(value.mean() + 2) < 0.3 and abs(value.std() - 1) < 0.2
        elif name.endswith(("bias", "_base", "A_log")):
            assert 0.02 < value.std() < 1 and abs(value.mean()) < 0.6, name
        elif name == T + "embed_tokens.weight" or name.endswith("compress_ape"):
            assert abs(value.std() - 1) < 0.2, name
        elif value.ndim >= 2 and value.size >= 2048:  # [out, in, ...]: std 1/sqrt(fan_in)
            fan_in = np.prod(value.shape[1:])
            assert abs(value.std() * np.sqrt(fan_in) - 1) < 0.1, name


def test_config_files(single):
    raw = json.loads((single / "config.json").read_text())
    preset = GLM5_NEXT_TINY_PRESETS["glm53"]
    assert raw == preset | {"dtype": "float32"}  # the preset's vocabulary and pad id are the tokenizer's
    cfg = load_glm5_next_config(single)
    assert (cfg.vocab_size, cfg.pad_token_id, cfg.dsa_layers) == (512, 492, (1, 2, 5, 7))
    generation = json.loads((single / "generation_config.json").read_text())
    assert generation == {"eos_token_id": [492, 499, 501], "pad_token_id": 492}  # GLM's stop tokens
    tokenizer = json.loads((single / "tokenizer_config.json").read_text())
    assert tokenizer["model_max_length"] == 256 and "[gMASK]" in tokenizer["chat_template"]


def test_shards_and_bfloat16(single, sharded):
    tensors = check_shards_and_bfloat16(sharded, 3, read_tensors(single), fp32=FP32)
    fp32 = {n for n in tensors if n.endswith(FP32)}
    assert len(fp32) == 8 * 4 + 6 + 4 * 5  # HC base + scale at 2 sites; router biases; KDA conv x 3, dt, A


def test_deterministic_cli(single, tmp_path, capsys):
    main(["--family", "glm5_next", "--out", str(tmp_path / "again")])
    assert capsys.readouterr().out.strip() == str(tmp_path / "again")
    for file in single.iterdir():
        assert (tmp_path / "again" / file.name).read_bytes() == file.read_bytes(), file.name
    other = read_tensors(pathlib.Path(make_tiny("glm5_next", tmp_path / "seed1", seed=1)))
    assert all(not np.array_equal(other[n][0], v) for n, (v, _) in read_tensors(single).items())


def test_cli_presets_context_and_errors(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "glm5_next: glm53, default glm53" in " ".join(capsys.readouterr().out.split())
    main(["--family", "glm5_next", "--out", str(tmp_path / "long"), "--max-model-len", "4096"])
    assert load_glm5_next_config(tmp_path / "long").max_position_embeddings == 4096
    assert json.loads((tmp_path / "long" / "tokenizer_config.json").read_text())["model_max_length"] == 4096
    with pytest.raises(SystemExit) as e:
        main(["--family", "glm5_next", "--out", str(tmp_path / "x"), "--preset", "glm5"])
    assert (
        e.value.code == 2
        and "unknown glm5_next preset 'glm5'; choose from ['glm53']" in capsys.readouterr().err
    )
    with pytest.raises(ValueError, match="shards"):
        make_tiny("glm5_next", tmp_path / "x", shards=TENSOR_COUNT + 1)
    assert not (tmp_path / "x").exists()  # arguments are checked before anything is written
