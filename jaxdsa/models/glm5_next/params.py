"""Where every parameter of :class:`Glm5NextModel` comes from in an HF checkpoint (docs/models.md §9.8).

The names are those HF 5.23's ``save_pretrained`` writes (and the release ships): the text model under
``model.language_model.``, ``lm_head`` beside it, KDA's convolution as three ``{q,k,v}_conv1d`` tensors
and its forget gate's tensors directly under ``self_attn``, the hyper-connections as ``hc_{attn,ffn}_*``,
the routed experts one tensor each. The vision tower (``model.visual.*``) is not read: jaxdsa serves
the text model (:meth:`~jaxdsa.models.glm5_next.family.Glm5NextFamily.param_spec` logs it).
"""

from __future__ import annotations

from jaxdsa.checkpoints.spec import (
    ExpertDown,
    ExpertGateUp,
    Leaf,
    Linear,
    Spec,
    Tensor,
    as_stored,
    transpose,
    transpose_merge,
    transpose_split,
)
from jaxdsa.models.deepseek_v4.params import hc_tensors
from jaxdsa.models.dsa.params import indexer_tensors, mla_tensors, mlp_tensors, nest
from jaxdsa.models.glm5_next.config import Glm5NextConfig
from jaxdsa.models.glm5_next.model import Glm5NextModel
from jaxdsa.models.layer_groups import group_specs

Path = tuple
TEXT = "model.language_model."
VISION = "model.visual."


def _heads(heads: int, dim: int):
    """[H * K] -> [H, K] (a per-channel vector of the KDA heads)."""
    return lambda w: w.reshape(heads, dim)


def _conv(heads: int, dim: int):
    """A depthwise conv weight [H * K, 1, W] -> [H, K, W]."""
    return lambda w: w.reshape(heads, dim, w.shape[-1])


def _kda(cfg: Glm5NextConfig, a: str) -> dict[Path, Leaf]:
    D, H, K, W = cfg.hidden_size, cfg.linear_num_heads, cfg.linear_head_dim, cfg.linear_conv_kernel_dim
    HK = H * K
    tree: dict[Path, Leaf] = {
        (f"{x}_proj", "weight"): Linear(f"{a}{x}_proj", HK, D, transpose_split(H, K)) for x in "qkv"
    }
    tree |= {
        (f"{x}_conv",): Tensor(f"{a}{x}_conv1d.weight", (HK, 1, W), init="bias", view=_conv(H, K))
        for x in "qkv"
    }
    return tree | {
        ("f_a", "weight"): Linear(a + "f_a_proj", K, D),
        ("f_b", "weight"): Linear(a + "f_b_proj", HK, K, transpose_split(H, K)),
        ("dt_bias",): Tensor(a + "dt_bias", (HK,), init="bias", view=_heads(H, K)),
        ("a_log",): Tensor(a + "A_log", (H,), init="bias"),
        ("b_proj", "weight"): Linear(a + "b_proj", H, D),
        ("g_a", "weight"): Linear(a + "g_a_proj", K, D),
        ("g_b", "weight"): Linear(a + "g_b_proj", HK, K, transpose_split(H, K)),
        ("o_norm",): Tensor(a + "o_norm.weight", (K,)),
        ("o_proj", "weight"): Linear(a + "o_proj", D, HK, transpose_merge(H, K)),
    }


def _dsa(cfg: Glm5NextConfig, a: str, indexer: bool) -> dict[Path, Leaf]:
    """NoPE MLA (DSA's tensors, RoPE part 0) and, on a full-indexer layer, the pooled indexer: DSA's
    indexer tensors plus the pool's gate and position embedding."""
    tree = mla_tensors(cfg, a)
    if indexer:
        i, d = a + "indexer.", cfg.index_head_dim
        pool = {
            ("gate", "weight"): Tensor(
                i + "index_kpool_compress_gate", (d, cfg.hidden_size), init="bias", view=transpose
            ),
            ("ape",): Tensor(i + "index_kpool_compress_ape", (cfg.index_kpool, d), init="bias"),
        }
        tree |= nest(("indexer",), indexer_tensors(cfg, i) | pool)
    return tree


def layer_spec(cfg: Glm5NextConfig, layer: int) -> dict[Path, Leaf]:
    """Sources of one :class:`~jaxdsa.models.glm5_next.model.Block`'s parameters (relative paths)."""
    p = f"{TEXT}layers.{layer}."
    D, n = cfg.hidden_size, cfg.hc_mult
    attn = (
        _kda(cfg, p + "self_attn.")
        if cfg.is_kda_layer(layer)
        else _dsa(cfg, p + "self_attn.", cfg.has_indexer(layer))
    )
    tree = {
        ("input_norm", "weight"): Tensor(p + "input_layernorm.weight", (D,)),
        ("post_attn_norm", "weight"): Tensor(p + "post_attention_layernorm.weight", (D,)),
        **nest(("hc_attn",), hc_tensors(p + "hc_attn", cfg, (2 + n) * n, 3)),
        **nest(("hc_ffn",), hc_tensors(p + "hc_ffn", cfg, (2 + n) * n, 3)),
        **nest(("attn",), attn),
    }
    m = p + "mlp."
    if cfg.is_moe_layer(layer):
        E, N = cfg.n_routed_experts, cfg.moe_intermediate_size
        return tree | {
            ("mlp", "router", "weight"): Linear(m + "gate", E, D, as_stored),
            ("mlp", "router", "bias"): Tensor(m + "gate.e_score_correction_bias", (E,), init="bias"),
            ("mlp", "experts", "gate_up"): ExpertGateUp(m + "experts", E, N, D),
            ("mlp", "experts", "down"): ExpertDown(m + "experts", E, N, D),
            **nest(("mlp", "shared"), mlp_tensors(m + "shared_experts.", D, N * cfg.n_shared_experts)),
        }
    return tree | nest(("mlp",), mlp_tensors(m, D, cfg.intermediate_size))


def param_spec(cfg: Glm5NextConfig, model: Glm5NextModel) -> dict[Path, Spec]:
    """Sources of every parameter of ``model`` (its groups as they are: scanned or taken apart)."""
    V, D = cfg.vocab_size, cfg.hidden_size
    head = TEXT + "embed_tokens" if cfg.tie_word_embeddings else "lm_head"
    spec: dict[Path, Spec] = {
        ("embed", "weight"): Tensor(TEXT + "embed_tokens.weight", (V, D), init="embed"),
        ("norm", "weight"): Tensor(TEXT + "norm.weight", (D,)),
        ("lm_head", "weight"): Linear(head, V, D),
    }
    return spec | group_specs(model.groups, lambda i: layer_spec(cfg, i))
