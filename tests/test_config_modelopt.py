"""ModelOpt NVFP4 configs (docs/models.md §4.8): config.json's form, hf_quant_config.json's, the
exclusion wildcards, and errors that name the file and the field."""

import json

import pytest

from jaxdsa.checkpoints.tiny.presets import TINY_PRESETS
from jaxdsa.config import ConfigError
from jaxdsa.models.registry import config_from_dict, load_config

# config.json's quantization_config as ModelOpt's convert_hf_quant_config_format writes it
CONVERTED = {
    "quant_method": "modelopt",
    "quant_algo": "NVFP4",
    "config_groups": {
        "group_0": {
            "input_activations": {"dynamic": False, "num_bits": 4, "type": "float", "group_size": 16},
            "weights": {"dynamic": False, "num_bits": 4, "type": "float", "group_size": 16},
            "targets": ["Linear"],
        }
    },
    "ignore": ["lm_head", "model.layers.0.self_attn*", "*.mlp.experts.3.*", "model.layers.1.mlp"],
    "kv_cache_scheme": {"dynamic": False, "num_bits": 8, "type": "float"},
    "producer": {"name": "modelopt", "version": "0.40.0"},
}
# hf_quant_config.json, ModelOpt's own form
HF_QUANT = {
    "producer": {"name": "modelopt", "version": "0.40.0"},
    "quantization": {
        "quant_algo": "NVFP4",
        "kv_cache_quant_algo": "FP8",
        "group_size": 16,
        "exclude_modules": ["lm_head", "model.layers.0.self_attn*"],
    },
}


def _write(directory, config: dict, hf_quant: dict | None = None) -> None:
    (directory / "config.json").write_text(json.dumps(config))
    if hf_quant is not None:
        (directory / "hf_quant_config.json").write_text(json.dumps(hf_quant))


def test_converted_form_and_wildcards():
    q = config_from_dict(dict(TINY_PRESETS["glm5"], quantization_config=CONVERTED)).quantization
    assert (q.method, q.group_size, q.ignore) == ("nvfp4", 16, tuple(CONVERTED["ignore"]))
    yes = [
        "model.layers.1.self_attn.q_a_proj",
        "model.layers.3.mlp.experts.2.gate_proj",
        "model.layers.0.mlp.down_proj",
        "model.layers.3.mlp.experts.13.up_proj",  # '*.mlp.experts.3.*' is not expert 13
    ]
    no = [
        "lm_head",
        "model.layers.0.self_attn.kv_b_proj",  # 'path*' covers the subtree
        "model.layers.0.self_attn.indexer.wk",
        "model.layers.2.mlp.experts.3.down_proj",
        "model.layers.1.mlp.gate_proj",  # an exact name excludes the modules under it
    ]
    assert [q.quantizes(m) for m in yes] == [True] * len(yes)
    assert [q.quantizes(m) for m in no] == [False] * len(no)


@pytest.mark.parametrize("algo", ["NVFP4", "nvfp4", "W4A16_NVFP4"])
def test_algorithms_jaxdsa_runs(algo):
    conf = dict(CONVERTED, quant_algo=algo)
    assert (
        config_from_dict(dict(TINY_PRESETS["glm5"], quantization_config=conf)).quantization.method == "nvfp4"
    )


def test_hf_quant_config_beside_config_json(tmp_path):
    _write(tmp_path, TINY_PRESETS["glm5"], HF_QUANT)
    q = load_config(tmp_path).quantization
    assert (q.method, q.ignore) == ("nvfp4", ("lm_head", "model.layers.0.self_attn*"))
    # config.json's own section wins over the side file
    _write(
        tmp_path, dict(TINY_PRESETS["glm5"], quantization_config=CONVERTED), dict(HF_QUANT, quantization=1)
    )
    assert load_config(tmp_path).quantization.ignore == tuple(CONVERTED["ignore"])


@pytest.mark.parametrize(
    "change, field",
    [
        ({"quant_algo": "MIXED_PRECISION"}, "quant_algo"),
        ({"quant_algo": "NVFP4_AWQ"}, "quant_algo"),
        ({"quant_algo": "FP8"}, "quant_algo"),
        ({"quant_algo": None}, "quant_algo"),
        ({"group_size": 32}, "group_size"),
        ({"exclude_modules": "lm_head"}, "exclude_modules"),
    ],
)
def test_hf_quant_config_errors_name_its_file_and_field(tmp_path, change, field):
    inner = {k: v for k, v in {**HF_QUANT["quantization"], **change}.items() if v is not None}
    _write(tmp_path, TINY_PRESETS["glm5"], dict(HF_QUANT, quantization=inner))
    with pytest.raises(ConfigError) as err:
        load_config(tmp_path)
    assert err.value.source == str(tmp_path / "hf_quant_config.json")
    assert err.value.field == "quantization." + field


@pytest.mark.parametrize(
    "change, field",
    [
        ({"quant_algo": "W4A8_NVFP4_FP8"}, "quant_algo"),
        ({"config_groups": {"a": CONVERTED["config_groups"]["group_0"], "b": {}}}, "config_groups"),
        (
            {"config_groups": {"g": {"weights": {"num_bits": 4, "type": "float", "group_size": 32}}}},
            "config_groups.g.weights.group_size",
        ),
        ({"config_groups": {"g": {"weights": {"num_bits": 4, "type": "int"}}}}, "config_groups.g.weights"),
        ({"config_groups": {}, "group_size": 8}, "group_size"),
        ({"ignore": [1]}, "ignore"),
    ],
)
def test_config_json_errors_name_the_field(tmp_path, change, field):
    _write(tmp_path, dict(TINY_PRESETS["glm5"], quantization_config={**CONVERTED, **change}))
    with pytest.raises(ConfigError) as err:
        load_config(tmp_path)
    assert err.value.source == str(tmp_path / "config.json")
    assert err.value.field == "quantization_config." + field
