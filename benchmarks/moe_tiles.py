"""Decode-sized routed experts, tile config by tile config: each kernel's own time, from a trace.

The MoE counterpart of :mod:`benchmarks.linear_tiles` (which says why kernel durations, not a
host-timed loop): one GPU's share of a preset's routed experts under ``--tp`` (every expert with
1/tp of its intermediate width, as ``-tp`` serving without expert parallelism holds them), quantized
as the loader keeps them (INT4 in words), at ``--tokens`` tokens of top-k routing. Each call routes
its tokens to fresh random experts (``copies`` routings in one ``fori_loop``, one kernel compile per
variant), so the touched experts' weights come from HBM, as in a step.

Per (T, variant): the ``moe_gate_up`` and ``moe_down`` kernels' mean durations, the call's other
kernels (routing metadata, the weighted combine) per call, the sum, and the touched experts' bytes
over the sum as GB/s and % of the read ceiling. Every variant is first checked against the float32
definition (rel L2 <= 1e-2).

Variants (``--variants``, ``name:field=value+field=value``; ``base`` is the tuning table's):
fields of :class:`pallas_kernels.moe.tuning.MoeConfig` (``block_m``, ``splits``) or of its tiles,
both kernels' (``num_warps``) or one kernel's with a ``gu_`` / ``dn_`` prefix (``dn_block_n=64``).

    python -m benchmarks.moe_tiles --tp 4 --tokens 1,8 [--suffix -x]

Writes ``benchmarks/results/moe_tiles-<gpu><suffix>.md`` and ``.json``.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import tempfile
import time
from typing import Any

import jax
import jax.numpy as jnp

from benchmarks import anatomy, harness, linear_tiles, quant
from benchmarks.serve_gpu import PRESETS
from pallas_kernels.moe import kernel as moe_kernel

KERNELS = ("moe_gate_up", "moe_down")
DEFAULT_VARIANTS = (
    "base,w4:num_warps=4,gu_n64:gu_block_n=64,dn_n64:dn_block_n=64,dn_n256:dn_block_n=256,"
    "s2:splits=2,s8:splits=8,st2:num_stages=2,st4:num_stages=4,dn_w4:dn_num_warps=4,"
    "dn_n64w4:dn_block_n=64+dn_num_warps=4"
)
COPIES = 16  # routings per call: 16 x top-8 experts of 256 touch most of the stack


def expert_shapes(raw: dict, tp: int) -> dict[str, int]:
    """Experts, top-k, model width and one GPU's share of an expert's intermediate width."""
    return {
        "experts": raw["n_routed_experts"],
        "top_k": raw["num_experts_per_tok"],
        "hidden": raw["hidden_size"],
        "width": raw["moe_intermediate_size"] // tp,
    }


def _config(variant: linear_tiles.Variant, base):
    changes = {key: int(value) for key, value in variant.fields}
    return quant.moe_variant(**changes)(base) if changes else base


def _routings(key, copies: int, t: int, shapes: dict):
    kx, ki, kw = jax.random.split(key, 3)
    x = jax.random.normal(kx, (t, shapes["hidden"]), jnp.bfloat16)
    scores = jax.random.uniform(ki, (copies, t, shapes["experts"]))
    ids = jax.lax.top_k(scores, shapes["top_k"])[1].astype(jnp.int32)
    weights = jax.nn.softmax(jax.random.normal(kw, (copies, t, shapes["top_k"])), axis=-1)
    return x, ids, weights


def _all_routings(config, copies: int, interpret: bool):
    """Every routing's experts in one ``fori_loop``; returns the first routing's output (checked)."""

    def run(x, ids, weights, experts):
        call = lambda i: moe_kernel.moe_experts(  # noqa: E731
            x, ids[i], weights[i], experts, config=config, interpret=interpret
        )
        first = call(0)
        last = jax.lax.fori_loop(1, copies, lambda i, _: call(i), first)
        return first, last

    return run


def run(
    raw: dict,
    *,
    tp: int,
    tokens: tuple[int, ...],
    variants: list[linear_tiles.Variant],
    reps: int = 3,
    interpret: bool = False,
    threads: int = 8,
    copies: int = COPIES,
) -> tuple[list[dict[str, Any]], float]:
    """Every (T, variant) row and the read ceiling (GB/s); ``interpret``: checks only."""
    shapes = expert_shapes(raw, tp)
    ceiling = harness.read_ceiling_gbs(1 << 20 if interpret else 1 << 30)
    e, d, n = shapes["experts"], shapes["hidden"], shapes["width"]
    keys = jax.random.split(jax.random.key(0), 2)
    experts = {
        "gate_up": quant.random_weight(keys[0], "int4", (e,), d, 2 * n),
        "down": quant.random_weight(keys[1], "int4", (e,), n, d),
    }
    per_expert = (quant.weight_bytes(experts["gate_up"]) + quant.weight_bytes(experts["down"])) / e
    copies = 2 if interpret else copies
    rows = []
    for t in tokens:
        x, ids, weights = _routings(jax.random.key(t), copies, t, shapes)
        want = quant._moe_rows(x, ids[0], weights[0], experts)
        touched = sum(len(set(ids[i].ravel().tolist())) for i in range(copies)) / copies
        mb = touched * per_expert / 1e6
        base = moe_kernel.default_config(x, ids[0], experts)
        configs = [(v.name, _config(v, base)) for v in variants]
        items = [(_all_routings(cfg, copies, interpret), (x, ids, weights, experts)) for _, cfg in configs]
        t0 = time.perf_counter()
        compiled = linear_tiles._compile(items, threads)
        print(f"moe_tiles: T={t}: {len(items)} compiled in {time.perf_counter() - t0:.0f} s", flush=True)
        entries = [
            ({"T": t, "impl": name, "MB": mb, "config": _cfg_text(cfg)}, exe, args)
            for (name, cfg), exe, (_, args) in zip(configs, compiled, items)
        ]
        runs, meta = linear_tiles.checked(entries, want, rows)
        if interpret:
            rows.extend(meta)
            continue
        with tempfile.TemporaryDirectory() as directory:
            events, ranges = linear_tiles._trace_ranges(runs, reps, directory)
        groups = anatomy.launched_in(events, anatomy.device_kernels(events, "/device:GPU:0"), ranges)
        for row, group in zip(meta, groups or [[] for _ in runs]):
            times = kernel_times(group, copies * reps)
            gbs = row["MB"] * 1e3 / times["total_us"]
            rows.append(row | times | {"GB/s": gbs, "% ceiling": 100 * gbs / ceiling})
    return rows, ceiling


def kernel_times(group: list[dict], calls: int) -> dict[str, float]:
    """Per call: each of :data:`KERNELS`' time (µs; a kernel launched twice, as a prefill's two
    block sizes, counts both), the other kernels', and the sum; copies and memsets left out (the
    loop's trip count)."""
    group = linear_tiles.without_copies(group)
    out = {
        f"{name}_us": sum(k.get("dur", 0) for k in group if k["name"].startswith(name)) / calls
        for name in KERNELS
    }
    total = sum(k.get("dur", 0) for k in group) / calls
    return out | {"other_us": total - sum(out.values()), "total_us": total}


