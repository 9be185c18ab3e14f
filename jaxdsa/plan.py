"""Size a deployment from a config.json alone: per-device memory, cache capacity, traffic, speed,
whether it fits (exit status 0; 1 when one ``--max-model-len`` sequence does not fit), and the
fewest GPUs it fits on.

    python -m jaxdsa.plan (--config CONFIG_JSON | --preset glm5|glm52|dsv32|v4-flash|v4-pro|glm53-flash) \\
        --tp 8 --ep 8 --dp 1 [--dp-attention] --hbm-gib 80 [--weights auto|bf16|fp8|int4|nvfp4] \\
        --max-model-len 32768 [--batch 32] [--gpu-memory-utilization 0.9] [--num-gpu-experts N]

With ``--num-gpu-experts N`` (the server's flag) each MoE layer keeps N routed experts on the GPUs
and the rest in host RAM: the GPU side counts N of them, the host side the others once (the host
holds whole experts, whatever the mesh), plus the float32 copy of FP8 block scales the CPU kernel
reads; a decode step's host reads stream at ``--host-gbs``. When the model does not fit the GPUs
whole, the planner says how many experts per layer do.

Shard sizes come from the same rules table the loader uses (:mod:`jaxdsa.sharding`) applied to
the parameters of the family's abstract model, so the figures describe what jaxdsa would place on
each device. ``--weights`` is the in-memory format of the linears and routed experts that stay
quantized (:mod:`jaxdsa.quantization`: the model is built as ``load_format="dummy"`` with that
``quantization`` builds it, codes, scales and zero points counted at their widths): ``auto`` (the
default) the config's own format, as the server keeps it; ``bf16`` as
``quantization="dequantize"`` loads any checkpoint; ``fp8`` 128x128 blocks with float32 scales;
``int4`` the config's compressed-tensors scheme, else asymmetric group 32 (bf16 scales, one byte
per zero point); ``nvfp4`` ModelOpt's (half a byte per weight, an e4m3 byte per 16, a few float32
global scales per matrix: its config's exclusions honoured, else every linear and expert).
Embeddings, norms, routers, the indexer's weights_proj and the LM head stay bf16 / fp32.

State a sequence holds whatever its length (DeepSeek-V4's rings; GLM-5.3-Flash's KDA states and conv
rings, split over tp with the KDA heads) is counted per device for ``--batch`` sequences, set aside
before the cache pages as the server does for its slots, and printed on a line of its own.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxdsa import quantization
from jaxdsa.cache import kv_cache_format
from jaxdsa.engine import memory
from jaxdsa.engine.penalties import BYTES_PER_ENTRY as PENALTY_BYTES
from jaxdsa.models import family as families
from jaxdsa.models.family import ModelFamily
from jaxdsa.models.registry import RELEASED, family_for, load_config, released_config
from jaxdsa.quantized_weight import QuantizedWeight
from jaxdsa.sharding import EXPERT_AXES, Parallelism, shard_shape

# --weights -> quantization
WEIGHTS = {"auto": "auto", "bf16": "dequantize", "fp8": "fp8", "int4": "int4", "nvfp4": "nvfp4"}
LAYOUTS = (1, 2, 4, 8, 16, 32)  # GPU counts tried (-tp N -ep N) for the fewest that fit
HOST_GPUS = 8  # the most GPUs of one host, all the server spans
GiB = 1 << 30
MiB = 1 << 20


@dataclasses.dataclass(frozen=True)
class Leaf:
    """One array of a parameter as the planner sees it (a quantized weight is several: codes,
    scales, zero points, all with the parameter's axes) and its bytes per element."""

    path: tuple
    shape: tuple[int, ...]
    axes: tuple[str | None, ...]
    width: int
    widened: float = 0.0  # FP8 block / NVFP4 scales: float32s per stored scale in the host's copy

    @property
    def experts(self) -> int:
        """Routed experts along the leaf's experts axis (0: not a routed expert stack)."""
        return self.shape[self.axes.index("experts")] if "experts" in self.axes else 0


def parameter_leaves(family: ModelFamily, cfg, par: Parallelism, weights: str) -> list[Leaf]:
    """Every array of the bf16 model (main layers; heads padded for ``par``) with ``weights``'
    linears and experts quantized as the loader would hold them."""
    model = families.abstract(family, cfg, dtype=jnp.bfloat16, parallelism=par, mtp=0)
    kept = quantization.requested(WEIGHTS[weights], family.quantization(cfg), dummy=True)
    specs = family.param_spec(cfg, model)
    chosen = quantization.formats(model, specs, quantization.configured(kept))
    model = quantization.quantize(model, chosen, par.shards)
    axes = families.param_axes(model)
    leaves = []
    for path, variable in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        value = variable.get_value()
        copied = isinstance(value, QuantizedWeight) and (value.group[1] > 1 or value.format == "nvfp4")
        for array in jax.tree.leaves(value):
            widened = value.codes.shape[-1] / array.shape[-1] if copied and array is value.scales else 0.0
            leaves.append(Leaf(path, tuple(array.shape), axes[path], np.dtype(array.dtype).itemsize, widened))
    return leaves


def expert_shards(par: Parallelism) -> int:
    """Devices the routed experts are split over."""
    return math.prod(par.axis_sizes[a] for a in EXPERT_AXES)


def check_gpu_experts(leaves: list[Leaf], par: Parallelism, num_gpu_experts: int | None) -> None:
    """The server's rule for ``--num-gpu-experts``: at most the experts there are, a multiple of the
    devices they are split over."""
    total = max((leaf.experts for leaf in leaves), default=0)
    if num_gpu_experts is None or num_gpu_experts >= total:
        return
    pieces = expert_shards(par)
    if num_gpu_experts < 0 or num_gpu_experts % pieces:
        raise ValueError(
            f"--num-gpu-experts {num_gpu_experts}: routed experts are split over {pieces} devices; "
            f"choose a multiple of {pieces} from 0 to {total}"
        )


def gpu_share(leaf: Leaf, num_gpu_experts: int | None) -> float:
    """The share of a leaf on the GPUs: N of E for a routed expert stack, else all of it."""
    if num_gpu_experts is None or not leaf.experts:
        return 1.0
    return min(num_gpu_experts, leaf.experts) / leaf.experts


def host_expert_bytes(leaves: list[Leaf], num_gpu_experts: int | None) -> float:
    """Bytes of routed experts in host RAM (held once for the whole mesh), with the CPU kernel's
    float32 scales beside them: FP8 block scales widened to one per column, NVFP4's effective
    scales (one per e4m3 scale, :func:`jaxdsa.offload.cpu_moe.nvfp4_scales`)."""
    total = 0.0
    for leaf in leaves:
        share = 1.0 - gpu_share(leaf, num_gpu_experts)
        elements = math.prod(leaf.shape) * share
        total += elements * leaf.width + elements * leaf.widened * 4
    return total


def shard_elements(leaf: Leaf, par: Parallelism) -> float:
    return float(math.prod(shard_shape(leaf.shape, leaf.axes, par)))


def device_weight_bytes(
    family: ModelFamily,
    cfg,
    par: Parallelism,
    weights: str,
    leaves: list[Leaf] | None = None,
    num_gpu_experts: int | None = None,
) -> float:
    """Bytes of weights on one device (``leaves``: :func:`parameter_leaves`' answer, if at hand;
    ``num_gpu_experts``: routed experts per MoE layer kept on the GPUs, None: all)."""
    leaves = parameter_leaves(family, cfg, par, weights) if leaves is None else leaves
    return sum(shard_elements(leaf, par) * leaf.width * gpu_share(leaf, num_gpu_experts) for leaf in leaves)


def cache_bytes_per_token(
    family: ModelFamily, cfg, kv_format: str = "model", par: Parallelism | None = None
) -> float:
    """The cache rows of one token (bf16, or ``kv_format`` ``'fp8'``) at the family's default page
    size, per device (paged rows are replicated over tp and split over dp by sequence; an entry
    split over tp counts its device's part under ``par``)."""
    spec, page_size = family.cache_spec(cfg, kv_format), family.page_size(cfg, None)
    return spec.bytes_per_token(jnp.bfloat16, page_size, None if par is None else par.shards)


def cache_bytes_per_sequence(
    family: ModelFamily, cfg, kv_format: str = "model", par: Parallelism | None = None
) -> int:
    """bf16 / float32 rows a sequence holds whatever its length, per device under ``par``
    (DeepSeek-V4's rings, GLM-5.3-Flash's KDA states and conv rings, split over tp with the KDA
    heads; 0 for DSA)."""
    shards = None if par is None else par.shards
    return family.cache_spec(cfg, kv_format).sequence_bytes(jnp.bfloat16, shards=shards)


def expected_experts(n_experts: int, top_k: int, tokens: int) -> float:
    """Expected distinct experts used by ``tokens`` tokens that each pick ``top_k`` distinct experts
    uniformly at random (an expert is missed by one token with probability ``1 - top_k / n_experts``):
    what a decode step of random tokens reads on average. ``min(E, k * tokens)`` would be the most
    any batch can touch (at 32 tokens it counts all 256 of GLM-5's experts where uniform routing
    touches 163)."""
    return n_experts * (1.0 - (1.0 - top_k / n_experts) ** tokens)


def decode_step(
    family: ModelFamily,
    cfg,
    par: Parallelism,
    weights: str,
    batch: int,
    context: int,
    leaves: list[Leaf] | None = None,
    num_gpu_experts: int | None = None,
    kv_format: str = "model",
) -> dict[str, float]:
    """Per-device bytes read and collective bytes of one decode step of ``batch`` sequences per dp
    group: every weight the step touches (routed experts at :func:`expected_experts` of the tokens
    that meet at them, embedding rows looked up) plus the family's cache traffic (rows in
    ``kv_format``); and the host's reads of the touched experts it holds (``num_gpu_experts``).
    ``leaves``: :func:`parameter_leaves`' answer, if at hand."""
    traffic = family.decode_traffic(cfg, par, batch, context, kv_format)
    sizes = par.axis_sizes
    k, E = traffic["experts_per_token"], traffic["num_experts"]
    E_local = E / math.prod(sizes[a] for a in EXPERT_AXES)
    moe_tokens = batch * sizes["edp"]  # dp-attention groups' tokens meet at every expert
    touched = expected_experts(E, k, moe_tokens) * E_local / E  # expected distinct local experts
    read = host_read = 0.0
    for leaf in parameter_leaves(family, cfg, par, weights) if leaves is None else leaves:
        elements = shard_elements(leaf, par)
        if "experts" in leaf.axes:
            elements *= touched / E_local
            share = gpu_share(leaf, num_gpu_experts)
            # the host reads every touched expert it holds whole: touched / E_local of them all
            host_read += math.prod(leaf.shape) * touched / E_local * (1 - share) * leaf.width
            elements *= share
        if leaf.axes[0] == "vocab" and leaf.path[0] == "embed":
            elements *= batch / leaf.shape[0]  # a lookup reads only the rows it needs
        read += elements * leaf.width
    return {
        "bytes_read": read + traffic["cache_bytes_read"],
        "collective_bytes": traffic["collective_bytes"],
        "host_bytes_read": host_read,
    }


def memory_plan(
    family: ModelFamily,
    cfg,
    par: Parallelism,
    *,
    hbm_gib: float,
    weights: str,
    max_model_len: int,
    batch: int,
    gpu_memory_utilization: float = memory.DEFAULT_UTILIZATION,
    leaves: list[Leaf] | None = None,
    num_gpu_experts: int | None = None,
    kv_format: str = "model",
) -> dict[str, float]:
    """Each device's memory as the server counts it (:mod:`jaxdsa.engine.memory`): the budget is
    ``gpu_memory_utilization`` of ``hbm_gib``; the weights, the workspace kept for steps, and
    ``batch`` sequences' rings and penalty rows come out of it; the cache gets the rest. With
    ``num_gpu_experts`` the routed experts past N per layer count in host RAM instead; the cache
    holds rows in ``kv_format`` (``'model'``: bf16, or ``'fp8'``). ``leaves``:
    :func:`parameter_leaves`' answer, if at hand."""
    leaves = parameter_leaves(family, cfg, par, weights) if leaves is None else leaves
    check_gpu_experts(leaves, par, num_gpu_experts)
    weight_bytes = device_weight_bytes(family, cfg, par, weights, leaves, num_gpu_experts)
    budget = memory.check_utilization(gpu_memory_utilization) * hbm_gib * GiB
    workspace = memory.workspace_bytes(budget)
    per_token = cache_bytes_per_token(family, cfg, kv_format, par)
    per_sequence = cache_bytes_per_sequence(family, cfg, kv_format, par) + cfg.vocab_size * PENALTY_BYTES
    free = budget - weight_bytes - workspace - batch * per_sequence
    tokens_per_group = max(0, int(free // per_token))
    return {
        "devices": par.num_devices,
        "budget_gib_per_device": budget / GiB,
        "weights_gib_per_device": weight_bytes / GiB,
        "workspace_gib_per_device": workspace / GiB,
        "cache_bytes_per_token": per_token,
        "cache_bytes_per_sequence": per_sequence,
        "cache_gib_per_device": free / GiB,
        "cache_tokens_per_dp_group": tokens_per_group,
        "cache_tokens_total": tokens_per_group * par.dp,
        "full_length_sequences_per_dp_group": tokens_per_group // max_model_len,
        "host_experts_gib": host_expert_bytes(leaves, num_gpu_experts) / GiB,
    }


def plan(
    family: ModelFamily,
    cfg,
    par: Parallelism,
    *,
    hbm_gib: float,
    weights: str,
    max_model_len: int,
    batch: int,
    hbm_gbs: float,
    link_gbs: float,
    gpu_memory_utilization: float = memory.DEFAULT_UTILIZATION,
    num_gpu_experts: int | None = None,
    host_gbs: float = 100.0,
    kv_format: str = "model",
) -> dict[str, float]:
    """The deployment's figures per device: :func:`memory_plan`'s, then one decode step's traffic
    and its roofline at ``hbm_gbs`` and ``link_gbs``, and with host experts their reads at
    ``host_gbs`` (added to the step: the GPU waits for the host's experts of each layer)."""
    leaves = parameter_leaves(family, cfg, par, weights)  # the abstract model, built once for both
    result = memory_plan(
        family, cfg, par, hbm_gib=hbm_gib, weights=weights, max_model_len=max_model_len, batch=batch,
        gpu_memory_utilization=gpu_memory_utilization, leaves=leaves, num_gpu_experts=num_gpu_experts,
        kv_format=kv_format,
    )  # fmt: skip
    step = decode_step(family, cfg, par, weights, batch, max_model_len, leaves, num_gpu_experts, kv_format)
    memory_s = step["bytes_read"] / (hbm_gbs * 1e9)
    comm_s = step["collective_bytes"] / (link_gbs * 1e9)
    host_s = step["host_bytes_read"] / (host_gbs * 1e9)
    return result | {
        "decode_bytes_read_gib_per_device": step["bytes_read"] / GiB,
        "decode_collective_mib_per_device": step["collective_bytes"] / (1 << 20),
        "decode_host_bytes_read_gib": step["host_bytes_read"] / GiB,
        "decode_step_ms_roofline": 1e3 * (memory_s + comm_s + host_s),
        "decode_tok_s_roofline": batch * par.dp / (memory_s + comm_s + host_s),
    }


def fits(result: dict[str, float], max_model_len: int) -> bool:
    """Whether one ``max_model_len`` sequence's cache fits beside the weights (the server's test)."""
    return result["cache_tokens_per_dp_group"] >= max_model_len


def verdict(result: dict[str, float], max_model_len: int) -> str:
    """One line: fits with how many cache tokens, or short by how much per GPU."""
    if fits(result, max_model_len):
        return (
            f"fits: {result['cache_tokens_total']:,} cache tokens "
            f"({result['full_length_sequences_per_dp_group']:,} sequences of {max_model_len:,} per dp group)"
        )
    need = max_model_len * result["cache_bytes_per_token"] / GiB
    return (
        f"does not fit: short by {need - result['cache_gib_per_device']:.2f} GiB per GPU "
        f"(weights {result['weights_gib_per_device']:.2f} GiB of a {result['budget_gib_per_device']:.2f} "
        f"GiB budget; one {max_model_len:,}-token sequence needs {need:.2f} GiB of cache)"
    )


def fewest_gpus(family: ModelFamily, cfg, *, max_model_len: int, **memory_kwargs) -> int | None:
    """The fewest GPUs (of :data:`LAYOUTS`, as ``-tp N -ep N``) the deployment fits on; None: none.
    ``memory_kwargs``: the rest of :func:`memory_plan`'s arguments."""
    for n in LAYOUTS:
        try:
            par = Parallelism(tp=n, ep=n)
            result = memory_plan(family, cfg, par, max_model_len=max_model_len, **memory_kwargs)
        except ValueError:  # a split the model's dims do not allow (experts over N shards)
            continue
        if fits(result, max_model_len):
            return n
    return None


def gpu_experts_that_fit(
    family: ModelFamily,
    cfg,
    par: Parallelism,
    *,
    max_model_len: int,
    leaves: list[Leaf] | None = None,
    **memory_kwargs,
) -> tuple[int, int] | None:
    """(the most routed experts per MoE layer the GPUs hold with one ``max_model_len`` sequence's
    cache beside them, a multiple of the devices the experts are split over; of how many), or None
    when the model does not fit even with every routed expert in host RAM. ``leaves``:
    :func:`parameter_leaves`' answer, if at hand; ``memory_kwargs``: the rest of
    :func:`memory_plan`'s arguments."""
    leaves = parameter_leaves(family, cfg, par, memory_kwargs["weights"]) if leaves is None else leaves
    total, pieces = max((leaf.experts for leaf in leaves), default=0), expert_shards(par)

    def fit(n: int) -> bool:
        kwargs = dict(memory_kwargs, leaves=leaves, num_gpu_experts=n)
        return fits(memory_plan(family, cfg, par, max_model_len=max_model_len, **kwargs), max_model_len)

    if not fit(0):
        return None
    lo, hi = 0, total // pieces  # in units of ``pieces``: fit(lo * pieces) holds
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fit(mid * pieces) else (lo, mid - 1)
    return lo * pieces, total


def _host_line(family: ModelFamily, cfg, par: Parallelism, *, max_model_len: int, **memory_kwargs) -> str:
    """What fits with routed experts in host RAM, for a model the GPUs do not hold whole."""
    leaves = parameter_leaves(family, cfg, par, memory_kwargs["weights"])  # built once for both
    sizes = dict(memory_kwargs, max_model_len=max_model_len, leaves=leaves)
    found = gpu_experts_that_fit(family, cfg, par, **sizes)
    if found is None:
        return "with routed experts in host RAM: does not fit even with all of them there"
    n, total = found
    host = host_expert_bytes(leaves, n) / GiB
    return (
        f"with routed experts in host RAM: fits with --num-gpu-experts {n} of {total} per MoE layer, "
        f"{host:,.1f} GiB of experts in host RAM"
    )


def _state_line(family: ModelFamily, cfg, par: Parallelism, kv_format: str, batch: int) -> str | None:
    """What the per-sequence state takes, for a family that keeps one: its rings and recurrent states
    are held whatever a sequence's length, so ``--batch`` of them come out of the budget before the
    cache pages (None: no such state)."""
    per_sequence = cache_bytes_per_sequence(family, cfg, kv_format, par)
    if not per_sequence:
        return None
    return (
        f"per-sequence state: {per_sequence / MiB:,.1f} MiB a sequence per device (rings and recurrent "
        f"states, whatever its length); {batch * per_sequence / GiB:.2f} GiB for --batch {batch}, set "
        "aside before the cache pages"
    )


def _fewest_line(n: int | None, hbm_gib: float) -> str:
    if n is None:
        return f"fewest GPUs: none up to {LAYOUTS[-1]} of {hbm_gib:g} GiB"
    line = f"fewest GPUs: {n} of {hbm_gib:g} GiB (-tp {n} -ep {n})"
    if n > HOST_GPUS:
        line += f"; more than one host of {HOST_GPUS}, which python -m serve does not span"
    return line


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m jaxdsa.plan", description=__doc__.split("\n\n")[0])
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--config", help="config.json (or the checkpoint directory)")
    source.add_argument("--preset", choices=sorted(RELEASED), help="a released model's config, shipped here")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--ep", type=int, default=1)
    p.add_argument("--dp", type=int, default=1)
    p.add_argument(
        "--dp-attention", action="store_true", help="the dp groups share the experts (ep counts all shards)"
    )
    p.add_argument("--hbm-gib", type=float, default=80)
    p.add_argument(
        "--weights",
        choices=sorted(WEIGHTS),
        default="auto",
        help="auto: the config's own format (what the server keeps); bf16, fp8, int4, nvfp4: that one",
    )
    p.add_argument("--max-model-len", type=int, default=32768)
    p.add_argument(
        "--kv-cache-dtype",
        default="auto",
        help="auto (bf16 rows) or fp8 (the released engines' FP8 layouts), as the server's flag",
    )
    p.add_argument(
        "--batch", type=int, default=32, help="decode sequences per dp group for the step estimate"
    )
    p.add_argument("--hbm-gbs", type=float, default=3000, help="achievable HBM bandwidth (H100 copy: ~3000)")
    p.add_argument("--link-gbs", type=float, default=350, help="achievable all-reduce bus bandwidth per GPU")
    p.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=memory.DEFAULT_UTILIZATION,
        help="share of each GPU the server may take (its flag of the same name)",
    )
    p.add_argument(
        "--num-gpu-experts",
        type=int,
        default=None,
        help="routed experts per MoE layer kept on the GPUs, the rest in host RAM (default: all)",
    )
    p.add_argument(
        "--host-gbs",
        type=float,
        default=100,
        help="host RAM read bandwidth for the host experts (the 4 x H100 machine's host: ~130)",
    )
    args = p.parse_args(argv)
    for flag in ("max_model_len", "batch", "hbm_gib", "hbm_gbs", "link_gbs", "host_gbs"):
        if getattr(args, flag) <= 0:
            p.error(f"--{flag.replace('_', '-')} must be > 0")
    try:
        memory.check_utilization(args.gpu_memory_utilization)
        cfg = released_config(args.preset) if args.preset else load_config(args.config)
        family = family_for(cfg.model_type)
        par = Parallelism(tp=args.tp, ep=args.ep, dp=args.dp, dp_attention=args.dp_attention)
        sizes = dict(
            hbm_gib=args.hbm_gib,
            weights=args.weights,
            max_model_len=args.max_model_len,
            batch=args.batch,
            gpu_memory_utilization=args.gpu_memory_utilization,
            kv_format=kv_cache_format(args.kv_cache_dtype, jnp.bfloat16),
        )
        result = plan(
            family, cfg, par, hbm_gbs=args.hbm_gbs, link_gbs=args.link_gbs, host_gbs=args.host_gbs,
            num_gpu_experts=args.num_gpu_experts, **sizes,
        )  # fmt: skip
    except ValueError as e:
        print(f"plan: {e}", file=sys.stderr)
        return 2
    dp_attention = " (dp attention)" if par.dp_attention else ""
    stored = family.quantization(cfg)
    weights = args.weights
    if weights == "auto":
        fp4 = ", fp4 experts" if stored and getattr(cfg, "expert_dtype", None) == "fp4" else ""
        weights = f"auto ({stored.method if stored else 'bf16'}{fp4})"
    print(
        f"{args.preset or cfg.model_type}: {cfg.num_hidden_layers} layers; "
        f"tp={par.tp} ep={par.ep} dp={par.dp}{dp_attention}, weights {weights}, "
        f"kv cache {'fp8' if sizes['kv_format'] == 'fp8' else 'bf16'}, "
        f"{args.hbm_gib:g} GiB GPUs at --gpu-memory-utilization {args.gpu_memory_utilization:g}"
    )
    for key, value in result.items():
        print(f"  {key:38s} {value:,.2f}" if isinstance(value, float) else f"  {key:38s} {value:,}")
    state = _state_line(family, cfg, par, sizes["kv_format"], args.batch)
    if state:
        print(state)
    print(verdict(result, args.max_model_len))
    if args.num_gpu_experts is None and not fits(result, args.max_model_len):
        print(_host_line(family, cfg, par, **sizes))
    print(_fewest_line(fewest_gpus(family, cfg, **sizes), args.hbm_gib))
    return 0 if fits(result, args.max_model_len) else 1


if __name__ == "__main__":
    sys.exit(main())
