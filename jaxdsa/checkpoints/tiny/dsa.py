"""A random tiny GLM-5.x or DeepSeek-V3.2 (MLA + DSA) in the Hugging Face Hub layout
(``python -m jaxdsa.checkpoints.make_tiny --family glm_moe_dsa|deepseek_v32``).

The directory holds config.json (a :data:`jaxdsa.checkpoints.tiny.presets.TINY_PRESETS` entry with
``vocab_size`` set to the tokenizer's), generation_config.json, safetensors with the hub's
per-expert tensor names and [out, in] shapes (docs/models.md §4.1) plus the MTP layer
``model.layers.{num_hidden_layers}`` (§4.2), and a real tokenizer with the family's chat template
(``jaxdsa.checkpoints.tokenizer_assets``).

Tensor names and shapes are derived here from the config and docs/models.md, deliberately *not* from
the family's parameter spec: the loader is then tested against an independent reading of the spec.
Values: :func:`jaxdsa.checkpoints.tiny.writers.random_tensor`; "router_bias" is drawn like "bias" and always
stored in fp32, as on the Hub. ``quant="nvfp4"``: every linear but the head and the routers stored as
ModelOpt NVFP4 (:mod:`jaxdsa.checkpoints.tiny.nvfp4`), with both of ModelOpt's config files.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from jaxdsa.checkpoints import tokenizer_assets
from jaxdsa.checkpoints.tiny import nvfp4
from jaxdsa.checkpoints.tiny.presets import TINY_PRESETS
from jaxdsa.checkpoints.tiny.writers import DTYPES, Spec, random_tensor, write_json, write_weights


def attention_tensors(cfg: dict[str, Any], a: str, *, indexer: bool) -> dict[str, Spec]:
    """MLA's tensors under ``a`` (``...self_attn.``) and, with ``indexer``, the DSA indexer's, in file
    order: GLM-5.x's and DeepSeek-V3.2's, and GLM-5.3-Flash's with its RoPE part 0 (its pooled indexer
    adds two tensors after these)."""
    d, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    q_lora, kv_lora = cfg["q_lora_rank"], cfg["kv_lora_rank"]
    nope, rope, v = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
    t: dict[str, Spec] = {
        a + "q_a_proj.weight": ((q_lora, d), "linear"),
        a + "q_a_layernorm.weight": ((q_lora,), "norm"),
        a + "q_b_proj.weight": ((heads * (nope + rope), q_lora), "linear"),
        a + "kv_a_proj_with_mqa.weight": ((kv_lora + rope, d), "linear"),
        a + "kv_a_layernorm.weight": ((kv_lora,), "norm"),
        a + "kv_b_proj.weight": ((heads * (nope + v), kv_lora), "linear"),
        a + "o_proj.weight": ((d, heads * v), "linear"),
    }
    if indexer:
        n_idx, d_idx = cfg["index_n_heads"], cfg["index_head_dim"]
        t |= {
            a + "indexer.wq_b.weight": ((n_idx * d_idx, q_lora), "linear"),
            a + "indexer.wk.weight": ((d_idx, d), "linear"),
            a + "indexer.k_norm.weight": ((d_idx,), "norm"),
            a + "indexer.k_norm.bias": ((d_idx,), "bias"),
            a + "indexer.weights_proj.weight": ((n_idx, d), "linear"),
        }
    return t


def _layer_tensors(
    cfg: dict[str, Any], layer: int, *, indexer: bool, moe: bool, mtp: bool
) -> dict[str, Spec]:
    d = cfg["hidden_size"]
    p = f"model.layers.{layer}."
    t: dict[str, Spec] = {
        p + "input_layernorm.weight": ((d,), "norm"),
        p + "post_attention_layernorm.weight": ((d,), "norm"),
        **attention_tensors(cfg, p + "self_attn.", indexer=indexer),
    }
    if moe:
        experts, inter = cfg["n_routed_experts"], cfg["moe_intermediate_size"]
        shared = cfg.get("n_shared_experts", 1) * inter
        t |= {
            p + "mlp.gate.weight": ((experts, d), "linear"),
            p + "mlp.gate.e_score_correction_bias": ((experts,), "router_bias"),
        }
        for e in range(experts):
            t |= _mlp(f"{p}mlp.experts.{e}.", d, inter)
        if shared:
            t |= _mlp(p + "mlp.shared_experts.", d, shared)
    else:
        t |= _mlp(p + "mlp.", d, cfg["intermediate_size"])
    if mtp:
        t |= {
            p + "enorm.weight": ((d,), "norm"),
            p + "hnorm.weight": ((d,), "norm"),
            p + "eh_proj.weight": ((d, 2 * d), "linear"),
            p + "shared_head.norm.weight": ((d,), "norm"),
        }
    return t


def _mlp(prefix: str, d: int, inter: int) -> dict[str, Spec]:
    return {
        prefix + "gate_proj.weight": ((inter, d), "linear"),
        prefix + "up_proj.weight": ((inter, d), "linear"),
        prefix + "down_proj.weight": ((d, inter), "linear"),
    }


def tensor_specs(cfg: dict[str, Any]) -> dict[str, Spec]:
    """Every tensor of the checkpoint for an HF config dict, in file order: name -> (shape, kind)."""
    n_layers, d, vocab = cfg["num_hidden_layers"], cfg["hidden_size"], cfg["vocab_size"]
    # GLM-5.2 ships indexer weights only on 'full' layers; DeepSeek-V3.2 has no indexer_types (all full).
    indexer_types = cfg.get("indexer_types") or ["full"] * n_layers
    specs: dict[str, Spec] = {"model.embed_tokens.weight": ((vocab, d), "embed")}
    for layer in range(n_layers + cfg.get("num_nextn_predict_layers", 0)):
        mtp = layer >= n_layers  # MTP layers always carry their own indexer and a MoE FFN
        specs |= _layer_tensors(
            cfg,
            layer,
            indexer=mtp or indexer_types[layer] == "full",
            moe=layer >= cfg["first_k_dense_replace"],
            mtp=mtp,
        )
    specs["model.norm.weight"] = ((d,), "norm")
    specs["lm_head.weight"] = ((vocab, d), "linear")
    return specs


def write(
    family: str,
    out_dir: str,
    *,
    seed: int,
    preset: str,
    dtype: str,
    shards: int,
    overrides: dict[str, Any] | None = None,
    quant: str | None = None,
) -> str:
    """Write the tiny checkpoint directory of a ``TINY_PRESETS`` entry of ``family`` and return its
    path. ``overrides``: config.json fields replacing the preset's; ``quant``: None or "nvfp4"."""
    if quant not in (None, "nvfp4"):
        raise ValueError(f"quant must be None or 'nvfp4', got {quant!r}")
    if preset not in TINY_PRESETS:
        known = sorted(n for n, c in TINY_PRESETS.items() if c["model_type"] == family)
        raise ValueError(f"unknown {family} preset {preset!r}; choose from {known}")
    if TINY_PRESETS[preset]["model_type"] != family:
        raise ValueError(f"preset {preset!r} is a {TINY_PRESETS[preset]['model_type']} model, not {family}")
    if not 1 <= shards <= (n_tensors := len(tensor_specs({**TINY_PRESETS[preset], **(overrides or {})}))):
        raise ValueError(f"shards must be between 1 and the {n_tensors} tensors, got {shards}")

    os.makedirs(out_dir, exist_ok=True)
    cfg = {**TINY_PRESETS[preset], **(overrides or {})}
    ids = tokenizer_assets.write_tokenizer(family, out_dir, model_max_length=cfg["max_position_embeddings"])
    cfg |= {"vocab_size": ids.vocab_size, "dtype": dtype}
    if quant == "nvfp4":
        cfg["quantization_config"] = nvfp4.quantization_config()
        write_json(os.path.join(out_dir, "hf_quant_config.json"), nvfp4.hf_quant_config())
    write_json(os.path.join(out_dir, "config.json"), cfg)
    eos = ids.eos_token_ids[0] if len(ids.eos_token_ids) == 1 else list(ids.eos_token_ids)  # as the Hub files
    generation = {"eos_token_id": eos, "pad_token_id": ids.pad_token_id}
    if ids.bos_token_id is not None:
        generation = {"bos_token_id": ids.bos_token_id, **generation}
    write_json(os.path.join(out_dir, "generation_config.json"), generation)

    tensors = {}
    for name, (shape, kind) in tensor_specs(cfg).items():
        value = random_tensor(name, shape, kind, seed).astype(
            np.float32 if kind == "router_bias" else DTYPES[dtype]
        )
        if quant == "nvfp4" and kind == "linear" and nvfp4.quantizes(name):
            module = name.removesuffix(".weight")
            tensors |= {f"{module}.{k}": v for k, v in nvfp4.quantize(value.astype(np.float32)).items()}
        else:
            tensors[name] = value
    write_weights(tensors, out_dir, shards)
    return out_dir