def _cfg_text(cfg) -> str:
    gu, dn = cfg.gate_up, cfg.down
    return (
        f"m{cfg.block_m} s{cfg.splits} gu n{gu.block_n} k{gu.block_k} w{gu.num_warps} st{gu.num_stages}"
        f" / dn n{dn.block_n} k{dn.block_k} w{dn.num_warps} st{dn.num_stages}"
    )


def report(rows: list[dict], ceiling: float, args: argparse.Namespace, wall_s: float) -> str:
    header = harness.device_header() | {
        "preset": f"{args.preset}'s routed experts at -tp {args.tp} (no EP), INT4 in words",
        "read ceiling (jax sum(x))": f"{ceiling:.0f} GB/s",
        "routings per call": str(COPIES),
        "benchmark wall time": f"{wall_s:.0f} s",
        "XLA_FLAGS": os.environ.get("XLA_FLAGS", "(none)"),
    }
    cols = ["T", "impl", "config", "MB", *(f"{k}_us" for k in KERNELS), "other_us", "total_us"]
    cols += ["GB/s", "% ceiling", "rel_err", "note"]
    lines = harness.report_header("Decode-sized routed experts by tile config (kernel time, traced)", header)
    lines += [
        "",
        "MB: the touched experts' bytes per call (mean distinct experts x one expert's gate|up + down);",
        "other_us: the call's other kernels (routing metadata, combine).",
        "",
        linear_tiles.table(rows, cols),
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> pathlib.Path:
    p = linear_tiles.sweep_args(__doc__.splitlines()[0], "1,8")
    p.add_argument("--variants", default=DEFAULT_VARIANTS)
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    rows, ceiling = run(
        PRESETS[args.preset],
        tp=args.tp,
        tokens=tuple(int(t) for t in args.tokens.split(",")),
        variants=linear_tiles.parse_variants(args.variants),
        reps=args.reps,
        threads=args.threads,
    )
    path = harness.write_result(
        "moe_tiles", report(rows, ceiling, args, time.perf_counter() - t0), args.suffix, rows=rows
    )
    print(path.read_text())
    return path


if __name__ == "__main__":
    main()
