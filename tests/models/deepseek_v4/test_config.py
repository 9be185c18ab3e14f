"""DeepSeek-V4 config parsing: both config.json forms, and errors that name the file and the field."""

import copy
import json

import pytest

from jaxdsa.checkpoints.tiny.presets import V4_TINY_PRESETS, release_form
from jaxdsa.config import ConfigError
from jaxdsa.models.deepseek_v4.config import CSA, HCA, SWA, load_v4_config, v4_config_from_dict
from tests.conftest import FIXTURES

HF = V4_TINY_PRESETS["dsv4"]
RELEASE = release_form(HF)


def test_both_forms_parse_to_the_same_config():
    hf, release = v4_config_from_dict(HF), v4_config_from_dict(RELEASE)
    assert hf == release
    assert hf.layer_types == (SWA, CSA, HCA, CSA) and hf.compress_ratios == (0, 4, 8, 4)
    assert hf.hash_layers == (True, True, False, False)
    assert (hf.mtp_layer_type, hf.mtp_compress_ratio) == (SWA, 0)
    assert hf.qk_rope_head_dim == 8 and hf.rope.type == "default" and hf.rope.theta == 10000.0
    # the release form's YaRN gets attention factor 1 (HF forces it), as the nested preset says
    assert hf.compress_rope.type == "yarn" and hf.compress_rope.attention_factor == 1.0
    assert hf.compress_rope.theta == 160000.0 and hf.compress_rope.factor == 8.0


def test_fixture_configs():
    """HF's save_pretrained output (with its stray qk_rope_head_dim) and the release files agree."""
    configs = {name: load_v4_config(FIXTURES / name) for name in ("dsv4", "dsv4_sharded", "dsv4_fp8")}
    assert configs["dsv4"] == configs["dsv4_sharded"]
    fp8 = configs["dsv4_fp8"]
    assert fp8.expert_dtype == "fp4" and fp8.quantization.weight_block_size == (32, 32)
    assert fp8.replace(quantization=None, expert_dtype=None) == configs["dsv4"]


def test_released_flash_schedule():
    """V4-Flash ships 44 ratios for 43 layers (+ MTP); a later variant pads to 46."""
    raw = copy.deepcopy(RELEASE) | {"num_hidden_layers": 43, "num_hash_layers": 3}
    raw["compress_ratios"] = [0, 0] + [4, 128] * 20 + [4, 0, 0, 0]
    cfg = v4_config_from_dict(raw)
    assert cfg.layer_types.count(CSA) == 21 and cfg.layer_types.count(HCA) == 20
    assert cfg.compress_ratio(42) == 4 and cfg.mtp_layer_type == SWA and cfg.is_hash_layer(2)


@pytest.mark.parametrize(
    "change, field",
    [
        ({"model_type": "deepseek_v32"}, "model_type"),
        ({"scoring_func": "sigmoid"}, "scoring_func"),
        ({"num_key_value_heads": 2}, "num_key_value_heads"),
        ({"layer_types": [SWA, CSA, "full_attention", CSA]}, "layer_types"),
        ({"layer_types": [SWA, CSA]}, "layer_types"),
        ({"compress_ratios": [0, 4, 128, 4, 0]}, "compress_ratios"),  # HF form says HCA ratio 8
        ({"num_hash_layers": 1}, "num_hash_layers"),  # contradicts mlp_layer_types
        ({"qk_rope_head_dim": 16}, "qk_rope_head_dim"),  # contradicts partial_rotary_factor 0.25
        ({"compress_rates": {CSA: 4, HCA: 0}}, f"compress_rates.{HCA}"),
        ({"norm_topk_prob": False}, "norm_topk_prob"),
        ({"o_groups": 3}, "o_groups"),
        ({"expert_dtype": "fp8"}, "expert_dtype"),
        ({"tie_word_embeddings": True}, "tie_word_embeddings"),
    ],
)
def test_bad_hf_form(change, field):
    with pytest.raises(ConfigError) as e:
        v4_config_from_dict({**HF, **change}, "cfg.json")
    assert e.value.source == "cfg.json" and e.value.field == field


def test_bad_nested_rope():
    raw = copy.deepcopy(HF)
    raw["rope_parameters"]["compress"]["partial_rotary_factor"] = 0.5
    with pytest.raises(ConfigError, match="rope_parameters.compress.partial_rotary_factor"):
        v4_config_from_dict(raw)
    raw = copy.deepcopy(HF)
    raw["rope_parameters"]["compress"]["rope_type"] = "longrope"
    with pytest.raises(ConfigError, match="rope_parameters.compress.rope_type"):
        v4_config_from_dict(raw)
    raw = copy.deepcopy(HF)
    raw["rope_theta"] = 5.0
    with pytest.raises(ConfigError, match="'rope_theta'"):
        v4_config_from_dict(raw)


@pytest.mark.parametrize(
    "change, field",
    [
        ({"compress_ratios": [0, 4]}, "compress_ratios"),
        ({"compress_ratios": None}, "layer_types"),
        ({"num_hash_layers": 9}, "num_hash_layers"),
        ({"num_hash_layers": None}, "num_hash_layers"),
        ({"compress_rope_theta": None}, "compress_rope_theta"),
        ({"qk_rope_head_dim": 7}, "qk_rope_head_dim"),
        ({"rope_scaling": {"type": "yarn", "factor": 16}}, "rope_scaling.original_max_position_embeddings"),
        ({"quantization_config": {"quant_method": "fp8", "fmt": "e5m2"}}, "quantization_config.fmt"),
        ({"expert_dtype": "fp4"}, "expert_dtype"),  # fp4 experts without a quantization_config
    ],
)
def test_bad_release_form(change, field, tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**RELEASE, **change}))
    with pytest.raises(ConfigError) as e:
        load_v4_config(tmp_path)
    assert e.value.source == str(path) and e.value.field == field


def test_unreadable_file(tmp_path):
    (tmp_path / "config.json").write_text("{")
    with pytest.raises(ConfigError, match="invalid JSON"):
        load_v4_config(tmp_path)
