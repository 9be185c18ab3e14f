"""Write a random tiny model in the real Hugging Face layout: the stand-in for a Hub checkpoint.

    python -m checkpoints.make_tiny --family glm_moe_dsa|deepseek_v32|deepseek_v4 --out DIR
        [--seed N] [--preset NAME] [--dtype float32|bfloat16] [--shards K] [--max-model-len N]

(``deepseek_v4`` is written by :mod:`checkpoints.tiny_v4` in DeepSeek's release layout.)

The directory holds config.json (a :data:`checkpoints.tiny_presets.TINY_PRESETS` entry with
``vocab_size`` set to the tokenizer's), generation_config.json, safetensors with the hub's
per-expert tensor names and [out, in] shapes (docs/models.md §4.1) plus the MTP layer
``model.layers.{num_hidden_layers}`` (§4.2), and a real tokenizer with the family's chat template
(``checkpoints.tokenizer_assets``).

Tensor names and shapes are derived here from the config and docs/models.md, deliberately *not* from
the family's parameter spec: the loader is then tested against an independent reading of the spec.

Weights depend only on (seed, tensor name), so a tensor keeps its values whatever the dtype,
sharding or the other tensors. Scales keep activations O(1): linear weights ~ N(0, 1/fan_in),
embeddings ~ N(0, 1), norm weights ~ 1 + N(0, 0.1^2), LayerNorm bias and router bias ~ N(0, 0.1^2).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import zlib
from typing import Any

import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

from checkpoints import tokenizer_assets
from checkpoints.tiny_presets import TINY_PRESETS

DEFAULT_PRESET = {"glm_moe_dsa": "glm5", "deepseek_v32": "dsv32", "deepseek_v4": "dsv4"}
DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16}

# (shape, kind); the kind ("linear", "embed", "norm", "bias", "router_bias") says how random_tensor
# draws the values; "router_bias" is drawn like "bias" and always stored in fp32, as on the Hub.
Spec = tuple[tuple[int, ...], str]


def _layer_tensors(
    cfg: dict[str, Any], layer: int, *, indexer: bool, moe: bool, mtp: bool
) -> dict[str, Spec]:
    d, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    q_lora, kv_lora = cfg["q_lora_rank"], cfg["kv_lora_rank"]
    nope, rope, v = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
    p = f"model.layers.{layer}."
    t: dict[str, Spec] = {
        p + "input_layernorm.weight": ((d,), "norm"),
        p + "post_attention_layernorm.weight": ((d,), "norm"),
        p + "self_attn.q_a_proj.weight": ((q_lora, d), "linear"),
        p + "self_attn.q_a_layernorm.weight": ((q_lora,), "norm"),
        p + "self_attn.q_b_proj.weight": ((heads * (nope + rope), q_lora), "linear"),
        p + "self_attn.kv_a_proj_with_mqa.weight": ((kv_lora + rope, d), "linear"),
        p + "self_attn.kv_a_layernorm.weight": ((kv_lora,), "norm"),
        p + "self_attn.kv_b_proj.weight": ((heads * (nope + v), kv_lora), "linear"),
        p + "self_attn.o_proj.weight": ((d, heads * v), "linear"),
    }
    if indexer:
        n_idx, d_idx = cfg["index_n_heads"], cfg["index_head_dim"]
        t |= {
            p + "self_attn.indexer.wq_b.weight": ((n_idx * d_idx, q_lora), "linear"),
            p + "self_attn.indexer.wk.weight": ((d_idx, d), "linear"),
            p + "self_attn.indexer.k_norm.weight": ((d_idx,), "norm"),
            p + "self_attn.indexer.k_norm.bias": ((d_idx,), "bias"),
            p + "self_attn.indexer.weights_proj.weight": ((n_idx, d), "linear"),
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


def random_tensor(name: str, shape: tuple[int, ...], kind: str, seed: int) -> np.ndarray:
    """float32 values for one tensor, a function of (seed, name) only."""
    rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
    x = rng.standard_normal(shape, dtype=np.float32)
    if kind == "linear":
        return x / np.float32(np.sqrt(shape[1]))
    if kind == "norm":
        return 1.0 + np.float32(0.1) * x
    if kind in ("bias", "router_bias"):
        return np.float32(0.1) * x
    return x  # embed


def _shard_names(names: list[str], sizes: list[int], shards: int) -> list[list[str]]:
    """Contiguous groups of roughly equal bytes, exactly ``shards`` of them, none empty."""
    total, groups, done = sum(sizes), [], 0
    for i, (name, size) in enumerate(zip(names, sizes)):
        behind = done * shards // total >= len(groups)  # this tensor starts past the current shard's share
        must = len(names) - i == shards - len(groups)  # one tensor left per shard still to open
        if not groups or (len(groups) < shards and (behind or must)):
            groups.append([])
        groups[-1].append(name)
        done += size
    return groups


def write_weights(tensors: dict[str, np.ndarray], out_dir: str, shards: int) -> None:
    """model.safetensors, or K shards + model.safetensors.index.json (replacing any earlier ones)."""
    for stale in glob.glob(os.path.join(out_dir, "model*.safetensors*")):
        os.remove(stale)
    metadata = {"format": "pt"}  # transformers refuses safetensors without it
    if shards == 1:
        save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata=metadata)
        return
    names = list(tensors)
    weight_map = {}
    for i, group in enumerate(_shard_names(names, [tensors[n].nbytes for n in names], shards), start=1):
        file = f"model-{i:05d}-of-{shards:05d}.safetensors"
        save_file({n: tensors[n] for n in group}, os.path.join(out_dir, file), metadata=metadata)
        weight_map |= {n: file for n in group}
    index = {"metadata": {"total_size": sum(t.nbytes for t in tensors.values())}, "weight_map": weight_map}
    _write_json(os.path.join(out_dir, "model.safetensors.index.json"), index)


def _write_json(path: str, obj: Any) -> None:
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(obj, fh, indent=2, ensure_ascii=False)
        fh.write("\n")


def make_tiny(
    family: str,
    out_dir: str | os.PathLike,
    *,
    seed: int = 0,
    preset: str | None = None,
    dtype: str = "float32",
    shards: int = 1,
    overrides: dict[str, Any] | None = None,
) -> str:
    """Write the tiny checkpoint directory and return its path. ``overrides``: config.json fields
    replacing the preset's (wider layers for a load that must outweigh the interpreter's own
    allocations, say)."""
    if family not in DEFAULT_PRESET:
        raise ValueError(f"unknown family {family!r}; choose from {sorted(DEFAULT_PRESET)}")
    preset = preset or DEFAULT_PRESET[family]
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    if family == "deepseek_v4":
        from checkpoints import tiny_v4  # imports this module's helpers

        return tiny_v4.write(
            os.fspath(out_dir), seed=seed, preset=preset, dtype=dtype, shards=shards, overrides=overrides
        )
    if preset not in TINY_PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose from {sorted(TINY_PRESETS)}")
    if TINY_PRESETS[preset]["model_type"] != family:
        raise ValueError(f"preset {preset!r} is a {TINY_PRESETS[preset]['model_type']} model, not {family}")
    if not 1 <= shards <= (n_tensors := len(tensor_specs({**TINY_PRESETS[preset], **(overrides or {})}))):
        raise ValueError(f"shards must be between 1 and the {n_tensors} tensors, got {shards}")

    out_dir = os.fspath(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    cfg = {**TINY_PRESETS[preset], **(overrides or {})}
    ids = tokenizer_assets.write_tokenizer(family, out_dir, model_max_length=cfg["max_position_embeddings"])
    cfg |= {"vocab_size": ids.vocab_size, "dtype": dtype}
    _write_json(os.path.join(out_dir, "config.json"), cfg)
    eos = ids.eos_token_ids[0] if len(ids.eos_token_ids) == 1 else list(ids.eos_token_ids)  # as the Hub files
    generation = {"eos_token_id": eos, "pad_token_id": ids.pad_token_id}
    if ids.bos_token_id is not None:
        generation = {"bos_token_id": ids.bos_token_id, **generation}
    _write_json(os.path.join(out_dir, "generation_config.json"), generation)

    tensors = {
        name: random_tensor(name, shape, kind, seed).astype(
            np.float32 if kind == "router_bias" else DTYPES[dtype]
        )
        for name, (shape, kind) in tensor_specs(cfg).items()
    }
    write_weights(tensors, out_dir, shards)
    return out_dir


def main(argv: list[str] | None = None) -> None:
    from jaxdsa.models.deepseek_v4.presets import TINY_PRESETS as V4_TINY_PRESETS

    def names(family: str) -> str:
        if family == "deepseek_v4":
            return ", ".join(sorted(V4_TINY_PRESETS))
        return ", ".join(sorted(n for n, c in TINY_PRESETS.items() if c["model_type"] == family))

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--family", required=True, choices=sorted(DEFAULT_PRESET))
    parser.add_argument("--out", required=True, help="output directory (created if missing)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--preset",
        default=None,
        help="the family's tiny preset ("
        + "; ".join(f"{f}: {names(f)}, default {DEFAULT_PRESET[f]}" for f in sorted(DEFAULT_PRESET))
        + ")",
    )
    parser.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    parser.add_argument("--shards", type=int, default=1)
    parser.add_argument(
        "--max-model-len",
        type=int,
        help="the model's context (max_position_embeddings; default: the preset's)",
    )
    args = parser.parse_args(argv)
    if args.max_model_len is not None and args.max_model_len < 1:
        parser.error("--max-model-len must be >= 1")
    overrides = {} if args.max_model_len is None else {"max_position_embeddings": args.max_model_len}
    try:
        out = make_tiny(
            args.family,
            args.out,
            seed=args.seed,
            preset=args.preset,
            dtype=args.dtype,
            shards=args.shards,
            overrides=overrides,
        )
    except ValueError as e:
        parser.error(str(e))
    print(out)


if __name__ == "__main__":
    main()
