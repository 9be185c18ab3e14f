"""Model configuration parsed from a Hugging Face ``config.json``.

One frozen (hashable) dataclass covers GLM-5.x (``glm_moe_dsa``) and DeepSeek-V3.2
(``deepseek_v32``); it is passed to jitted functions as a static argument. Every
inconsistency is reported as a :class:`ConfigError` that names the file and the field,
so a bad checkpoint directory fails before any weight is read.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from collections.abc import Mapping
from typing import Any

SUPPORTED_MODEL_TYPES = ("glm_moe_dsa", "deepseek_v32")

# HF transformers builds q_a_layernorm / kv_a_layernorm with its class default eps (1e-6) whatever
# rms_norm_eps says (models.md §8.5); vLLM uses rms_norm_eps. We match HF, the parity oracle.
HF_LATENT_NORM_EPS = 1e-6
INDEXER_K_NORM_EPS = 1e-6


class ConfigError(ValueError):
    """A config.json that jaxdsa cannot run: unknown model type, missing or contradictory field."""

    def __init__(self, source: str, field: str, message: str):
        self.source, self.field = source, field
        super().__init__(f"{source}: field '{field}': {message}")


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    """RoPE frequencies; ``type`` is 'default' or 'yarn' (HF ``rope_parameters`` semantics)."""

    theta: float
    type: str = "default"
    factor: float = 1.0
    original_max_position_embeddings: int | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True


@dataclasses.dataclass(frozen=True)
class QuantConfig:
    """Weight quantization of the checkpoint files (dequantized at load)."""

    method: str  # "fp8" (block-scaled e4m3) or "compressed-tensors" (pack-quantized int)
    weight_block_size: tuple[int, int] = (128, 128)
    num_bits: int = 4
    group_size: int = 32
    symmetric: bool = False
    ignore: tuple[str, ...] = ()
    targets: tuple[str, ...] = ("Linear",)  # compressed-tensors config_groups targets

    def quantizes(self, module: str) -> bool:
        """Whether the Linear layer ``module`` (HF name without ``.weight``) is stored quantized:
        compressed-tensors matches a target or ignore entry when it equals the module name, is the
        class name ``Linear``, or is ``re:<pattern>`` with ``re.match`` (a prefix match) on the name."""
        if self.method != "compressed-tensors":
            return True
        hit = (
            lambda entry: (  # noqa: E731
                entry == "Linear"
                or entry == module
                or (entry.startswith("re:") and re.match(entry[3:], module))
            )
        )
        return any(map(hit, self.targets)) and not any(map(hit, self.ignore))


@dataclasses.dataclass(frozen=True)
class ModelConfig:
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
            m = _yarn_mscale(self.rope.factor, self.rope.mscale_all_dim)
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

    def replace(self, **changes: Any) -> ModelConfig:
        return dataclasses.replace(self, **changes)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_attention_factor(rope: RopeConfig) -> float:
    """The factor HF multiplies cos/sin with for YaRN (1.0 for default RoPE)."""
    if rope.type == "default":
        return 1.0
    if rope.attention_factor is not None:
        return rope.attention_factor
    if rope.mscale and rope.mscale_all_dim:
        return _yarn_mscale(rope.factor, rope.mscale) / _yarn_mscale(rope.factor, rope.mscale_all_dim)
    return _yarn_mscale(rope.factor)


# ---------------------------------------------------------------------------------------------
# Parsing


class _Fields:
    """Typed access to a config dict; every problem names the file and the field."""

    def __init__(self, raw: Mapping[str, Any], source: str):
        self.raw, self.source = raw, source

    def error(self, field: str, message: str) -> ConfigError:
        return ConfigError(self.source, field, message)

    def get(self, field: str, kind: type, default: Any = dataclasses.MISSING, *, positive: bool = False):
        if field not in self.raw or self.raw[field] is None:
            if default is dataclasses.MISSING:
                raise self.error(field, "missing (required)")
            return default
        value = self.raw[field]
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if kind is int and isinstance(value, float) and value.is_integer():
            value = int(value)
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise self.error(field, f"expected {kind.__name__}, got {type(value).__name__} {value!r}")
        if positive and value <= 0:
            raise self.error(field, f"must be > 0, got {value!r}")
        return value


def _parse_rope(f: _Fields) -> RopeConfig:
    # transformers v5 writes `rope_parameters` (theta inside); older configs use rope_theta + rope_scaling.
    params = f.raw.get("rope_parameters") or {}
    scaling = f.raw.get("rope_scaling") or {}
    for name, value in (("rope_parameters", params), ("rope_scaling", scaling)):
        if not isinstance(value, dict):
            raise f.error(name, f"expected an object, got {type(value).__name__}")
    merged = {**scaling, **params}
    field = "rope_parameters" if params else "rope_scaling"
    theta = merged.get("rope_theta", f.raw.get("rope_theta"))
    if theta is None:
        raise f.error("rope_theta", "missing (neither rope_theta nor rope_parameters.rope_theta is set)")
    kind = merged.get("rope_type", merged.get("type", "default"))
    if kind not in ("default", "yarn"):
        raise f.error(f"{field}.rope_type", f"unsupported RoPE type {kind!r} (default or yarn)")
    if kind == "default":
        return RopeConfig(theta=float(theta))
    if "factor" not in merged:
        raise f.error(f"{field}.factor", "missing for yarn")
    orig = merged.get("original_max_position_embeddings", f.raw.get("max_position_embeddings"))
    return RopeConfig(
        theta=float(theta),
        type="yarn",
        factor=float(merged["factor"]),
        original_max_position_embeddings=int(orig),
        beta_fast=float(merged.get("beta_fast") or 32),
        beta_slow=float(merged.get("beta_slow") or 1),
        mscale=merged.get("mscale"),
        mscale_all_dim=merged.get("mscale_all_dim"),
        attention_factor=merged.get("attention_factor"),
        truncate=bool(merged.get("truncate", True)),
    )


def _parse_indexer_types(f: _Fields, num_layers: int) -> tuple[str, ...]:
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


def _parse_quantization(f: _Fields) -> QuantConfig | None:
    q = f.raw.get("quantization_config")
    if q is None:
        return None
    if not isinstance(q, dict):
        raise f.error("quantization_config", "expected an object")
    method = q.get("quant_method")
    if method == "fp8":
        block = tuple(q.get("weight_block_size") or (128, 128))
        if len(block) != 2 or any(int(b) <= 0 for b in block):
            raise f.error("quantization_config.weight_block_size", f"expected two positive ints, got {block}")
        fmt = q.get("fmt", "e4m3")
        if fmt != "e4m3":
            raise f.error("quantization_config.fmt", f"only e4m3 fp8 checkpoints are supported, got {fmt!r}")
        return QuantConfig(method="fp8", weight_block_size=(int(block[0]), int(block[1])))
    if method == "compressed-tensors":
        fmt = q.get("format")
        if fmt != "pack-quantized":
            raise f.error("quantization_config.format", f"only 'pack-quantized' is supported, got {fmt!r}")
        groups = q.get("config_groups") or {}
        if len(groups) != 1:
            raise f.error(
                "quantization_config.config_groups", f"expected exactly one group, got {len(groups)}"
            )
        (group,) = groups.values()
        weights = group.get("weights") or {}
        bits, strategy = weights.get("num_bits"), weights.get("strategy", "group")
        if bits != 4 or weights.get("type", "int") != "int":
            raise f.error(
                "quantization_config.config_groups.weights", f"only 4-bit int weights, got {weights}"
            )
        if strategy != "group" or not weights.get("group_size"):
            raise f.error(
                "quantization_config.config_groups.weights.group_size", "group strategy with a size"
            )
        targets = group.get("targets") or ["Linear"]
        if not isinstance(targets, list) or not all(isinstance(t, str) for t in targets):
            raise f.error(
                "quantization_config.config_groups.targets", f"expected a list of strings, got {targets}"
            )
        return QuantConfig(
            method="compressed-tensors",
            num_bits=4,
            group_size=int(weights["group_size"]),
            symmetric=bool(weights.get("symmetric", True)),
            ignore=tuple(q.get("ignore") or ()),
            targets=tuple(targets),
        )
    raise f.error("quantization_config.quant_method", f"unsupported {method!r} (fp8 or compressed-tensors)")


def _eos_ids(f: _Fields) -> tuple[int, ...]:
    eos = f.raw.get("eos_token_id")
    if eos is None:
        return ()
    eos = eos if isinstance(eos, list) else [eos]
    if not all(isinstance(e, int) for e in eos):
        raise f.error("eos_token_id", f"expected int or list of ints, got {eos!r}")
    return tuple(eos)


def config_from_dict(raw: Mapping[str, Any], source: str = "<dict>") -> ModelConfig:
    """Parse an HF ``config.json`` dict; ``source`` names the file in errors."""
    f = _Fields(raw, source)
    model_type = f.get("model_type", str)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise f.error(
            "model_type", f"unsupported {model_type!r}; jaxdsa runs {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
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

    cfg = ModelConfig(
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
        rope=_parse_rope(f),
        max_position_embeddings=g("max_position_embeddings"),
        rms_norm_eps=g("rms_norm_eps", float, 1e-6),
        # HF 5.23: the GLM indexer is interleaved, DeepSeek-V3.2's is half-split (models.md §8.3).
        indexer_rope_interleave=f.get("indexer_rope_interleave", bool, glm),
        indexer_types=_parse_indexer_types(f, num_layers) if glm else ("full",) * num_layers,
        num_nextn_predict_layers=g("num_nextn_predict_layers", int, 0, positive=False),
        tie_word_embeddings=f.get("tie_word_embeddings", bool, False),
        bos_token_id=f.get("bos_token_id", int, None),
        eos_token_ids=_eos_ids(f),
        pad_token_id=f.get("pad_token_id", int, None),
        quantization=_parse_quantization(f),
    )
    _check_consistency(cfg, f)
    return cfg


def _check_consistency(c: ModelConfig, f: _Fields) -> None:
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


def load_config(path: str | os.PathLike) -> ModelConfig:
    """Read ``config.json`` from a checkpoint directory (or the file itself)."""
    path = os.fspath(path)
    file = os.path.join(path, "config.json") if os.path.isdir(path) else path
    try:
        with open(file, encoding="utf-8") as fh:
            raw = json.load(fh)
    except FileNotFoundError:
        raise ConfigError(file, "config.json", "file not found") from None
    except json.JSONDecodeError as e:
        raise ConfigError(file, "config.json", f"invalid JSON: {e}") from None
    if not isinstance(raw, dict):
        raise ConfigError(file, "config.json", "top level must be an object")
    return config_from_dict(raw, file)


# ---------------------------------------------------------------------------------------------
# Named tiny presets (HF config.json form) for tests and the bundled demo model.

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
    # >= 16 indexer heads so that ReLU zeros do not create top-k ties (models.md §8.13).
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


def tiny_config(name: str, **overrides: Any) -> ModelConfig:
    """A named tiny preset ('glm5', 'glm52', 'dsv32') with optional field overrides."""
    if name not in TINY_PRESETS:
        raise KeyError(f"unknown tiny preset {name!r}; choose from {sorted(TINY_PRESETS)}")
    return config_from_dict({**TINY_PRESETS[name], **overrides}, f"<tiny:{name}>")
