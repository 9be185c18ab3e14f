"""The released GLM-5.x and DeepSeek-V3.2 ``config.json`` files, for the planner and
the real-size benchmarks, where no checkpoint is at hand. Plain data, parsed like any checkpoint's.

GLM-5 / GLM-5.1 / GLM-5.2 ship in BF16 (``zai-org/GLM-5``), FP8 (``zai-org/GLM-5-FP8``) and, from the
community, compressed-tensors INT4; these are the BF16 configs (no ``quantization_config``), so a
format is chosen with the planner's ``--weights``. DeepSeek-V3.2 ships FP8 only: its config carries
the FP8 block scheme.
"""

from __future__ import annotations

from typing import Any

from jaxdsa.checkpoints.quant import DEEPSEEK_FP8_QUANTIZATION

GLM5: dict[str, Any] = {
    "architectures": ["GlmMoeDsaForCausalLM"],
    "model_type": "glm_moe_dsa",
    "vocab_size": 154880,
    "hidden_size": 6144,
    "intermediate_size": 12288,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": 78,
    "first_k_dense_replace": 3,
    "num_attention_heads": 64,
    "num_key_value_heads": 64,
    "q_lora_rank": 2048,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 192,
    "qk_rope_head_dim": 64,
    "v_head_dim": 256,
    "index_n_heads": 32,
    "index_head_dim": 128,
    "index_topk": 2048,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "num_experts_per_tok": 8,
    "n_group": 1,
    "topk_group": 1,
    "routed_scaling_factor": 2.5,
    "norm_topk_prob": True,
    "scoring_func": "sigmoid",
    "topk_method": "noaux_tc",
    "rope_parameters": {"rope_theta": 1000000.0, "rope_type": "default"},
    "rope_interleave": True,
    "indexer_rope_interleave": True,
    "max_position_embeddings": 202752,
    "rms_norm_eps": 1e-5,
    "num_nextn_predict_layers": 1,
    "tie_word_embeddings": False,
    "hidden_act": "silu",
    "attention_bias": False,
    "torch_dtype": "bfloat16",
}

# GLM-5.2's deltas: same widths; 3 of every 4 layers reuse an earlier layer's indexer choice.
GLM52: dict[str, Any] = {
    **GLM5,
    "rope_parameters": {"rope_theta": 8000000.0, "rope_type": "default"},
    "max_position_embeddings": 1048576,
    "moe_router_dtype": "float32",
    "index_topk_freq": 4,
    "index_skip_topk_offset": 3,
}

DSV32: dict[str, Any] = {
    "architectures": ["DeepseekV32ForCausalLM"],
    "model_type": "deepseek_v32",
    "vocab_size": 129280,
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": 61,
    "first_k_dense_replace": 3,
    "num_attention_heads": 128,
    "num_key_value_heads": 128,
    "q_lora_rank": 1536,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "index_n_heads": 64,
    "index_head_dim": 128,
    "index_topk": 2048,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "num_experts_per_tok": 8,
    "n_group": 8,
    "topk_group": 4,
    "routed_scaling_factor": 2.5,
    "norm_topk_prob": True,
    "scoring_func": "sigmoid",
    "topk_method": "noaux_tc",
    "rope_parameters": {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 40.0,
        "original_max_position_embeddings": 4096,
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
    },
    "max_position_embeddings": 163840,
    "rms_norm_eps": 1e-6,
    "num_nextn_predict_layers": 1,
    "tie_word_embeddings": False,
    "hidden_act": "silu",
    "attention_bias": False,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "torch_dtype": "bfloat16",
    "quantization_config": dict(DEEPSEEK_FP8_QUANTIZATION),
}

RELEASED: dict[str, dict[str, Any]] = {"glm5": GLM5, "glm52": GLM52, "dsv32": DSV32}
