"""A random tiny DeepSeek-V4 in the release layout
(``python -m jaxdsa.checkpoints.make_tiny --family deepseek_v4``).

The directory holds the release-form ``config.json`` (a
:data:`jaxdsa.checkpoints.tiny.presets.V4_TINY_PRESETS` entry through
:func:`~jaxdsa.checkpoints.tiny.presets.release_form`, ``vocab_size`` set to the tokenizer's),
``generation_config.json``, the DeepSeek tokenizer assets (V4 shares V3.2's tokenizer family: BOS 0,
EOS 1) with a V4 chat template for tool-less conversations (the server
encodes V4 chats with ``jaxdsa.serve.deepseek_v4_encoding``, docs/models.md §6.4) and
safetensors with the release names and dtypes of docs/models.md §4.4: bf16 (or float32) weights, float32
HC parameters, sinks, ``ape`` and router bias, int64 ``tid2eid``, plus the MTP block ``mtp.0.*``.

Names and shapes are written out here from docs/models.md, deliberately not from the family's parameter
spec, so the loader is tested against an independent reading of the layout. Values depend only on
(seed, tensor name), like the other families' (:mod:`jaxdsa.checkpoints.tiny.writers`).
"""

from __future__ import annotations

import os
import zlib
from functools import partial
from typing import Any

import numpy as np

from jaxdsa.checkpoints import tokenizer_assets
from jaxdsa.checkpoints.tiny.presets import V4_TINY_PRESETS, release_form
from jaxdsa.checkpoints.tiny.writers import Spec, random_tensor, write_drawn, write_json

TOKENIZER_FAMILY = "deepseek_v4"

# kind -> how the value is drawn (see _value); "fp32" kinds are stored float32 whatever --dtype says.
FP32_KINDS = ("hc_fn", "hc_base", "hc_scale", "sink", "ape", "router_bias")


