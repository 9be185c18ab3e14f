"""The released GLM-5.3-Flash ``config.json`` (HF's serialized form), for the planner, where no
checkpoint is at hand. Plain data, parsed like any checkpoint's (docs/models.md §9.1).

The values are ``Glm5NextTextConfig``'s defaults, which HF's docstring ties to ``zai-org/GLM-5.3-Flash``
(:data:`~jaxdsa.models.glm5_next.config.HF_TEXT_DEFAULTS`), written out: 45 layers, 34 KDA (64 heads x
128) and 11 NoPE DSA (every fourth, each with its own indexer), hc_mult 4, 288 routed experts top-8 + 1
shared, the first 3 FFNs dense; BF16 (no ``quantization_config``). The release file itself was not read
here (docs/models.md §9.11): public tools report ``index_kpool`` 4 for it where HF's default is 16, which
would add 528 B a token of index keys (11 layers x 256 B / 4 instead of / 16) to about 11.4 KB.
"""

from __future__ import annotations

from typing import Any

from jaxdsa.models.glm5_next.config import DENSE, DSA, FULL, HF_DENSE_LAYERS, HF_DSA_EVERY, KDA, SPARSE

_LAYERS = 45

GLM53_FLASH: dict[str, Any] = {
    "architectures": ["Glm5NextForConditionalGeneration"],
    "model_type": "glm5_next",
    "tie_word_embeddings": False,
    "text_config": {
        "model_type": "glm5_next_text",
        "vocab_size": 154880,
        "hidden_size": 4096,
        "num_hidden_layers": _LAYERS,
        "layer_types": [DSA if i % HF_DSA_EVERY == HF_DSA_EVERY - 1 else KDA for i in range(_LAYERS)],
        "indexer_types": [FULL] * _LAYERS,
        "mlp_layer_types": [DENSE] * HF_DENSE_LAYERS + [SPARSE] * (_LAYERS - HF_DENSE_LAYERS),
        "linear_num_heads": 64,
        "linear_head_dim": 128,
        "linear_conv_kernel_dim": 4,
        "linear_lower_bound": -5.0,
        "num_attention_heads": 64,
        "num_key_value_heads": 64,
        "q_lora_rank": 1536,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 256,
        "qk_rope_head_dim": 0,
        "v_head_dim": 256,
        "index_n_heads": 32,
        "index_head_dim": 128,
        "index_topk": 2048,
        "index_kpool": 16,
        "index_kpool_always_select_tail": True,
        "hc_mult": 4,
        "hc_eps": 1e-6,
        "hc_sinkhorn_iters": 20,
        "intermediate_size": 12288,
        "moe_intermediate_size": 2048,
        "n_routed_experts": 288,
        "n_shared_experts": 1,
        "num_experts_per_tok": 8,
        "n_group": 1,
        "topk_group": 1,
        "routed_scaling_factor": 2.5,
        "norm_topk_prob": True,
        "swiglu_limit": 10.0,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 1048576,
        "pad_token_id": 154820,
        "dtype": "bfloat16",
    },
}

RELEASED: dict[str, dict[str, Any]] = {"glm53-flash": GLM53_FLASH}
