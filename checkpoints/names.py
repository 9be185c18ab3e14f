"""Declarative map from jaxdsa's params pytree to Hugging Face tensor names (models.md §4.1, §4.2).

Each leaf says which HF tensor feeds it, the shape the file must have, and how the
float32 [out, in] matrix becomes our layout ([in, out], heads split out). The loader walks this
tree; nothing else in the project knows HF names.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

from jaxdsa.config import ModelConfig


def transpose(w: np.ndarray) -> np.ndarray:
    return w.T


def transpose_split(*dims: int) -> Callable[[np.ndarray], np.ndarray]:
    """[out, in] -> [in, *dims] where prod(dims) == out (e.g. q_b -> [q_lora, H, qk])."""
    return lambda w: w.T.reshape((w.shape[1],) + dims)


def heads_rows(heads: int, per_head: int, start: int, stop: int) -> Callable[[np.ndarray], np.ndarray]:
    """[heads*per_head, in] -> rows [start, stop) of every head: [heads, stop-start, in] (kv_b split)."""
    return lambda w: w.reshape(heads, per_head, w.shape[1])[:, start:stop]


@dataclasses.dataclass(frozen=True)
class Linear:
    """An HF linear weight ``{name}.weight`` of shape [out, in] (plain, FP8-block or INT4-packed)."""

    name: str
    out: int
    inp: int
    post: Callable[[np.ndarray], np.ndarray] = transpose
    keep_fp32: bool = False


@dataclasses.dataclass(frozen=True)
class Tensor:
    """An unquantized tensor stored as is (norm weights, biases, embeddings)."""

    name: str
    shape: tuple[int, ...]
    keep_fp32: bool = False


@dataclasses.dataclass(frozen=True)
class Experts:
    """Routed experts ``{prefix}.{e}.{gate,up,down}_proj.weight`` stacked and packed for ops.moe_experts."""

    prefix: str
    num: int
    inter: int
    hidden: int


def attention_map(cfg: ModelConfig, layer: int) -> dict:
    p = f"model.layers.{layer}.self_attn."
    D, H, r = cfg.hidden_size, cfg.num_attention_heads, cfg.kv_lora_rank
    nope, v, qk = cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.qk_head_dim
    tree = {
        "q_a": Linear(p + "q_a_proj", cfg.q_lora_rank, D),
        "q_a_norm": Tensor(p + "q_a_layernorm.weight", (cfg.q_lora_rank,)),
        "q_b": Linear(p + "q_b_proj", H * qk, cfg.q_lora_rank, transpose_split(H, qk)),
        "kv_a": Linear(p + "kv_a_proj_with_mqa", cfg.latent_dim, D),
        "kv_a_norm": Tensor(p + "kv_a_layernorm.weight", (r,)),
        # kv_b is split at load into the absorbed-MLA factors W_UK [H, nope, r] and W_UV [H, v, r].
        "w_uk": Linear(p + "kv_b_proj", H * (nope + v), r, heads_rows(H, nope + v, 0, nope)),
        "w_uv": Linear(p + "kv_b_proj", H * (nope + v), r, heads_rows(H, nope + v, nope, nope + v)),
        "o": Linear(p + "o_proj", D, H * v, lambda w: w.T.reshape(H, v, D)),
    }
    if cfg.has_indexer(layer):
        n, d = cfg.index_n_heads, cfg.index_head_dim
        tree["indexer"] = {
            "wq_b": Linear(p + "indexer.wq_b", n * d, cfg.q_lora_rank, transpose_split(n, d)),
            "wk": Linear(p + "indexer.wk", d, D),
            "k_norm_w": Tensor(p + "indexer.k_norm.weight", (d,)),
            "k_norm_b": Tensor(p + "indexer.k_norm.bias", (d,)),
            "weights_proj": Linear(p + "indexer.weights_proj", n, D, keep_fp32=True),
        }
    return tree


def _swiglu_map(prefix: str, hidden: int, inter: int) -> dict:
    return {
        "gate": Linear(prefix + "gate_proj", inter, hidden),
        "up": Linear(prefix + "up_proj", inter, hidden),
        "down": Linear(prefix + "down_proj", hidden, inter),
    }


def layer_map(cfg: ModelConfig, layer: int) -> dict:
    p = f"model.layers.{layer}."
    D = cfg.hidden_size
    tree = {
        "input_norm": Tensor(p + "input_layernorm.weight", (D,)),
        "post_attn_norm": Tensor(p + "post_attention_layernorm.weight", (D,)),
        "attn": attention_map(cfg, layer),
    }
    if cfg.is_moe_layer(layer):
        E, N = cfg.n_routed_experts, cfg.moe_intermediate_size
        tree["moe"] = {
            "router": Linear(p + "mlp.gate", E, D),
            "bias": Tensor(p + "mlp.gate.e_score_correction_bias", (E,), keep_fp32=True),
            "experts": Experts(p + "mlp.experts", E, N, D),
            "shared": _swiglu_map(p + "mlp.shared_experts.", D, N * cfg.n_shared_experts),
        }
    else:
        tree["mlp"] = _swiglu_map(p + "mlp.", D, cfg.intermediate_size)
    return tree


def mtp_map(cfg: ModelConfig, layer: int) -> dict:
    """A next-n layer: a full decoder layer plus the MTP input/output norms and projection."""
    p = f"model.layers.{layer}."
    D = cfg.hidden_size
    return {
        **layer_map(cfg, layer),
        "enorm": Tensor(p + "enorm.weight", (D,)),
        "hnorm": Tensor(p + "hnorm.weight", (D,)),
        "eh_proj": Linear(p + "eh_proj", D, 2 * D),
        "shared_head_norm": Tensor(p + "shared_head.norm.weight", (D,)),
    }


def mtp_marker(layer: int) -> str:
    """A tensor whose presence says the checkpoint ships next-n layer ``layer``."""
    return f"model.layers.{layer}.eh_proj.weight"


def model_map(cfg: ModelConfig) -> dict:
    """Everything but the layers (the loader walks the layers one at a time for progress)."""
    V, D = cfg.vocab_size, cfg.hidden_size
    tree = {
        "embed": Tensor("model.embed_tokens.weight", (V, D)),
        "norm": Tensor("model.norm.weight", (D,)),
    }
    if not cfg.tie_word_embeddings:
        tree["lm_head"] = Linear("lm_head", V, D)
    return tree
