"""Size a deployment from a config.json alone: per-device memory, cache capacity, traffic, speed.

    python -m jaxdsa.plan --config CONFIG_JSON --tp 8 --ep 8 --dp 1 [--dp-attention] --hbm-gib 80 \\
        --weights bf16|fp8|int4 --max-model-len 32768 [--batch 32]

Shard sizes come from the same rules table the loader uses (:mod:`jaxdsa.sharding`) applied to
the parameter shapes of :mod:`checkpoints.names`, so the figures describe what jaxdsa would
place on each device. ``--weights`` is the in-memory format of the quantizable linears (experts,
dense MLPs, attention projections); embeddings, norms, routers and the indexer's weights_proj
stay bf16 / fp32. jaxdsa today dequantizes FP8 / INT4 checkpoints to bf16 at load, so ``bf16``
describes what runs now; ``fp8`` / ``int4`` size the kept-quantized formats.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
from collections.abc import Iterator

import jax
import jax.numpy as jnp

from checkpoints import names
from jaxdsa.config import ModelConfig, load_config
from jaxdsa.sharding import EXPERT_AXES, RULES, Parallelism, leaf_axes

# Bytes per weight for the quantizable linears (FP8: 1 byte + one fp32 scale per 128x128 block;
# INT4 compressed-tensors: 0.5 byte + a bf16 scale and an int4 zero point per group of 32).
WEIGHT_BYTES = {"bf16": 2.0, "fp8": 1.0 + 4 / (128 * 128), "int4": 0.5 + (2 + 0.5) / 32}
GiB = 1 << 30


@dataclasses.dataclass(frozen=True)
class Leaf:
    path: tuple
    shape: tuple[int, ...]
    bytes_per_element: float


def _shape_of(spec, path: tuple) -> Iterator[Leaf]:
    """Parameter leaves (jaxdsa layout) of one name-map entry with their storage width."""
    if isinstance(spec, names.Tensor):
        yield Leaf(path, spec.shape, 4.0 if spec.keep_fp32 else 2.0)
    elif isinstance(spec, names.Linear):
        shape = jax.eval_shape(spec.post, jax.ShapeDtypeStruct((spec.out, spec.inp), jnp.int8)).shape
        yield Leaf(path, tuple(shape), 4.0 if spec.keep_fp32 else -1.0)
    elif isinstance(spec, names.Experts):
        yield Leaf(path + ("gate_up",), (spec.num, spec.hidden, 2 * spec.inter), -1.0)
        yield Leaf(path + ("down",), (spec.num, spec.inter, spec.hidden), -1.0)
    else:
        for key, child in spec.items():
            yield from _shape_of(child, path + (key,))


def parameter_leaves(cfg: ModelConfig) -> Iterator[Leaf]:
    """Every parameter; -1 bytes marks a quantizable linear (width set by --weights)."""
    yield from _shape_of(names.model_map(cfg), ())
    for i in range(cfg.num_hidden_layers):
        yield from _shape_of(names.layer_map(cfg, i), ("layers", i))


_UNQUANTIZED = ("router", "embed", "lm_head")


def shard_elements(leaf: Leaf, par: Parallelism) -> float:
    """Elements of ``leaf`` on one device under the rules table (heads padded like the loader)."""
    sizes = par.axis_sizes
    n = 1.0
    for dim, name in zip(leaf.shape, leaf_axes(leaf.path, len(leaf.shape))):
        split = math.prod(sizes[a] for a in RULES.get(name, ()))
        n *= -(-dim // split)
    return n


def device_weight_bytes(cfg: ModelConfig, par: Parallelism, weights: str) -> float:
    total = 0.0
    for leaf in parameter_leaves(cfg):
        width = leaf.bytes_per_element
        if width < 0:
            width = 2.0 if any(k in leaf.path for k in _UNQUANTIZED) else WEIGHT_BYTES[weights]
        total += shard_elements(leaf, par) * width
    return total


def cache_bytes_per_token(cfg: ModelConfig) -> int:
    """bf16 latent rows of every layer + index keys of the layers that run an indexer (per device:
    the cache is replicated over tp and split over dp by sequence)."""
    return 2 * (cfg.num_hidden_layers * cfg.latent_dim + len(cfg.indexer_layers) * cfg.index_head_dim)


def decode_step(
    cfg: ModelConfig, par: Parallelism, weights: str, batch: int, context: int
) -> dict[str, float]:
    """Per-device bytes read and collective bytes of one decode step of ``batch`` sequences per dp group."""
    read = 0.0
    sizes = par.axis_sizes
    edp = sizes["edp"]  # dp-attention groups whose tokens meet at every expert
    E_local = cfg.n_routed_experts / math.prod(sizes[a] for a in EXPERT_AXES)
    moe_tokens = batch * edp
    touched = E_local * (
        1 - (1 - cfg.num_experts_per_tok / cfg.n_routed_experts) ** moe_tokens
    )  # expected distinct local experts
    for leaf in parameter_leaves(cfg):
        width = leaf.bytes_per_element
        if width < 0:
            width = 2.0 if any(k in leaf.path for k in _UNQUANTIZED) else WEIGHT_BYTES[weights]
        elements = shard_elements(leaf, par)
        if "experts" in leaf.path:
            elements *= touched / E_local
        if leaf.path[0] == "embed":
            elements *= batch / leaf.shape[0]  # a lookup reads only the rows it needs
        read += elements * width
    kv_rows = min(context, cfg.index_topk)
    read += batch * cfg.num_hidden_layers * kv_rows * cfg.latent_dim * 2
    if context > cfg.index_topk:
        read += batch * len(cfg.indexer_layers) * context * cfg.index_head_dim * 2
    tp = par.tp
    ring = 2 * (tp - 1) / tp if tp > 1 else 0.0  # all-reduce traffic per device per byte reduced
    D = cfg.hidden_size
    per_layer = 2 * batch * D * 2  # attention output + MLP/MoE output all-reduces, bf16
    collective = ring * (cfg.num_hidden_layers * per_layer + batch * D * 4)  # + the embedding psum (f32)
    collective += ring * len(cfg.indexer_layers) * batch * context * 4  # indexer head-sum psum (f32 logits)
    moe_layers = cfg.num_hidden_layers - cfg.first_k_dense_replace
    ep_shards = sizes["rep"] * sizes["tpe"]  # expert shards inside a group
    if ep_shards > 1:
        collective += 2 * (ep_shards - 1) / ep_shards * moe_layers * moe_tokens * D * 4  # expert psum (f32)
    if edp > 1:  # all-gather the groups' tokens (bf16 + ids/weights), reduce-scatter the f32 outputs
        k = cfg.num_experts_per_tok
        collective += (edp - 1) * moe_layers * batch * (D * 2 + k * 8 + D * 4)
    return {"bytes_read": read, "collective_bytes": collective}


def plan(
    cfg: ModelConfig,
    par: Parallelism,
    *,
    hbm_gib: float,
    weights: str,
    max_model_len: int,
    batch: int,
    hbm_gbs: float,
    link_gbs: float,
    reserve_gib: float,
) -> dict[str, float]:
    weight_bytes = device_weight_bytes(cfg, par, weights)
    free = hbm_gib * GiB - weight_bytes - reserve_gib * GiB
    per_token = cache_bytes_per_token(cfg)
    tokens_per_group = max(0, int(free // per_token))
    step = decode_step(cfg, par, weights, batch, max_model_len)
    memory_s = step["bytes_read"] / (hbm_gbs * 1e9)
    comm_s = step["collective_bytes"] / (link_gbs * 1e9)
    return {
        "devices": par.num_devices,
        "weights_gib_per_device": weight_bytes / GiB,
        "cache_bytes_per_token": per_token,
        "cache_tokens_per_dp_group": tokens_per_group,
        "cache_tokens_total": tokens_per_group * par.dp,
        "full_length_sequences_per_dp_group": tokens_per_group // max_model_len,
        "decode_bytes_read_gib_per_device": step["bytes_read"] / GiB,
        "decode_collective_mib_per_device": step["collective_bytes"] / (1 << 20),
        "decode_step_ms_roofline": 1e3 * (memory_s + comm_s),
        "decode_tok_s_roofline": batch * par.dp / (memory_s + comm_s),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m jaxdsa.plan", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", required=True, help="config.json (or the checkpoint directory)")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--ep", type=int, default=1)
    p.add_argument("--dp", type=int, default=1)
    p.add_argument(
        "--dp-attention", action="store_true", help="the dp groups share the experts (ep counts all shards)"
    )
    p.add_argument("--hbm-gib", type=float, default=80)
    p.add_argument("--weights", choices=sorted(WEIGHT_BYTES), default="bf16")
    p.add_argument("--max-model-len", type=int, default=32768)
    p.add_argument(
        "--batch", type=int, default=32, help="decode sequences per dp group for the step estimate"
    )
    p.add_argument("--hbm-gbs", type=float, default=3000, help="achievable HBM bandwidth (H100 copy: ~3000)")
    p.add_argument("--link-gbs", type=float, default=350, help="achievable all-reduce bus bandwidth per GPU")
    p.add_argument("--reserve-gib", type=float, default=4, help="kept free for activations and the runtime")
    args = p.parse_args(argv)
    try:
        cfg = load_config(args.config)
        par = Parallelism(tp=args.tp, ep=args.ep, dp=args.dp, dp_attention=args.dp_attention)
    except ValueError as e:
        print(f"plan: {e}", file=sys.stderr)
        return 2
    result = plan(
        cfg,
        par,
        hbm_gib=args.hbm_gib,
        weights=args.weights,
        max_model_len=args.max_model_len,
        batch=args.batch,
        hbm_gbs=args.hbm_gbs,
        link_gbs=args.link_gbs,
        reserve_gib=args.reserve_gib,
    )
    dp_attention = " (dp attention)" if par.dp_attention else ""
    print(
        f"{cfg.model_type}: {cfg.num_hidden_layers} layers, {cfg.n_routed_experts} experts; tp={par.tp} ep={par.ep} dp={par.dp}{dp_attention}, weights {args.weights}"
    )
    for key, value in result.items():
        print(f"  {key:38s} {value:,.2f}" if isinstance(value, float) else f"  {key:38s} {value:,}")
    if result["cache_tokens_per_dp_group"] < args.max_model_len:
        print(
            f"  WARNING: one {args.max_model_len}-token sequence does not fit next to the weights",
            file=sys.stderr,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
