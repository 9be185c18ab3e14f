"""Tiny model configurations (HF ``config.json`` form) for tests, the bundled demo model and the
tiny checkpoints of :mod:`jaxdsa.checkpoints.tiny`. Plain data: families parse them like any
checkpoint's config.

Standard library only on purpose: the Hugging Face reference scripts (``tests/reference/make_goldens.py``
and ``make_goldens_v4.py``) run in a Python 3.11 venv without JAX and load this file by path.
``TINY_PRESETS`` are the MLA + DSA models (GLM-5.x, DeepSeek-V3.2); ``V4_TINY_PRESETS`` the
DeepSeek-V4 ones, in HF's serialized form (what ``DeepseekV4Config.save_pretrained`` writes), which
:func:`release_form` turns into the upstream release form (``compress_ratios``, ``num_hash_layers``,
``rope_scaling``, ``qk_rope_head_dim``) that DeepSeek's checkpoints ship. ``GLM5_NEXT_TINY_PRESETS``
are GLM-5.3-Flash (``glm5_next``) in HF's serialized form: ``text_config`` and ``vision_config``
nested, as ``Glm5NextConfig.save_pretrained`` writes them.
"""

from __future__ import annotations

import copy
from typing import Any

# The preset ``make_tiny`` writes for a family when none is named.
DEFAULT_PRESET = {
    "glm_moe_dsa": "glm5",
    "deepseek_v32": "dsv32",
    "deepseek_v4": "dsv4",
    "glm5_next": "glm53",
}

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

# DeepSeek-V4, in HF's serialized form (release_form below gives the upstream config.json).

CSA, HCA, SWA = "compressed_sparse_attention", "heavily_compressed_attention", "sliding_attention"

# One layer of every attention type plus a second CSA layer, two hash-routed layers (one of them
# on a CSA layer, as in V4-Flash), an HCA ratio of 8 so that a 61-token prompt crosses seven
# HCA and fifteen CSA window boundaries, a window of 8, 16 indexer heads (ReLU ties, docs/models.md
# §8.13) and index_topk 5 < the 15 CSA entries of that prompt. swiglu_limit 1.5 makes the SwiGLU
# clamp fire with unit-scale activations (the released 10.0 never would here). Head dims are chosen
# so that the partial rotary factor 8 / 32 is exact in floating point.
V4_TINY_PRESETS: dict[str, dict[str, Any]] = {
    "dsv4": {
        "architectures": ["DeepseekV4ForCausalLM"],
        "model_type": "deepseek_v4",
        "vocab_size": 128,
        "hidden_size": 32,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 32,
        "partial_rotary_factor": 0.25,
        "q_lora_rank": 40,
        "o_groups": 2,
        "o_lora_rank": 16,
        "sliding_window": 8,
        "layer_types": [SWA, CSA, HCA, CSA],
        "compress_rates": {CSA: 4, HCA: 8},
        "mlp_layer_types": ["hash_moe", "hash_moe", "moe", "moe"],
        "rope_theta": 10000.0,
        "compress_rope_theta": 160000.0,
        "rope_parameters": {
            "main": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
            "compress": {
                "rope_type": "yarn",
                "rope_theta": 160000.0,
                "factor": 8.0,
                "original_max_position_embeddings": 32,
                "beta_fast": 32,
                "beta_slow": 1,
                "attention_factor": 1.0,
                "partial_rotary_factor": 0.25,
            },
        },
        "index_n_heads": 16,
        "index_head_dim": 16,
        "index_topk": 5,
        "n_routed_experts": 8,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "scoring_func": "sqrtsoftplus",
        "routed_scaling_factor": 1.5,
        "norm_topk_prob": True,
        "swiglu_limit": 1.5,
        "hc_mult": 4,
        "hc_sinkhorn_iters": 20,
        "hc_eps": 1e-6,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 256,
        "num_nextn_predict_layers": 1,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
        "attention_bias": False,
        "bos_token_id": 0,
        "eos_token_id": 1,
    },
}

# The MTP block's attention type in the release form (the extra compress_ratios entry): V4-Flash
# and V4-Pro both ship 0, a sliding-window-only block.
MTP_COMPRESS_RATIO = 0


