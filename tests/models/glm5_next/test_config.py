"""GLM-5.3-Flash config parsing: the tiny preset, release-shaped files (HF's defaults, the release's
spellings, the flat form), and errors that name the file and the field.

What HF makes of the same dicts is checked in tests/reference/check_make_tiny_hf_glm5_next.py.
"""

import copy
import json

import pytest

from jaxdsa.checkpoints.tiny.presets import GLM5_NEXT_TINY_PRESETS
from jaxdsa.config import ConfigError
from jaxdsa.models.glm5_next.config import (
    DSA,
    FULL,
    KDA,
    SHARED,
    SPARSE,
    load_glm5_next_config,
    parse_config,
)

TINY = GLM5_NEXT_TINY_PRESETS["glm53"]
TOP = {"architectures": ["Glm5NextForConditionalGeneration"], "model_type": "glm5_next"}
# The release's shape; everything else is Glm5NextTextConfig's default.
SHAPE = {"num_hidden_layers": 45, "n_routed_experts": 288, "num_experts_per_tok": 8, "n_shared_experts": 1}
RELEASE = TOP | {"text_config": SHAPE | {"hc_mult": 4}}


def with_text(raw: dict, **changes) -> dict:
    raw = copy.deepcopy(raw)
    raw["text_config"] |= changes
    return raw


def test_tiny_preset():
    cfg = parse_config(TINY)
    assert cfg.kda_layers == (0, 3, 4, 6) and cfg.dsa_layers == (1, 2, 5, 7)
    assert [cfg.has_indexer(i) for i in (1, 2, 5, 7)] == [True, False, True, True]
    assert cfg.indexer_types[2] == SHARED and not cfg.has_indexer(0)  # a KDA layer has no indexer
    assert [cfg.is_moe_layer(i) for i in range(3)] == [False, False, True]
    assert (cfg.linear_dim, cfg.linear_lower_bound, cfg.linear_conv_kernel_dim) == (128, -5.0, 4)
    assert (cfg.qk_head_dim, cfg.qk_rope_head_dim, cfg.softmax_scale) == (32, 0, 32**-0.5)
    assert (cfg.index_pools, cfg.index_width) == (2, 11)  # 2 pools of 4 + the open pool's <= 3
    assert (cfg.hc_mult, cfg.n_group, cfg.swiglu_limit, cfg.pad_token_id) == (4, 4, 1.5, 492)
    assert cfg.eos_token_ids == () and cfg.num_nextn_predict_layers == 0 and not cfg.tie_word_embeddings
    assert cfg.architecture() == cfg.replace(pad_token_id=None)
    hash(cfg)  # a static argument of jitted functions


def test_release_shape_takes_hf_defaults():
    cfg = parse_config(RELEASE)
    assert len(cfg.kda_layers) == 34 and cfg.dsa_layers == tuple(range(3, 45, 4))  # 11 DSA layers
    assert cfg.indexer_types == (FULL,) * 45 and cfg.mlp_layer_types[2:4] == ("dense", SPARSE)
    assert cfg.mlp_layer_types.count("dense") == 3
    assert (cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size, cfg.moe_intermediate_size) == (
        154880,
        4096,
        12288,
        2048,
    )
    assert (cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.n_shared_experts) == (288, 8, 1)
    assert (cfg.n_group, cfg.topk_group, cfg.routed_scaling_factor, cfg.norm_topk_prob) == (1, 1, 2.5, True)
    assert (cfg.num_attention_heads, cfg.q_lora_rank, cfg.kv_lora_rank) == (64, 1536, 512)
    assert (cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.softmax_scale) == (256, 256, 1 / 16)
    assert (cfg.linear_num_heads, cfg.linear_head_dim, cfg.linear_dim) == (64, 128, 8192)
    assert (cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk, cfg.index_kpool) == (32, 128, 2048, 16)
    assert cfg.index_kpool_always_select_tail and cfg.index_width == 2048 + 15
    assert (cfg.hc_eps, cfg.hc_sinkhorn_iters, cfg.swiglu_limit, cfg.rms_norm_eps) == (1e-6, 20, 10.0, 1e-5)
    assert (cfg.max_position_embeddings, cfg.pad_token_id, cfg.bos_token_id) == (1048576, 154820, None)