def _block(cfg: dict[str, Any], p: str, ratio: int, hashed: bool) -> dict[str, Spec]:
    d, heads, hd = cfg["hidden_size"], cfg["num_attention_heads"], cfg["head_dim"]
    q_lora, groups, o_lora = cfg["q_lora_rank"], cfg["o_groups"], cfg["o_lora_rank"]
    n, experts, inter = cfg["hc_mult"], cfg["n_routed_experts"], cfg["moe_intermediate_size"]
    mix = (2 + n) * n
    t = {
        p + "attn_norm.weight": ((d,), "norm"),
        p + "ffn_norm.weight": ((d,), "norm"),
        p + "hc_attn_fn": ((mix, n * d), "hc_fn"),
        p + "hc_attn_base": ((mix,), "hc_base"),
        p + "hc_attn_scale": ((3,), "hc_scale"),
        p + "hc_ffn_fn": ((mix, n * d), "hc_fn"),
        p + "hc_ffn_base": ((mix,), "hc_base"),
        p + "hc_ffn_scale": ((3,), "hc_scale"),
        p + "attn.attn_sink": ((heads,), "sink"),
        p + "attn.wq_a.weight": ((q_lora, d), "linear"),
        p + "attn.q_norm.weight": ((q_lora,), "norm"),
        p + "attn.wq_b.weight": ((heads * hd, q_lora), "linear"),
        p + "attn.wkv.weight": ((hd, d), "linear"),
        p + "attn.kv_norm.weight": ((hd,), "norm"),
        p + "attn.wo_a.weight": ((groups * o_lora, heads * hd // groups), "linear"),
        p + "attn.wo_b.weight": ((d, groups * o_lora), "linear"),
        p + "ffn.gate.weight": ((experts, d), "linear"),
        p + "ffn.shared_experts.w1.weight": ((inter, d), "linear"),
        p + "ffn.shared_experts.w3.weight": ((inter, d), "linear"),
        p + "ffn.shared_experts.w2.weight": ((d, inter), "linear"),
    }
    if ratio:
        overlap = ratio == 4  # the release form's rule: CSA exactly at ratio 4
        c = 2 if overlap else 1
        t |= {
            p + "attn.compressor.wkv.weight": ((c * hd, d), "linear"),
            p + "attn.compressor.wgate.weight": ((c * hd, d), "linear"),
            p + "attn.compressor.ape": ((ratio, c * hd), "ape"),
            p + "attn.compressor.norm.weight": ((hd,), "norm"),
        }
        if overlap:
            nh, di = cfg["index_n_heads"], cfg["index_head_dim"]
            t |= {
                p + "attn.indexer.wq_b.weight": ((nh * di, q_lora), "linear"),
                p + "attn.indexer.weights_proj.weight": ((nh, d), "linear"),
                p + "attn.indexer.compressor.wkv.weight": ((2 * di, d), "linear"),
                p + "attn.indexer.compressor.wgate.weight": ((2 * di, d), "linear"),
                p + "attn.indexer.compressor.ape": ((ratio, 2 * di), "ape"),
                p + "attn.indexer.compressor.norm.weight": ((di,), "norm"),
            }
    if hashed:
        t[p + "ffn.gate.tid2eid"] = ((cfg["vocab_size"], cfg["num_experts_per_tok"]), "tid2eid")
    else:
        t[p + "ffn.gate.bias"] = ((experts,), "router_bias")
    for e in range(experts):
        t |= {
            f"{p}ffn.experts.{e}.w1.weight": ((inter, d), "linear"),
            f"{p}ffn.experts.{e}.w3.weight": ((inter, d), "linear"),
            f"{p}ffn.experts.{e}.w2.weight": ((d, inter), "linear"),
        }
    return t


def tensor_specs(cfg: dict[str, Any]) -> dict[str, Spec]:
    """Every tensor of a release-form V4 config: name -> (shape, kind)."""
    d, vocab, n = cfg["hidden_size"], cfg["vocab_size"], cfg["hc_mult"]
    layers = cfg["num_hidden_layers"]
    specs = {"embed.weight": ((vocab, d), "embed")}
    for i in range(layers):
        specs |= _block(cfg, f"layers.{i}.", cfg["compress_ratios"][i], i < cfg["num_hash_layers"])
    if cfg.get("num_nextn_predict_layers", 0):
        specs |= _block(cfg, "mtp.0.", cfg["compress_ratios"][layers], hashed=False)
        specs |= {
            "mtp.0.e_proj.weight": ((d, d), "linear"),
            "mtp.0.h_proj.weight": ((d, d), "linear"),
            "mtp.0.enorm.weight": ((d,), "norm"),
            "mtp.0.hnorm.weight": ((d,), "norm"),
            "mtp.0.norm.weight": ((d,), "norm"),
            "mtp.0.hc_head_fn": ((n, n * d), "hc_fn"),
            "mtp.0.hc_head_base": ((n,), "hc_base"),
            "mtp.0.hc_head_scale": ((1,), "hc_scale"),
        }
    specs |= {
        "norm.weight": ((d,), "norm"),
        "head.weight": ((vocab, d), "linear"),
        "hc_head_fn": ((n, n * d), "hc_fn"),
        "hc_head_base": ((n,), "hc_base"),
        "hc_head_scale": ((1,), "hc_scale"),
    }
    return specs


def _value(name: str, shape: tuple[int, ...], kind: str, seed: int, cfg: dict[str, Any]) -> np.ndarray:
    """Float values keep activations O(1): HC mixes ~ N(0, 1), scales ~ 1, sinks and ape ~ N(0, 1)."""
    if kind == "tid2eid":  # distinct experts per token
        rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
        rows = [rng.permutation(cfg["n_routed_experts"])[: shape[1]] for _ in range(shape[0])]
        return np.stack(rows).astype(np.int64)
    if kind == "hc_fn":
        return random_tensor(name, shape, "linear", seed)
    if kind == "hc_base":
        return np.float32(0.5) * random_tensor(name, shape, "embed", seed)
    if kind == "hc_scale":
        return random_tensor(name, shape, "norm", seed)
    if kind in ("sink", "ape"):
        return random_tensor(name, shape, "embed", seed)
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
    """Write the tiny V4 checkpoint directory and return its path. ``overrides``: release-form
    config.json fields replacing the preset's (a longer ``max_position_embeddings``, say)."""
    if preset not in V4_TINY_PRESETS:
        raise ValueError(f"unknown DeepSeek-V4 preset {preset!r}; choose from {sorted(V4_TINY_PRESETS)}")
    os.makedirs(out_dir, exist_ok=True)
    cfg = release_form(V4_TINY_PRESETS[preset]) | (overrides or {})
    ids = tokenizer_assets.write_tokenizer(
        TOKENIZER_FAMILY, out_dir, model_max_length=cfg["max_position_embeddings"]
    )
    cfg |= {"vocab_size": ids.vocab_size, "torch_dtype": dtype, "bos_token_id": ids.bos_token_id}
    cfg["eos_token_id"] = ids.eos_token_ids[0]
    specs = tensor_specs(cfg)
    if not 1 <= shards <= len(specs):
        raise ValueError(f"shards must be between 1 and the {len(specs)} tensors, got {shards}")
    write_json(os.path.join(out_dir, "config.json"), cfg)
    generation = {
        "bos_token_id": ids.bos_token_id,
        "eos_token_id": ids.eos_token_ids[0],
        "pad_token_id": ids.pad_token_id,
    }
    write_json(os.path.join(out_dir, "generation_config.json"), generation)
    write_drawn(
        specs, partial(_value, seed=seed, cfg=cfg), out_dir, dtype=dtype, shards=shards, fp32_kinds=FP32_KINDS
    )
    return out_dir