def release_form(hf: dict[str, Any], *, mtp_compress_ratio: int = MTP_COMPRESS_RATIO) -> dict[str, Any]:
    """The upstream release ``config.json`` for an HF-form config dict (keys as V4-Flash ships them)."""
    hf = copy.deepcopy(hf)
    rates = hf["compress_rates"]
    ratios = [0 if t == SWA else rates[t] for t in hf["layer_types"]]
    ratios += [mtp_compress_ratio] * hf["num_nextn_predict_layers"]
    compress = hf["rope_parameters"]["compress"]
    out = {k: v for k, v in hf.items() if k not in _HF_ONLY_KEYS}
    out |= {
        "num_hash_layers": hf["mlp_layer_types"].count("hash_moe"),
        "qk_rope_head_dim": int(hf["head_dim"] * hf["partial_rotary_factor"]),
        "rope_theta": hf["rope_parameters"]["main"]["rope_theta"],
        "compress_rope_theta": compress["rope_theta"],
        "rope_scaling": {
            "beta_fast": compress["beta_fast"],
            "beta_slow": compress["beta_slow"],
            "factor": compress["factor"],
            "original_max_position_embeddings": compress["original_max_position_embeddings"],
            "type": "yarn",
        },
        "topk_method": "noaux_tc",
        "compress_ratios": ratios,
    }
    return out


_HF_ONLY_KEYS = (
    "layer_types",
    "compress_rates",
    "mlp_layer_types",
    "rope_parameters",
    "partial_rotary_factor",
)

# GLM-5.3-Flash (glm5_next), in HF's serialized form.

KDA, DSA = "linear_attention", "indexed_attention"

# Every layer kind of the model: KDA layers with a dense and with a MoE FFN, DSA layers with their own
# indexer (dense and MoE FFN) and one "shared" DSA layer (right after a full one: HF reuses only the
# previous layer's top-k). 16 indexer heads (ReLU ties, docs/models.md §8.13); key pools of 4 tokens
# and index_topk 8 (two pools) so that prompts cross many pool boundaries and attention is sparse
# from 12 tokens on. The KDA width 4 x 32 differs from hidden_size, MLA's nope 32 from v 24, so that
# a transposed weight shows in its shape. swiglu_limit 1.5 makes the SwiGLU clamp fire with
# unit-scale activations; n_group 4 exercises group routing (the release has one group). No MTP
# layer: HF defines no next-n weights for this model (docs/models.md §9.11). pad_token_id is the
# GLM tokenizer's <|endoftext|> (HF's default 154820 lies outside a 512-token vocabulary).
GLM5_NEXT_TINY_PRESETS: dict[str, dict[str, Any]] = {
    "glm53": {
        "architectures": ["Glm5NextForConditionalGeneration"],
        "model_type": "glm5_next",
        "tie_word_embeddings": False,
        "text_config": {
            "model_type": "glm5_next_text",
            "vocab_size": 512,
            "hidden_size": 64,
            "intermediate_size": 128,
            "moe_intermediate_size": 32,
            "num_hidden_layers": 8,
            "layer_types": [KDA, DSA, DSA, KDA, KDA, DSA, KDA, DSA],
            "indexer_types": ["full", "full", "shared", "full", "full", "full", "full", "full"],
            "mlp_layer_types": ["dense", "dense"] + ["sparse"] * 6,
            "linear_num_heads": 4,
            "linear_head_dim": 32,
            "linear_conv_kernel_dim": 4,
            "linear_lower_bound": -5.0,
            "num_attention_heads": 4,
            "num_key_value_heads": 4,
            "q_lora_rank": 32,
            "kv_lora_rank": 128,
            "qk_nope_head_dim": 32,
            "qk_rope_head_dim": 0,
            "v_head_dim": 24,
            "index_n_heads": 16,
            "index_head_dim": 32,
            "index_topk": 8,
            "index_kpool": 4,
            "index_kpool_always_select_tail": True,
            "hc_mult": 4,
            "hc_sinkhorn_iters": 20,
            "hc_eps": 1e-6,
            "n_routed_experts": 8,
            "n_shared_experts": 1,
            "num_experts_per_tok": 2,
            "n_group": 4,
            "topk_group": 2,
            "routed_scaling_factor": 2.5,
            "norm_topk_prob": True,
            "swiglu_limit": 1.5,
            "hidden_act": "silu",
            "rms_norm_eps": 1e-5,
            "max_position_embeddings": 256,
            "attention_bias": False,
            "tie_word_embeddings": False,
            "pad_token_id": 492,
            "bos_token_id": None,
            "eos_token_id": None,
        },
        "vision_config": {
            "model_type": "glm5_next_vision",
            "depth": 2,
            "hidden_size": 32,
            "num_heads": 2,
            "intermediate_size": 64,
            "out_hidden_size": 64,  # the text model's hidden_size: merged patches replace token embeddings
            "projection_intermediate_size": 48,
            "patch_size": 14,
            "temporal_patch_size": 2,
            "spatial_merge_size": 2,
            "in_channels": 3,
            "hidden_act": "silu",
            "attention_bias": True,
            "rms_norm_eps": 1e-5,
            "swiglu_limit": 10.0,
            "rope_parameters": {"rope_type": "axial", "rope_theta": 10000.0},
        },
    },
}
