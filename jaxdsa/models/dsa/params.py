"""Where every parameter of :class:`DsaModel` comes from in an HF checkpoint (docs/models.md §4.1, §4.2).

:func:`param_spec` maps each parameter path of the model's state to a :mod:`jaxdsa.checkpoints.spec`
leaf: the HF tensor that feeds it, the shape the file must have, and the view from HF's
``[out, in]`` to our layout (``[in, out]``, heads split out, ``kv_b`` split into the absorbed-MLA
factors). Stacked (scanned) parameters list one source per layer. The loader, the dummy weights
and the planner all read this one table.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from jaxdsa.checkpoints.spec import (
    ExpertDown,
    ExpertGateUp,
    Leaf,
    Linear,
    Spec,
    Tensor,
    as_stored,
    head_part,
    transpose_merge,
    transpose_split,
)
from jaxdsa.models.dsa.config import DsaConfig
from jaxdsa.models.dsa.model import DsaModel
from jaxdsa.models.layer_groups import group_specs

if TYPE_CHECKING:
    from jaxdsa.models.glm5_next.config import Glm5NextConfig

Path = tuple


def mlp_tensors(prefix: str, hidden: int, inter: int) -> dict[Path, Leaf]:
    return {
        ("gate", "weight"): Linear(prefix + "gate_proj", inter, hidden),
        ("up", "weight"): Linear(prefix + "up_proj", inter, hidden),
        ("down", "weight"): Linear(prefix + "down_proj", hidden, inter),
    }


def nest(prefix: Path, tree: dict[Path, Leaf]) -> dict[Path, Leaf]:
    return {prefix + path: leaf for path, leaf in tree.items()}


def mla_tensors(cfg: DsaConfig | Glm5NextConfig, a: str) -> dict[Path, Leaf]:
    """MLA's tensors under ``a`` (``...self_attn.``): shared by GLM-5.x / DeepSeek-V3.2 and GLM-5.3-Flash,
    whose MLA differs only in a RoPE part of 0 (``qk_rope_head_dim``)."""
    D, H, r = cfg.hidden_size, cfg.num_attention_heads, cfg.kv_lora_rank
    nope, v, qk = cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.qk_head_dim
    return {
        ("q_a", "weight"): Linear(a + "q_a_proj", cfg.q_lora_rank, D),
        ("q_a_norm", "weight"): Tensor(a + "q_a_layernorm.weight", (cfg.q_lora_rank,)),
        ("q_b", "weight"): Linear(a + "q_b_proj", H * qk, cfg.q_lora_rank, transpose_split(H, qk), pad=True),
        ("kv_a", "weight"): Linear(a + "kv_a_proj_with_mqa", r + cfg.qk_rope_head_dim, D),
        ("kv_a_norm", "weight"): Tensor(a + "kv_a_layernorm.weight", (r,)),
        ("w_uk", "weight"): head_part(a + "kv_b_proj", H, nope + v, 0, nope, r),
        ("w_uv", "weight"): head_part(a + "kv_b_proj", H, nope + v, nope, nope + v, r),
        ("o", "weight"): Linear(a + "o_proj", D, H * v, transpose_merge(H, v), pad=True),
    }


def indexer_tensors(cfg: DsaConfig | Glm5NextConfig, i: str) -> dict[Path, Leaf]:
    """The DSA indexer's tensors under ``i`` (``...indexer.``): the rows both indexers have
    (GLM-5.3-Flash's pooled one adds its pool's own)."""
    n, d, D = cfg.index_n_heads, cfg.index_head_dim, cfg.hidden_size
    return {
        ("wq_b", "weight"): Linear(i + "wq_b", n * d, cfg.q_lora_rank, transpose_split(n, d), pad=True),
        ("wk", "weight"): Linear(i + "wk", d, D),
        ("k_norm", "weight"): Tensor(i + "k_norm.weight", (d,)),
        ("k_norm", "bias"): Tensor(i + "k_norm.bias", (d,), init="bias"),
        ("weights_proj", "weight"): Linear(i + "weights_proj", n, D, pad=True),
    }


def layer_spec(cfg: DsaConfig, layer: int) -> dict[Path, Leaf]:
    """Sources of one :class:`DecoderLayer`'s parameters (paths relative to the layer)."""
    p = f"model.layers.{layer}."
    a = p + "self_attn."
    D = cfg.hidden_size
    attn = mla_tensors(cfg, a)
    if cfg.has_indexer(layer):
        attn |= nest(("indexer",), indexer_tensors(cfg, a + "indexer."))
    tree = {
        ("input_norm", "weight"): Tensor(p + "input_layernorm.weight", (D,)),
        ("post_attn_norm", "weight"): Tensor(p + "post_attention_layernorm.weight", (D,)),
        **nest(("attn",), attn),
    }
    if cfg.is_moe_layer(layer):
        E, N = cfg.n_routed_experts, cfg.moe_intermediate_size
        m = p + "mlp."
        tree |= {
            ("mlp", "router", "weight"): Linear(m + "gate", E, D, as_stored),
            ("mlp", "router", "bias"): Tensor(m + "gate.e_score_correction_bias", (E,), init="bias"),
            ("mlp", "experts", "gate_up"): ExpertGateUp(m + "experts", E, N, D),
            ("mlp", "experts", "down"): ExpertDown(m + "experts", E, N, D),
            **nest(("mlp", "shared"), mlp_tensors(m + "shared_experts.", D, N * cfg.n_shared_experts)),
        }
    else:
        tree |= nest(("mlp",), mlp_tensors(p + "mlp.", D, cfg.intermediate_size))
    return tree


def mtp_marker(layer: int) -> str:
    """A tensor whose presence says the checkpoint ships next-n layer ``layer``."""
    return f"model.layers.{layer}.eh_proj.weight"


def param_spec(cfg: DsaConfig, model: DsaModel) -> dict[Path, Spec]:
    """Sources of every parameter of ``model`` (its groups as they are: scanned or taken apart)."""
    V, D = cfg.vocab_size, cfg.hidden_size
    head = "model.embed_tokens" if cfg.tie_word_embeddings else "lm_head"
    spec: dict[Path, Spec] = {
        ("embed", "weight"): Tensor("model.embed_tokens.weight", (V, D), init="embed"),
        ("norm", "weight"): Tensor("model.norm.weight", (D,)),
        ("lm_head", "weight"): Linear(head, V, D),
    }
    spec |= group_specs(model.groups, lambda i: layer_spec(cfg, i))
    for n in range(len(model.mtp)):
        layer, p = cfg.num_hidden_layers + n, f"model.layers.{cfg.num_hidden_layers + n}."
        spec |= nest(
            ("mtp", n),
            {
                ("enorm", "weight"): Tensor(p + "enorm.weight", (D,)),
                ("hnorm", "weight"): Tensor(p + "hnorm.weight", (D,)),
                ("eh_proj", "weight"): Linear(p + "eh_proj", D, 2 * D),
                ("shared_head_norm", "weight"): Tensor(p + "shared_head.norm.weight", (D,)),
                **nest(("layer",), layer_spec(cfg, layer)),
            },
        )
    return spec
