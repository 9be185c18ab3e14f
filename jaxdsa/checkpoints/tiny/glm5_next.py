"""A random tiny GLM-5.3-Flash in the Hugging Face layout
(``python -m jaxdsa.checkpoints.make_tiny --family glm5_next``).

The directory holds config.json (a :data:`jaxdsa.checkpoints.tiny.presets.GLM5_NEXT_TINY_PRESETS`
entry: ``text_config`` and ``vision_config`` nested as HF writes them, the text model's
``vocab_size`` and ``pad_token_id`` the tokenizer's), generation_config.json, GLM's tokenizer and
chat template (:mod:`jaxdsa.checkpoints.tokenizer_assets`; GLM-5.3-Flash keeps GLM-5's special
tokens), and safetensors under the names HF's ``save_pretrained`` writes (docs/models.md §9.8): the
text model under ``model.language_model.``, the vision tower under ``model.visual.``, ``lm_head``;
KDA's ``q/k/v_conv1d`` and forget-gate tensors, the hyper-connections' ``hc_{attn,ffn}_*`` and the
experts one tensor each, which HF's conversion mapping renames and fuses on load.

Names and shapes are written out here from docs/models.md, not from a parameter spec, so a loader is
tested against an independent reading of the layout. Values depend only on (seed, tensor name)
(:func:`jaxdsa.checkpoints.tiny.writers.random_tensor`), and every parameter HF initializes to a
constant (norm weights, LayerNorm and vision biases, HC base and scale, ``A_log``, the router bias,
the indexer's pool ``ape`` and gate) is drawn at random, so a golden shows a misread one. Tensors HF
keeps in float32 (``_keep_in_fp32_modules_strict``) are stored float32 whatever the dtype.
"""

from __future__ import annotations

import math
import os
from functools import partial
from typing import Any

import numpy as np

from jaxdsa.checkpoints import tokenizer_assets
from jaxdsa.checkpoints.tiny.dsa import attention_tensors
from jaxdsa.checkpoints.tiny.presets import GLM5_NEXT_TINY_PRESETS, KDA
from jaxdsa.checkpoints.tiny.writers import Spec, random_tensor, write_drawn, write_json

TEXT = "model.language_model."
VISION = "model.visual."

# Stored float32 whatever --dtype says: what HF keeps in float32 (router bias, the KDA conv, dt_bias,
# A_log, HC base and scale).
FP32_KINDS = ("router_bias", "kda_conv", "dt_bias", "a_log", "hc_base", "hc_scale")


def _mlp(prefix: str, d: int, inter: int, bias: bool = False) -> dict[str, Spec]:
    t = {
        prefix + "gate_proj.weight": ((inter, d), "linear"),
        prefix + "up_proj.weight": ((inter, d), "linear"),
        prefix + "down_proj.weight": ((d, inter), "linear"),
    }
    if bias:
        t |= {
            prefix + "gate_proj.bias": ((inter,), "bias"),
            prefix + "up_proj.bias": ((inter,), "bias"),
            prefix + "down_proj.bias": ((d,), "bias"),
        }
    return t


def _kda(cfg: dict[str, Any], p: str) -> dict[str, Spec]:
    d, heads, hd = cfg["hidden_size"], cfg["linear_num_heads"], cfg["linear_head_dim"]
    width, kernel = heads * hd, cfg["linear_conv_kernel_dim"]
    t: dict[str, Spec] = {}
    for x in "qkv":
        t[f"{p}{x}_proj.weight"] = ((width, d), "linear")
    for x in "qkv":
        t[f"{p}{x}_conv1d.weight"] = ((width, 1, kernel), "kda_conv")
    return t | {
        p + "f_a_proj.weight": ((hd, d), "linear"),
        p + "f_b_proj.weight": ((width, hd), "linear"),
        p + "dt_bias": ((width,), "dt_bias"),
        p + "A_log": ((heads,), "a_log"),
        p + "b_proj.weight": ((heads, d), "linear"),
        p + "g_a_proj.weight": ((hd, d), "linear"),
        p + "g_b_proj.weight": ((width, hd), "linear"),
        p + "o_norm.weight": ((hd,), "norm"),
        p + "o_proj.weight": ((d, width), "linear"),
    }


