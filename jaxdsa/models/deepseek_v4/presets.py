"""The released DeepSeek-V4 ``config.json`` files (upstream release form), for the planner and the
real-size benchmarks, where no checkpoint is at hand. Plain data, parsed like any checkpoint's.

The tiny V4 configurations for tests, fixtures and ``make_tiny`` (``V4_TINY_PRESETS``, HF form) and
:func:`~jaxdsa.checkpoints.tiny.presets.release_form` live in :mod:`jaxdsa.checkpoints.tiny.presets`.
"""

from __future__ import annotations

from typing import Any

from jaxdsa.checkpoints.quant import DEEPSEEK_FP8_QUANTIZATION


def _released(**widths: Any) -> dict[str, Any]:
    """A V4 release ``config.json`` (the upstream form) from its widths (docs/models.md §1.1)."""
    common = {
        "architectures": ["DeepseekV4ForCausalLM"],
        "model_type": "deepseek_v4",
        "vocab_size": 129280,
        "num_key_value_heads": 1,
        "head_dim": 512,
        "qk_rope_head_dim": 64,
        "sliding_window": 128,
        "rope_theta": 10000.0,
        "compress_rope_theta": 160000.0,
        "rope_scaling": {
            "beta_fast": 32,
            "beta_slow": 1,
            "factor": 16.0,
            "original_max_position_embeddings": 65536,
            "type": "yarn",
        },
        "index_n_heads": 64,
        "index_head_dim": 128,
        "n_shared_experts": 1,
        "num_experts_per_tok": 6,
        "scoring_func": "sqrtsoftplus",
        "topk_method": "noaux_tc",
        "norm_topk_prob": True,
        "swiglu_limit": 10.0,
        "num_hash_layers": 3,
        "hc_mult": 4,
        "hc_sinkhorn_iters": 20,
        "hc_eps": 1e-6,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 1048576,
        "num_nextn_predict_layers": 1,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
        "attention_bias": False,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "torch_dtype": "bfloat16",
        "expert_dtype": "fp4",
        "quantization_config": dict(DEEPSEEK_FP8_QUANTIZATION),
    }
    return common | widths


# The released models' shapes, for the planner and benchmarks at real size (no weights): the compress
# ratios of every layer and the MTP block's (0) as the release config.json lists them.
RELEASED = {
    "v4-flash": _released(
        hidden_size=4096,
        num_hidden_layers=43,
        num_attention_heads=64,
        q_lora_rank=1024,
        o_groups=8,
        o_lora_rank=1024,
        index_topk=512,
        n_routed_experts=256,
        moe_intermediate_size=2048,
        routed_scaling_factor=1.5,
        compress_ratios=[0, 0] + [4, 128] * 20 + [4, 0],
    ),
    "v4-pro": _released(
        hidden_size=7168,
        num_hidden_layers=61,
        num_attention_heads=128,
        q_lora_rank=1536,
        o_groups=16,
        o_lora_rank=1024,
        index_topk=1024,
        n_routed_experts=384,
        moe_intermediate_size=3072,
        routed_scaling_factor=2.5,
        compress_ratios=[128, 128] + [4, 128] * 29 + [4, 0],
    ),
}
