"""Tiny model configurations (HF ``config.json`` form) for tests, the bundled demo model and
:mod:`checkpoints.make_tiny`. Plain data: families parse them like any checkpoint's config."""

from __future__ import annotations

from typing import Any

_TINY_COMMON: dict[str, Any] = {
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 4,
    "first_k_dense_replace": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "q_lora_rank": 32,
    "kv_lora_rank": 128,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    # >= 16 indexer heads so that ReLU zeros do not create top-k ties (docs/models.md §8.13).
    "index_n_heads": 16,
    "index_head_dim": 32,
    "index_topk": 8,
    "n_routed_experts": 8,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "routed_scaling_factor": 2.5,
    "norm_topk_prob": True,
    "scoring_func": "sigmoid",
    "topk_method": "noaux_tc",
    "max_position_embeddings": 256,
    "num_nextn_predict_layers": 1,
    "tie_word_embeddings": False,
    "hidden_act": "silu",
    "attention_bias": False,
}

TINY_PRESETS: dict[str, dict[str, Any]] = {
    "glm5": {
        **_TINY_COMMON,
        "architectures": ["GlmMoeDsaForCausalLM"],
        "model_type": "glm_moe_dsa",
        "v_head_dim": 24,  # nope != v on purpose, like the real model
        "n_group": 4,
        "topk_group": 2,
        "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
        "rope_interleave": True,
        "indexer_rope_interleave": True,
        "indexer_types": ["full"] * 4,
        "rms_norm_eps": 1e-5,
        "bos_token_id": None,
        "eos_token_id": None,
    },
    "glm52": {
        **_TINY_COMMON,
        "architectures": ["GlmMoeDsaForCausalLM"],
        "model_type": "glm_moe_dsa",
        "v_head_dim": 24,
        "n_group": 4,
        "topk_group": 2,
        "rope_parameters": {"rope_theta": 80000.0, "rope_type": "default"},
        "rope_interleave": True,
        "indexer_rope_interleave": True,
        "indexer_types": ["full", "full", "shared", "shared"],
        "rms_norm_eps": 1e-5,
        "bos_token_id": None,
        "eos_token_id": None,
    },
    "dsv32": {
        **_TINY_COMMON,
        "architectures": ["DeepseekV32ForCausalLM"],
        "model_type": "deepseek_v32",
        "v_head_dim": 16,
        "n_routed_experts": 16,
        "num_experts_per_tok": 4,
        "n_group": 4,
        "topk_group": 2,
        "rope_parameters": {
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 64,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
        "rms_norm_eps": 1e-6,
        "bos_token_id": 0,
        "eos_token_id": 1,
    },
}
