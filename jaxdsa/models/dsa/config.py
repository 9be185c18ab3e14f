"""GLM-5.x (``glm_moe_dsa``) and DeepSeek-V3.2 (``deepseek_v32``) configuration.

One frozen (hashable) dataclass covers both; it is passed to jitted functions as a static
argument. Every inconsistency is a :class:`jaxdsa.config.ConfigError` naming the file and field.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from jaxdsa.checkpoints.quant import QuantConfig
from jaxdsa.config import (
    Fields,
    RopeConfig,
    eos_ids,
    parse_quantization,
    parse_rope,
    yarn_mscale,
)

MODEL_TYPES = ("glm_moe_dsa", "deepseek_v32")

# HF transformers builds q_a_layernorm / kv_a_layernorm with its class default eps (1e-6) whatever
# rms_norm_eps says (docs/models.md §8.5); vLLM uses rms_norm_eps. We match HF, the parity oracle.
HF_LATENT_NORM_EPS = 1e-6
INDEXER_K_NORM_EPS = 1e-6


@dataclasses.dataclass(frozen=True)
class DsaConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    n_group: int
    topk_group: int
    routed_scaling_factor: float
    norm_topk_prob: bool
    first_k_dense_replace: int
    rope: RopeConfig
    max_position_embeddings: int
    rms_norm_eps: float
    indexer_rope_interleave: bool
    indexer_types: tuple[str, ...]
    num_nextn_predict_layers: int = 0
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None
    quantization: QuantConfig | None = None

    # ---- derived quantities -------------------------------------------------------------
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Width of one cached latent row: kv_lora_rank + rope (576 for the real models)."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        """qk_head_dim^-0.5, times mscale(factor, mscale_all_dim)^2 for YaRN (HF yarn_apply_mscale)."""
        scale = self.qk_head_dim**-0.5
        if self.rope.type != "default" and self.rope.mscale_all_dim:
            m = yarn_mscale(self.rope.factor, self.rope.mscale_all_dim)
            scale *= m * m
        return scale

    def is_moe_layer(self, layer: int) -> bool:
        return layer >= self.first_k_dense_replace

    def has_indexer(self, layer: int) -> bool:
        """Whether ``layer`` runs its own indexer ('full') or reuses the previous one ('shared').

        The MTP layers (index >= num_hidden_layers) always carry their own indexer.
        """
        return layer >= self.num_hidden_layers or self.indexer_types[layer] == "full"

    @property
    def indexer_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_hidden_layers) if self.has_indexer(i))

    def replace(self, **changes: Any) -> DsaConfig:
        return dataclasses.replace(self, **changes)


def _parse_indexer_types(f: Fields, num_layers: int) -> tuple[str, ...]:
    types = f.raw.get("indexer_types")
    if types is None and f.raw.get("index_topk_pattern") is not None:
        pattern = f.raw["index_topk_pattern"]
        lookup = {"F": "full", "S": "shared"}
        if isinstance(pattern, str):
            if set(pattern) - set(lookup):
                raise f.error("index_topk_pattern", f"only 'F'/'S' allowed, got {pattern!r}")
            types = [lookup[c] for c in pattern]
        else:
            types = list(pattern)
    if types is None:
        freq = max(int(f.raw.get("index_topk_freq", 1)), 1)
        offset = int(f.raw.get("index_skip_topk_offset", 2))
        types = ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(num_layers)]
    types = tuple(types)
    if len(types) < num_layers:
        raise f.error("indexer_types", f"{len(types)} entries for {num_layers} layers")
    types = types[:num_layers]  # entries past the main layers describe MTP layers, which are always full
    if any(t not in ("full", "shared") for t in types):
        raise f.error("indexer_types", f"entries must be 'full' or 'shared', got {sorted(set(types))}")
    if types and types[0] != "full":
        raise f.error("indexer_types", "layer 0 must be 'full': a shared layer reuses an earlier full layer")
    return types


def parse_config(raw: Mapping[str, Any], source: str = "<dict>") -> DsaConfig:
    """Parse an HF ``config.json`` dict; ``source`` names the file in errors."""
    f = Fields(raw, source)
    model_type = f.get("model_type", str)
    if model_type not in MODEL_TYPES:
        raise f.error("model_type", f"unsupported {model_type!r}; jaxdsa runs {', '.join(MODEL_TYPES)}")
    glm = model_type == "glm_moe_dsa"
    g = lambda name, kind=int, default=dataclasses.MISSING, positive=True: f.get(  # noqa: E731
        name, kind, default, positive=positive
    )
    num_layers = g("num_hidden_layers")
    if (act := raw.get("hidden_act", "silu")) != "silu":
        raise f.error("hidden_act", f"only silu is supported, got {act!r}")
    if (scoring := raw.get("scoring_func", "sigmoid")) != "sigmoid":
        raise f.error("scoring_func", f"only sigmoid routing is supported, got {scoring!r}")
    if (method := raw.get("topk_method", "noaux_tc")) != "noaux_tc":
        raise f.error("topk_method", f"only noaux_tc routing is supported, got {method!r}")
    if raw.get("attention_bias"):
        raise f.error("attention_bias", "attention biases are not used by these models")
    if raw.get("q_lora_rank") is None:
        raise f.error("q_lora_rank", "missing: GLM-5.x / DeepSeek-V3.2 always use a q LoRA")
    if glm and raw.get("rope_interleave") is False:
        raise f.error("rope_interleave", "GLM-5.x MLA RoPE is interleaved; false is not supported")

    cfg = DsaConfig(
        model_type=model_type,
        vocab_size=g("vocab_size"),
        hidden_size=g("hidden_size"),
        intermediate_size=g("intermediate_size"),
        moe_intermediate_size=g("moe_intermediate_size"),
        num_hidden_layers=num_layers,
        num_attention_heads=g("num_attention_heads"),
        q_lora_rank=g("q_lora_rank"),
        kv_lora_rank=g("kv_lora_rank"),
        qk_nope_head_dim=g("qk_nope_head_dim"),
        qk_rope_head_dim=g("qk_rope_head_dim"),
        v_head_dim=g("v_head_dim"),
        index_n_heads=g("index_n_heads"),
        index_head_dim=g("index_head_dim"),
        index_topk=g("index_topk"),
        n_routed_experts=g("n_routed_experts"),
        n_shared_experts=g("n_shared_experts", int, 1, positive=False),
        num_experts_per_tok=g("num_experts_per_tok"),
        n_group=g("n_group", int, 1),
        topk_group=g("topk_group", int, 1),
        routed_scaling_factor=g("routed_scaling_factor", float, 1.0),
        norm_topk_prob=f.get("norm_topk_prob", bool, True),
        first_k_dense_replace=g("first_k_dense_replace", int, 0, positive=False),
        rope=parse_rope(f),
        max_position_embeddings=g("max_position_embeddings"),
        rms_norm_eps=g("rms_norm_eps", float, 1e-6),
        # HF 5.23: the GLM indexer is interleaved, DeepSeek-V3.2's is half-split (docs/models.md §8.3).
        indexer_rope_interleave=f.get("indexer_rope_interleave", bool, glm),
        indexer_types=_parse_indexer_types(f, num_layers) if glm else ("full",) * num_layers,
        num_nextn_predict_layers=g("num_nextn_predict_layers", int, 0, positive=False),
        tie_word_embeddings=f.get("tie_word_embeddings", bool, False),
        bos_token_id=f.get("bos_token_id", int, None),
        eos_token_ids=eos_ids(f),
        pad_token_id=f.get("pad_token_id", int, None),
        quantization=parse_quantization(f),
    )
    _check_consistency(cfg, f)
    return cfg


def _check_consistency(c: DsaConfig, f: Fields) -> None:
    if c.n_routed_experts % c.n_group:
        raise f.error("n_group", f"{c.n_routed_experts} experts do not split into {c.n_group} groups")
    if c.n_group > 1 and c.n_routed_experts // c.n_group < 2:
        raise f.error("n_group", "group scores sum the top-2 experts of a group: need >= 2 experts per group")
    if c.topk_group > c.n_group:
        raise f.error("topk_group", f"{c.topk_group} > n_group {c.n_group}")
    if c.num_experts_per_tok > c.n_routed_experts // c.n_group * c.topk_group:
        raise f.error("num_experts_per_tok", "more experts per token than the selected groups hold")
    if c.first_k_dense_replace > c.num_hidden_layers:
        raise f.error("first_k_dense_replace", f"{c.first_k_dense_replace} > num_hidden_layers")
    if c.qk_rope_head_dim % 2:
        raise f.error("qk_rope_head_dim", "must be even (RoPE rotates pairs)")
    if c.index_head_dim < c.qk_rope_head_dim:
        raise f.error("index_head_dim", f"{c.index_head_dim} < qk_rope_head_dim {c.qk_rope_head_dim}")
    for name in ("mlp_layer_types",):
        types = f.raw.get(name)
        if types is not None:
            expected = ["dense"] * c.first_k_dense_replace + ["sparse"] * (
                c.num_hidden_layers - c.first_k_dense_replace
            )
            if list(types)[: c.num_hidden_layers] != expected:
                raise f.error(name, "contradicts first_k_dense_replace (dense layers must come first)")
    nkv = f.raw.get("num_key_value_heads")
    if nkv is not None and nkv != c.num_attention_heads:
        raise f.error("num_key_value_heads", f"{nkv} != num_attention_heads {c.num_attention_heads} (MLA)")