def test_release_spellings_mean_the_hf_form():
    """deepseek_sparse_attention, linear_attn_config, first_k_dense_replace, MTP entries."""
    schedule = ["deepseek_sparse_attention" if i % 4 == 3 else KDA for i in range(45)]
    release = with_text(
        RELEASE,
        layer_types=schedule,
        mlp_layer_types=["dense"] * 3 + ["sparse"] * 42,
        indexer_types=["full"] * 46,  # one entry for the next-n layer
        first_k_dense_replace=3,
        num_nextn_predict_layers=1,
        mla_use_nope=True,
        mhc=True,
        scoring_func="sigmoid",
        topk_method="noaux_tc",
        linear_attn_config={
            "num_heads": 32,
            "head_dim": 64,
            "short_conv_kernel_size": 3,
            "gate_lower_bound": -4.0,
            "kda_layers": [i for i in range(45) if i % 4 != 3],
            "full_attn_layers": list(range(3, 45, 4)),
        },
    )
    hf = with_text(
        RELEASE, linear_num_heads=32, linear_head_dim=64, linear_conv_kernel_dim=3, linear_lower_bound=-4.0
    )
    assert parse_config(release) == parse_config(hf).replace(num_nextn_predict_layers=1)
    spelled = with_text(RELEASE, layer_types=["full_attention" if t != KDA else t for t in schedule])
    assert parse_config(spelled) == parse_config(RELEASE)


def test_flat_form_equals_nested():
    flat = TOP | TINY["text_config"] | {"model_type": "glm5_next"}
    assert parse_config(flat) == parse_config(TINY)


def test_gate_lower_bound_as_hf_reads_it():
    assert parse_config(with_text(TINY, linear_lower_bound=None)).linear_lower_bound is None  # softplus gate
    lin = {"gate_lower_bound": None}
    safe = with_text(TINY, linear_lower_bound=None, linear_attn_config=lin)
    assert parse_config(safe).linear_lower_bound == -5.0  # HF: a safe gate without a bound gets -5
    unsafe = with_text(TINY, linear_lower_bound=None, linear_attn_config=lin | {"safe_gate": False})
    assert parse_config(unsafe).linear_lower_bound is None


def test_indexer_schedules():
    n = RELEASE["text_config"]["num_hidden_layers"]
    freq = parse_config(
        with_text(RELEASE, index_topk_freq=2)
    )  # HF: offset 2, full iff max(i - 1, 0) % 2 == 0
    assert freq.indexer_types[:6] == (FULL, FULL, SHARED, FULL, SHARED, FULL)
    assert all(freq.has_indexer(i) for i in freq.dsa_layers)
    pattern = parse_config(with_text(RELEASE, index_topk_pattern="F" * (n - 1) + "S"))
    assert pattern.indexer_types[-1] == SHARED and not pattern.has_indexer(n - 1)
    layers = [KDA, DSA, DSA, DSA, KDA, DSA] + [KDA] * (n - 6)
    ok = parse_config(
        with_text(RELEASE, layer_types=layers, indexer_types=[FULL, FULL, SHARED] + [FULL] * (n - 3))
    )
    assert [ok.has_indexer(i) for i in (1, 2, 3, 5)] == [True, False, True, True]


def test_quantization_and_ids_at_the_top_level():
    raw = copy.deepcopy(TINY) | {
        "eos_token_id": [492, 499],
        "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]},
    }
    cfg = parse_config(raw)
    assert cfg.eos_token_ids == (492, 499) and cfg.quantization.method == "fp8"
    assert cfg.architecture() == parse_config(TINY).architecture()


