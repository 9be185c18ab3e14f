"""Config parsing: both families, YaRN, GLM-5.2 indexer schedules, and clear errors."""

import json
import math

import pytest

from jaxdsa.checkpoints.tiny.presets import TINY_PRESETS
from jaxdsa.config import ConfigError, yarn_attention_factor
from jaxdsa.models.registry import config_from_dict, load_config, tiny_config


def test_presets_parse():
    glm, ds, glm52 = tiny_config("glm5"), tiny_config("dsv32"), tiny_config("glm52")
    assert glm.model_type == "glm_moe_dsa" and glm.indexer_rope_interleave
    assert ds.model_type == "deepseek_v32" and not ds.indexer_rope_interleave
    assert glm52.indexer_layers == (0, 1)
    assert glm.latent_dim == 136 and glm.qk_head_dim == 24
    assert glm.softmax_scale == pytest.approx(24**-0.5)


def test_real_glm5_and_dsv32_scales():
    """Softmax scales of the released models (docs/models.md §1.2)."""
    glm = dict(TINY_PRESETS["glm5"], qk_nope_head_dim=192, qk_rope_head_dim=64, index_head_dim=128)
    assert config_from_dict(glm).softmax_scale == pytest.approx(0.0625)
    ds = dict(
        TINY_PRESETS["dsv32"],
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        index_head_dim=128,
        rope_parameters=None,
        rope_theta=10000,
        rope_scaling={
            "type": "yarn",
            "factor": 40,
            "original_max_position_embeddings": 4096,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
    )
    cfg = config_from_dict(ds)
    assert cfg.rope.type == "yarn" and cfg.rope.factor == 40
    assert cfg.softmax_scale == pytest.approx(0.1352338, rel=1e-6)
    assert yarn_attention_factor(cfg.rope) == 1.0


def test_yarn_attention_factor_follows_hf():
    rope = dict(TINY_PRESETS["dsv32"]["rope_parameters"], mscale=0.8, mscale_all_dim=1.0, factor=8.0)
    cfg = config_from_dict(dict(TINY_PRESETS["dsv32"], rope_parameters=rope))
    m = lambda s, k: 0.1 * k * math.log(s) + 1  # noqa: E731
    assert yarn_attention_factor(cfg.rope) == pytest.approx(m(8, 0.8) / m(8, 1.0))
    no_mscale = {k: v for k, v in rope.items() if k not in ("mscale", "mscale_all_dim")}
    cfg2 = config_from_dict(dict(TINY_PRESETS["dsv32"], rope_parameters=no_mscale))
    assert yarn_attention_factor(cfg2.rope) == pytest.approx(m(8, 1.0))
    assert cfg2.softmax_scale == pytest.approx(cfg2.qk_head_dim**-0.5)  # no mscale_all_dim -> no m^2


def test_glm52_schedule_from_freq_and_offset():
    raw = {k: v for k, v in TINY_PRESETS["glm52"].items() if k != "indexer_types"}
    raw.update(num_hidden_layers=12, index_topk_freq=4, index_skip_topk_offset=3)
    cfg = config_from_dict(raw)
    # full iff max(i - 3 + 1, 0) % 4 == 0 -> 0, 1, 2, 6, 10 (docs/models.md §1.1)
    assert cfg.indexer_layers == (0, 1, 2, 6, 10)
    pattern = config_from_dict({**raw, "index_topk_pattern": "FFSSFFSSFFSS"})
    assert pattern.indexer_layers == (0, 1, 4, 5, 8, 9)
    assert pattern.has_indexer(12)  # the MTP layer always has its own indexer


@pytest.mark.parametrize(
    "change, field",
    [
        ({"model_type": "llama"}, "model_type"),
        ({"hidden_size": None}, "hidden_size"),
        ({"hidden_size": "64"}, "hidden_size"),
        ({"n_group": 3}, "n_group"),
        ({"topk_group": 8}, "topk_group"),
        ({"first_k_dense_replace": 9}, "first_k_dense_replace"),
        ({"scoring_func": "softmax"}, "scoring_func"),
        ({"indexer_types": ["shared", "full", "full", "full"]}, "indexer_types"),
        ({"indexer_types": ["full"]}, "indexer_types"),
        ({"num_key_value_heads": 2}, "num_key_value_heads"),
        ({"rope_parameters": {"rope_type": "linear", "rope_theta": 1.0}}, "rope_parameters.rope_type"),
        ({"quantization_config": {"quant_method": "gptq"}}, "quantization_config.quant_method"),
        ({"mlp_layer_types": ["sparse", "dense", "sparse", "sparse"]}, "mlp_layer_types"),
    ],
)
def test_config_errors_name_the_field(tmp_path, change, field):
    raw = dict(TINY_PRESETS["glm5"])
    for k, v in change.items():
        if v is None:
            raw.pop(k)
        else:
            raw[k] = v
    path = tmp_path / "config.json"
    path.write_text(json.dumps(raw))
    with pytest.raises(ConfigError) as err:
        load_config(tmp_path)
    assert err.value.field == field
    assert str(path) in str(err.value) and field in str(err.value)


def test_unreadable_config(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="invalid JSON"):
        load_config(tmp_path)
    with pytest.raises(ConfigError, match="file not found"):
        load_config(tmp_path / "nowhere")


def test_quantization_configs():
    fp8 = config_from_dict(
        dict(
            TINY_PRESETS["glm5"],
            quantization_config={"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]},
        )
    )
    assert fp8.quantization.method == "fp8" and fp8.quantization.weight_block_size == (128, 128)
    ct = {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "config_groups": {
            "group_0": {
                "weights": {
                    "num_bits": 4,
                    "type": "int",
                    "symmetric": False,
                    "strategy": "group",
                    "group_size": 32,
                },
                "targets": ["Linear"],
            }
        },
        "ignore": ["lm_head"],
    }
    int4 = config_from_dict(dict(TINY_PRESETS["glm5"], quantization_config=ct)).quantization
    assert (int4.method, int4.group_size, int4.symmetric, int4.ignore) == (
        "compressed-tensors",
        32,
        False,
        ("lm_head",),
    )


def test_compressed_tensors_targets_and_ignore():
    """compressed-tensors matching: exact module names, the class name 'Linear', and 're:' patterns
    (re.match, a prefix match), for config_groups targets and for the ignore list."""
    ct = {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "config_groups": {
            "group_0": {
                "weights": {"num_bits": 4, "type": "int", "symmetric": True, "group_size": 128},
                "targets": [
                    "re:.*mlp\\.(experts\\.\\d+\\.)?(gate|up)_proj$",
                    "model.layers.0.self_attn.o_proj",
                ],
            }
        },
        "ignore": ["re:.*layers\\.1\\.", "model.layers.3.mlp.experts.0.up_proj"],
    }
    q = config_from_dict(dict(TINY_PRESETS["dsv32"], quantization_config=ct)).quantization
    assert q.targets == (ct["config_groups"]["group_0"]["targets"][0], "model.layers.0.self_attn.o_proj")
    yes = [
        "model.layers.0.mlp.gate_proj",
        "model.layers.3.mlp.experts.7.up_proj",
        "model.layers.0.self_attn.o_proj",
    ]
    no = [
        "model.layers.0.mlp.down_proj",  # no target matches
        "model.layers.1.mlp.gate_proj",  # ignored by pattern
        "model.layers.3.mlp.experts.0.up_proj",  # ignored by exact name
        "model.layers.2.self_attn.o_proj",  # the exact target names layer 0 only
    ]
    assert [q.quantizes(m) for m in yes] == [True] * 3
    assert [q.quantizes(m) for m in no] == [False] * 4
    everything = config_from_dict(
        dict(
            TINY_PRESETS["dsv32"],
            quantization_config=dict(
                ct,
                config_groups={"g": {"weights": ct["config_groups"]["group_0"]["weights"]}},
                ignore=["lm_head"],
            ),
        )
    ).quantization
    assert everything.targets == ("Linear",)
    assert everything.quantizes("model.layers.0.self_attn.kv_b_proj") and not everything.quantizes("lm_head")