def _dsa(cfg: dict[str, Any], p: str, indexer: bool) -> dict[str, Spec]:
    """DSA's MLA (RoPE part 0) and indexer tensors, then the pooled indexer's own two."""
    t = attention_tensors(cfg, p, indexer=indexer)
    if indexer:
        d_idx = cfg["index_head_dim"]
        t |= {
            p + "indexer.index_kpool_compress_ape": ((cfg["index_kpool"], d_idx), "ape"),
            p + "indexer.index_kpool_compress_gate": ((d_idx, cfg["hidden_size"]), "linear"),
        }
    return t


def _layer(cfg: dict[str, Any], layer: int) -> dict[str, Spec]:
    d, n = cfg["hidden_size"], cfg["hc_mult"]
    p = f"{TEXT}layers.{layer}."
    t: dict[str, Spec] = {
        p + "input_layernorm.weight": ((d,), "norm"),
        p + "post_attention_layernorm.weight": ((d,), "norm"),
    }
    for site in ("attn", "ffn"):
        t |= {
            f"{p}hc_{site}_fn": (((2 + n) * n, n * d), "linear"),
            f"{p}hc_{site}_base": (((2 + n) * n,), "hc_base"),
            f"{p}hc_{site}_scale": ((3,), "hc_scale"),
        }
    if cfg["layer_types"][layer] == KDA:
        t |= _kda(cfg, p + "self_attn.")
    else:
        t |= _dsa(cfg, p + "self_attn.", indexer=cfg["indexer_types"][layer] == "full")
    if cfg["mlp_layer_types"][layer] == "sparse":
        experts, inter = cfg["n_routed_experts"], cfg["moe_intermediate_size"]
        t |= {
            p + "mlp.gate.weight": ((experts, d), "linear"),
            p + "mlp.gate.e_score_correction_bias": ((experts,), "router_bias"),
        }
        for e in range(experts):
            t |= _mlp(f"{p}mlp.experts.{e}.", d, inter)
        t |= _mlp(p + "mlp.shared_experts.", d, cfg["n_shared_experts"] * inter)
    else:
        t |= _mlp(p + "mlp.", d, cfg["intermediate_size"])
    return t