def test_load_from_a_directory(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    assert load_glm5_next_config(tmp_path) == parse_config(TINY)


SHARED_AFTER_KDA = [FULL] * 5 + [SHARED] + [FULL] * 2  # layer 5 (DSA) follows layer 4 (KDA)
SHARED_AFTER_SHARED = ([KDA, DSA, DSA, DSA, KDA, DSA, KDA, DSA], [FULL, FULL, SHARED, SHARED] + [FULL] * 4)


@pytest.mark.parametrize(
    "change, field",
    [
        ({"num_hidden_layers": "8"}, "num_hidden_layers"),
        ({"hidden_size": 0}, "hidden_size"),
        ({"swiglu_limit": "high"}, "swiglu_limit"),
        ({"norm_topk_prob": 1}, "norm_topk_prob"),
        ({"model_type": "glm_moe_dsa"}, "model_type"),
        ({"layer_types": [KDA, DSA]}, "layer_types"),
        ({"layer_types": [KDA] * 7 + ["sliding_attention"]}, "layer_types"),
        ({"layer_types": "KDDK"}, "layer_types"),
        ({"mlp_layer_types": ["dense"] * 9}, "mlp_layer_types"),
        ({"mlp_layer_types": ["dense"] * 7 + ["moe"]}, "mlp_layer_types"),
        ({"indexer_types": [FULL] * 7}, "indexer_types"),
        ({"indexer_types": [FULL] * 7 + ["none"]}, "indexer_types"),
        ({"indexer_types": SHARED_AFTER_KDA}, "indexer_types"),
        ({"indexer_types": [SHARED] + [FULL] * 7, "layer_types": [DSA] * 8}, "indexer_types"),
        (dict(zip(("layer_types", "indexer_types"), SHARED_AFTER_SHARED)), "indexer_types"),
        ({"indexer_types": None, "index_topk_pattern": "FFXF"}, "index_topk_pattern"),
        ({"first_k_dense_replace": 3}, "first_k_dense_replace"),
        ({"mlp_layer_types": None, "first_k_dense_replace": 1}, "first_k_dense_replace"),
        ({"linear_attn_config": [4]}, "linear_attn_config"),
        ({"linear_attn_config": {"num_heads": 8}}, "linear_attn_config.num_heads"),
        ({"linear_attn_config": {"head_dim": 0}}, "linear_attn_config.head_dim"),
        ({"linear_attn_config": {"gate_lower_bound": -4.0}}, "linear_attn_config.gate_lower_bound"),
        ({"linear_attn_config": {"kda_layers": [0, 3, 4]}}, "linear_attn_config.kda_layers"),
        ({"linear_attn_config": {"full_attn_layers": [2, 3, 6, 8]}}, "linear_attn_config.full_attn_layers"),
        ({"linear_attn_config": {"kda_layers": ["0", 3, 4, 6]}}, "linear_attn_config.kda_layers"),
        ({"linear_lower_bound": 1.0}, "linear_lower_bound"),
        ({"qk_rope_head_dim": 64}, "qk_rope_head_dim"),
        ({"qk_head_dim": 64}, "qk_head_dim"),
        ({"num_key_value_heads": 1}, "num_key_value_heads"),
        ({"index_topk": 10}, "index_topk"),
        ({"index_kpool": 0}, "index_kpool"),
        ({"q_lora_rank": None}, "q_lora_rank"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"attention_bias": True}, "attention_bias"),
        ({"scoring_func": "softmax"}, "scoring_func"),
        ({"mhc": False}, "mhc"),
        ({"mla_use_nope": False}, "mla_use_nope"),
        ({"index_kpool_compress": False}, "index_kpool_compress"),
        ({"n_group": 3}, "n_group"),
        ({"n_group": 8, "topk_group": 4}, "n_group"),  # one expert per group: HF's top-2 group score fails
        ({"topk_group": 5}, "topk_group"),
        ({"num_experts_per_tok": 5}, "num_experts_per_tok"),  # > 2 kept groups x 2 experts
        ({"n_shared_experts": -1}, "n_shared_experts"),
        ({"pad_token_id": 512}, "pad_token_id"),
        ({"eos_token_id": "eos"}, "eos_token_id"),
        ({"tie_word_embeddings": True}, "tie_word_embeddings"),
        ({"num_nextn_predict_layers": -1}, "num_nextn_predict_layers"),
        ({"hc_sinkhorn_iters": 0}, "hc_sinkhorn_iters"),
    ],
)
def test_errors_name_file_and_field(change, field, tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(with_text(TINY, **change)))
    with pytest.raises(ConfigError) as e:
        load_glm5_next_config(tmp_path)
    where = f"text_config.{field}"
    assert e.value.source == str(path) and e.value.field == where, str(e.value)
    assert str(path) in str(e.value) and where in str(e.value)


@pytest.mark.parametrize(
    "raw, field",
    [
        (TINY | {"model_type": "glm_moe_dsa"}, "model_type"),
        (TINY | {"text_config": [1]}, "text_config"),
        (TINY | {"tie_word_embeddings": "no"}, "tie_word_embeddings"),
        (TINY | {"quantization_config": {"quant_method": "awq"}}, "quantization_config.quant_method"),
        (TOP | TINY["text_config"] | {"model_type": "glm5_next", "hidden_size": -1}, "hidden_size"),  # flat
    ],
)
def test_top_level_errors(raw, field):
    with pytest.raises(ConfigError) as e:
        parse_config(raw, "cfg.json")
    assert (e.value.source, e.value.field) == ("cfg.json", field)