def _vision(cfg: dict[str, Any]) -> dict[str, Spec]:
    d, out, bias = cfg["hidden_size"], cfg["out_hidden_size"], cfg["attention_bias"]
    patch, merge = cfg["patch_size"], cfg["spatial_merge_size"]
    t: dict[str, Spec] = {
        VISION + "patch_embed.proj.weight": (
            (d, cfg["in_channels"], cfg["temporal_patch_size"], patch, patch),
            "conv",
        ),
        VISION + "patch_embed.proj.bias": ((d,), "bias"),
    }
    for b in range(cfg["depth"]):
        p = f"{VISION}blocks.{b}."
        t |= {
            p + "norm1.weight": ((d,), "norm"),
            p + "norm2.weight": ((d,), "norm"),
            p + "attn.qkv.weight": ((3 * d, d), "linear"),
            p + "attn.proj.weight": ((d, d), "linear"),
            p + "attn.q_norm.weight": ((d // cfg["num_heads"],), "norm"),
            p + "attn.k_norm.weight": ((d // cfg["num_heads"],), "norm"),
        }
        if bias:
            t |= {p + "attn.qkv.bias": ((3 * d,), "bias"), p + "attn.proj.bias": ((d,), "bias")}
        t |= _mlp(p + "mlp.", d, cfg["intermediate_size"], bias=bias)
    return t | {
        VISION + "post_layernorm.weight": ((d,), "norm"),
        VISION + "downsample.weight": ((out, d, merge, merge), "conv"),
        VISION + "downsample.bias": ((out,), "bias"),
        VISION + "merger.proj.weight": ((out, out), "linear"),
        VISION + "merger.post_projection_norm.weight": ((out,), "norm"),
        VISION + "merger.post_projection_norm.bias": ((out,), "bias"),
        **_mlp(VISION + "merger.", out, cfg["projection_intermediate_size"]),
    }


def tensor_specs(cfg: dict[str, Any]) -> dict[str, Spec]:
    """Every tensor of the checkpoint for a (nested) config dict, in file order: name -> (shape, kind)."""
    text = cfg["text_config"]
    d, vocab = text["hidden_size"], text["vocab_size"]
    specs: dict[str, Spec] = {TEXT + "embed_tokens.weight": ((vocab, d), "embed")}
    for layer in range(text["num_hidden_layers"]):
        specs |= _layer(text, layer)
    specs[TEXT + "norm.weight"] = ((d,), "norm")
    specs["lm_head.weight"] = ((vocab, d), "linear")
    return specs | _vision(cfg["vision_config"])


def _value(name: str, shape: tuple[int, ...], kind: str, seed: int) -> np.ndarray:
    """float32 values that keep activations O(1) (the writers' kinds, plus these): convolutions
    ~ N(0, 1/fan_in); HC base ~ N(0, 0.5²) and scales ~ 1 (as DeepSeek-V4's); the pool ``ape``
    ~ N(0, 1); ``A_log`` ~ N(0, 0.5²); ``dt_bias`` ~ N(−2, 1), so that KDA's per-token decays
    exp(g) spread over the whole range (the glm53 preset: 5th / 50th / 95th percentiles 0.06 / 0.46 /
    0.98): some channels forget at once, others carry the state across tokens and 64-token chunks."""
    if kind in ("conv", "kda_conv"):
        x = random_tensor(name, shape, "embed", seed)
        return x / np.float32(math.sqrt(math.prod(shape[1:])))
    if kind == "hc_base":
        return np.float32(0.5) * random_tensor(name, shape, "embed", seed)
    if kind == "hc_scale":
        return random_tensor(name, shape, "norm", seed)
    if kind == "ape":
        return random_tensor(name, shape, "embed", seed)
    if kind == "a_log":
        return np.float32(0.5) * random_tensor(name, shape, "embed", seed)
    if kind == "dt_bias":
        return random_tensor(name, shape, "embed", seed) - np.float32(2.0)
    return random_tensor(name, shape, "bias" if kind == "router_bias" else kind, seed)


def write(
    out_dir: str,
    *,
    seed: int,
    preset: str,
    dtype: str,
    shards: int,
    overrides: dict[str, Any] | None = None,
) -> str:
    """Write the tiny GLM-5.3-Flash checkpoint directory and return its path. ``overrides``: text
    model fields (``text_config``) replacing the preset's (a longer ``max_position_embeddings``, say)."""
    if preset not in GLM5_NEXT_TINY_PRESETS:
        raise ValueError(f"unknown glm5_next preset {preset!r}; choose from {sorted(GLM5_NEXT_TINY_PRESETS)}")
    cfg = GLM5_NEXT_TINY_PRESETS[preset]
    cfg = cfg | {"text_config": cfg["text_config"] | (overrides or {})}
    if not 1 <= shards <= (n_tensors := len(tensor_specs(cfg))):
        raise ValueError(f"shards must be between 1 and the {n_tensors} tensors, got {shards}")

    os.makedirs(out_dir, exist_ok=True)
    text = cfg["text_config"]
    ids = tokenizer_assets.write_tokenizer(
        "glm5_next", out_dir, model_max_length=text["max_position_embeddings"]
    )
    text = text | {"vocab_size": ids.vocab_size, "pad_token_id": ids.pad_token_id}
    cfg = cfg | {"text_config": text, "dtype": dtype}
    write_json(os.path.join(out_dir, "config.json"), cfg)
    generation = {"eos_token_id": list(ids.eos_token_ids), "pad_token_id": ids.pad_token_id}
    write_json(os.path.join(out_dir, "generation_config.json"), generation)

    write_drawn(
        tensor_specs(cfg),
        partial(_value, seed=seed),
        out_dir,
        dtype=dtype,
        shards=shards,
        fp32_kinds=FP32_KINDS,
    )
    return out_dir
