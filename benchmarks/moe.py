"""GPU benchmark: MoE routed experts at GLM-5 shapes (E=256, top-8, D=6144, N=2048, bf16).

Run ``python -m benchmarks.moe`` on a GPU (or call :func:`run` from a batched driver). Per token
count T in {1, 8, 32, 128, 512, 4096} it times, in one process and on one set of weights:

* ``pallas``: :func:`pallas_kernels.moe.kernel.moe_experts` with the tuning table's config, and a
  small sweep of tile variants (``pallas*`` rows; the best one per T is marked);
* ``ragged_dot``: the pure-JAX reference (:mod:`pallas_kernels.moe.ref`), T <= 128 only: XLA
  multiplies every slot against all 256 experts, ~0.1 s+ per call at T = 512 (anchors);
* ``gather``: ``jnp.take`` of the selected experts' weights then einsum, T <= 32 only (the
  gathered copies are T * 8 * 75 MB); ``MOE_REFERENCE_MAX_T`` lowers both limits;
* ``torch _grouped_mm`` (with ``torch_peers``): :func:`benchmarks.peers.grouped_moe` on the same
  weight, token, id and weight buffers, checked and timed as ours.

Method (docs/anchors.md): weights N(0,1)/sqrt(fan_in) drawn once on the
device (19.3 GB), activations N(0,1), 8 distinct uniform experts per token; each implementation
is checked against a float32 per-row reference on up to 32 sampled rows (rel L2 <= 1e-2) before
it is timed; time = one jit over R distinct input sets / R, median of replays
(:func:`benchmarks.harness.time_op`). bytes = distinct experts touched (mean over the R sets) x
3*D*N*2 + x and out; flops = T*8*2*D*N*3. Percentages are of the ceilings passed in (or measured
here; :class:`benchmarks.harness.Ceilings`), ``floor us`` = bytes at the memory ceiling; the
``(anchor)`` column is torch from ``docs/anchors.md`` (2026-11-21, another
process, CUDA events), not measured in this run. R = 8 for
T <= 128, 2 for T = 512, 1 for T = 4096. Pass 1 runs the table config and the baselines at
every T; pass 2 sweeps the variants, largest T first, and starts none after ``BUDGET_S``
seconds (skipped ones are listed), so one call stays within ~4 minutes of GPU time. With
``MOE_ROUNDS=n`` pass 2 times the table config and every variant n times round-robin and reports
medians: the variants then share the machine's drift, and differences of ~1 % can be told apart
(one config's time varied 3-5 % between calls, 0.2-0.3 % between interleaved rounds).
Writes ``benchmarks/results/moe-<gpu>.md`` (a summary per T, then every row).
"""

from __future__ import annotations

import dataclasses
import os
import time
import traceback
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import harness
from pallas_kernels.moe import kernel, ref, tuning
from pallas_kernels.moe.tuning import MoeConfig, Tile

E, TOP_K, D, N = 256, 8, 6144, 2048
ALL_TOKENS = (1, 8, 32, 128, 512, 4096)
# MOE_TOKENS=4096,512 runs only those T (a sweep, written to moe-<gpu>-sweep.md).
TOKENS = (
    tuple(int(t) for t in os.environ["MOE_TOKENS"].split(",")) if os.environ.get("MOE_TOKENS") else ALL_TOKENS
)
# torch _grouped_mm, us (docs/anchors.md, 2026-11-21, H100)
TORCH_GROUPED_ANCHOR_US = {1: 302.2, 8: 1646.8, 32: 4534.4, 128: 6879.7, 512: 7427.5, 4096: 13435.5}
EXPERT_BYTES = 3 * D * N * 2
TOLERANCE = 1e-2
BUDGET_S = float(os.environ.get("MOE_BUDGET_S", "180"))  # no new sweep variant starts after this many seconds
ROUNDS = int(os.environ.get("MOE_ROUNDS", "1"))  # > 1: pass 2 re-times table and variants round-robin
REFERENCE_MAX_T = int(os.environ.get("MOE_REFERENCE_MAX_T", "128"))  # ragged_dot up to this T (gather: 32)
DIAGNOSTICS = os.environ.get("MOE_DIAGNOSTICS", "1") == "1"  # phase split and skewed routing at T >= 512

# Sweep variants per regime (block_m <= 32: weight streaming; 64+: tensor-core tiles). Sized for
# the H100's 227 KiB of shared memory; a variant that fails to compile is reported, not fatal.
# Listed most promising first: when the time budget runs out, the tail of a list is skipped.
STREAM_VARIANTS = {
    # H100's table: narrow with fewer slots than experts (T <= 8), wide above; each is the other's variant.
    "narrow": (Tile(64, 128, 4, 4), Tile(64, 128, 4, 4)),
    "wide_n": (Tile(128, 64, 4, 4), Tile(128, 64, 4, 4)),
    "s3_2cta": (Tile(64, 128, 4, 3), Tile(64, 128, 4, 3)),  # 108 KiB: two programs per SM
    "8warps": (Tile(64, 128, 8, 4), Tile(128, 128, 8, 3)),
}
COMPUTE_VARIANTS = {
    "bm128": MoeConfig(128, Tile(128, 64, 8, 4), Tile(128, 64, 8, 3)),  # H100's table at T = 4096
    "absorb32": MoeConfig(128, Tile(128, 64, 8, 4), Tile(128, 64, 8, 3), absorb_m=32),
    "absorb32_dn_n256": MoeConfig(128, Tile(128, 64, 8, 4), Tile(256, 64, 8, 3), absorb_m=32),
    "dn_n256": MoeConfig(128, Tile(128, 64, 8, 4), Tile(256, 64, 8, 3)),
    "gu_s3": MoeConfig(128, Tile(128, 64, 8, 3), Tile(128, 64, 8, 3)),
}
# Dropped after sweeps on H100 and H200 (moe-h100-sweep-*.md, moe-h200-sweep.md), slower at every
# T they ran: long_k (32x256 / 64x256), 128-row K steps, 256-row blocks, 64-wide gate|up tiles,
# 64-row blocks at two programs per SM (4 warps, 2-4 stages); at T = 4096 down tiles 128x128/w8s2,
# 128x32/w8s6, 64x64/w4s4, 256x32/w8s4 and gate|up 128x32/w8s8, 64x64/w4s4 (sweep 5, rounds).
# 128x64/w4s3 down tiles tied the table there.


def _describe(cfg: MoeConfig) -> str:
    t = lambda x: f"{x.block_n}x{x.block_k}/w{x.num_warps}s{x.num_stages}"  # noqa: E731
    default = MoeConfig(cfg.block_m, cfg.gate_up, cfg.down)
    shrink = "" if cfg.min_block_m == default.min_block_m else f" min_m{cfg.min_block_m}"
    absorb = "" if cfg.absorb_m == default.absorb_m else f" absorb{cfg.absorb_m}"
    return f"bm{cfg.block_m} gu {t(cfg.gate_up)} dn {t(cfg.down)}{shrink}{absorb}"


def _table(t: int) -> MoeConfig:
    """The tuning table's config for T tokens (bf16)."""
    return tuning.choose(t * TOP_K, E, itemsize=2)


def _variants(t: int) -> dict[str, MoeConfig]:
    base = _table(t)
    out: dict[str, MoeConfig] = {}
    if base.block_m <= 32:
        out |= {name: MoeConfig(base.block_m, gu, dn) for name, (gu, dn) in STREAM_VARIANTS.items()}
    if base.block_m >= 32:
        out |= COMPUTE_VARIANTS
    out["no_shrink"] = dataclasses.replace(base, min_block_m=base.block_m)  # tail blocks at full height
    return {name: cfg for name, cfg in out.items() if cfg != base}


def _reps(t: int) -> int:
    return 8 if t <= 128 else (2 if t <= 512 else 1)


@jax.jit
def _make_weights(key):
    """Packed weights drawn expert by expert (no f32 copy of the 19.3 GB)."""

    def one(i):
        kg, kd = jax.random.split(jax.random.fold_in(key, i))
        gate_up = jax.random.normal(kg, (D, 2 * N), jnp.bfloat16) * jnp.bfloat16(D**-0.5)
        down = jax.random.normal(kd, (N, D), jnp.bfloat16) * jnp.bfloat16(N**-0.5)
        return gate_up, down

    gate_up, down = jax.lax.map(one, jnp.arange(E))
    return {"gate_up": gate_up, "down": down}


def _make_inputs(key, t: int):
    kx, ki, kw = jax.random.split(key, 3)
    x = jax.random.normal(kx, (t, D), jnp.bfloat16)
    ids = jax.lax.top_k(jax.random.uniform(ki, (t, E)), TOP_K)[1].astype(jnp.int32)  # distinct
    w = jax.nn.softmax(jax.random.normal(kw, (t, TOP_K)), axis=-1)
    return x, ids, w


@jax.jit
def _f32_rows(x, ids, w, experts):
    """Float32 per-row reference (HIGHEST precision, bf16 weights upcast), one row at a time."""

    def one(args):
        xr, idr, wr = args
        gu = jnp.take(experts["gate_up"], idr, axis=0).astype(jnp.float32)
        h = jnp.einsum("d,jdn->jn", xr.astype(jnp.float32), gu, precision=jax.lax.Precision.HIGHEST)
        act = jax.nn.silu(h[:, :N]) * h[:, N:]
        dn = jnp.take(experts["down"], idr, axis=0).astype(jnp.float32)
        y = jnp.einsum("jn,jnd->jd", act, dn, precision=jax.lax.Precision.HIGHEST)
        return (wr[:, None] * y).sum(0)

    return jax.lax.map(one, (x, ids, w))


def _gather_moe(x, ids, w, experts):
    """Weight-gather path: copy the selected experts' weights, then batched mat-vecs."""
    t = x.shape[0]
    flat = ids.reshape(-1)
    xs = jnp.repeat(x, TOP_K, axis=0)
    h = jnp.einsum(
        "sd,sdn->sn", xs, jnp.take(experts["gate_up"], flat, axis=0), preferred_element_type=jnp.float32
    )
    act = (jax.nn.silu(h[:, :N]) * h[:, N:]).astype(x.dtype)
    y = jnp.einsum(
        "sn,snd->sd", act, jnp.take(experts["down"], flat, axis=0), preferred_element_type=jnp.float32
    )
    return (y.reshape(t, TOP_K, D) * w[..., None]).sum(1).astype(x.dtype)


def _measure(name: str, fn: Callable, case: _Case, *, replays: int) -> dict[str, Any]:
    """Check fn on set 0 (sampled rows vs the f32 reference, all-finite), then time it."""
    row = case.common | {"impl": name}
    try:
        out = jax.jit(fn)(*case.sets[0])
        finite = bool(jnp.isfinite(out.astype(jnp.float32)).all())
        err = harness.rel_l2(out[case.rows], case.want) if finite else float("inf")
        if err > TOLERANCE:
            return row | {"rel_err": err, "note": f"FAILED check (rel L2 {err:.2e})"}
        sec = harness.time_op(fn, case.sets, replays=replays, warmup=2)
    except Exception as exc:  # noqa: BLE001 - one failing variant must not end the batched run
        traceback.print_exc()
        return row | {"note": f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"}
    print(f"moe T={case.t} {name}: {sec * 1e6:.1f} us, {case.mb * 1e-3 / sec:.0f} GB/s, rel {err:.1e}")
    return row | {"rel_err": err} | _rates(case, sec)


def _rates(case: _Case, sec: float) -> dict[str, float]:
    gbs = case.mb * 1e6 / sec / 1e9
    tflops = case.gflop / sec / 1e3
    return {
        "us": sec * 1e6,
        "GB/s": gbs,
        "% stream": 100 * gbs / case.ceilings.stream_gbs,
        "TFLOP/s": tflops,
        "% mm": 100 * tflops / case.ceilings.matmul_tflops,
    }


@dataclasses.dataclass
class _Case:
    """One token count: R input sets, the rows checked and their float32 reference."""

    t: int
    sets: list
    rows: np.ndarray
    want: jax.Array
    distinct: float  # experts touched, mean over the R sets
    ceilings: harness.Ceilings

    @property
    def mb(self) -> float:
        return (self.distinct * EXPERT_BYTES + 2 * self.t * D * 2) / 1e6

    @property
    def gflop(self) -> float:
        return self.t * TOP_K * 2 * D * N * 3 / 1e9

    @property
    def common(self) -> dict[str, Any]:
        floor_us = self.mb / self.ceilings.stream_gbs * 1e3
        return {"T": self.t, "distinct experts": self.distinct, "MB": self.mb, "floor us": floor_us}


def _case(t: int, experts: dict, ceilings: harness.Ceilings) -> _Case:
    keys = jax.random.split(jax.random.key(100 + t), _reps(t))
    sets = [(*_make_inputs(k, t), experts) for k in keys]
    distinct = float(np.mean([np.unique(np.asarray(s[1])).size for s in sets]))
    rows = np.arange(t) if t <= 32 else np.sort(np.random.default_rng(t).choice(t, 32, replace=False))
    x0, ids0, w0, _ = sets[0]
    want = _f32_rows(x0[rows], ids0[rows], w0[rows], experts)
    return _Case(t, sets, rows, want, distinct, ceilings)


def _with_config(cfg: MoeConfig) -> Callable:
    return lambda x, ids, w, ex: kernel.moe_experts(x, ids, w, ex, config=cfg)


def _pallas(case: _Case, name: str, cfg: MoeConfig) -> dict[str, Any]:
    return _measure(f"pallas:{name}", _with_config(cfg), case, replays=20 if case.t <= 512 else 10) | {
        "config": _describe(cfg)
    }


def _sweep(case: _Case, start: float) -> list[dict[str, Any]]:
    """Pass 2 for one T: every variant once, or with ``ROUNDS`` > 1 the table config (as
    ``table@rounds``) and every variant ``ROUNDS`` times round-robin, each row the median."""
    configs = _variants(case.t)
    if ROUNDS > 1:
        configs = {"table@rounds": _table(case.t)} | configs
    rows: dict[str, dict[str, Any]] = {}
    times: dict[str, list[float]] = {}
    for rnd in range(ROUNDS):
        for name, cfg in configs.items():
            if rnd == 0 and time.perf_counter() - start > BUDGET_S:
                rows[name] = case.common | {
                    "impl": f"pallas:{name}",
                    "config": _describe(cfg),
                    "note": harness.SKIPPED,
                }
            elif rnd == 0:
                rows[name] = _pallas(case, name, cfg)
                if "us" in rows[name]:
                    times[name] = [rows[name]["us"] * 1e-6]
            elif name in times:
                times[name].append(harness.time_op(_with_config(cfg), case.sets, replays=10))
    for name, secs in times.items():
        if len(secs) > 1:
            note = "rounds: " + " / ".join(f"{s * 1e6:.0f}" for s in secs)
            rows[name] |= _rates(case, float(np.median(secs))) | {"note": note}
    return list(rows.values())


def _phases(case: _Case) -> list[dict[str, Any]]:
    """Where the table config's time goes: routing alone, then routing + gate|up; the rest of
    ``pallas:table`` is down + combine."""
    cfg = _table(case.t)

    def routed(x, ids, w, ex):
        return kernel.route(ids, E, cfg.block_m)

    def activated(x, ids, w, ex):
        return kernel.gate_up(x, kernel.route(ids, E, cfg.block_m), ex["gate_up"], cfg, top_k=TOP_K)

    rows = []
    for name, fn in (("phase: routing", routed), ("phase: routing + gate_up", activated)):
        us = harness.time_op(fn, case.sets, replays=10) * 1e6
        print(f"moe T={case.t} {name}: {us:.1f} us")
        rows.append(case.common | {"impl": name, "config": _describe(cfg), "us": us})
    return rows


def _skewed(case: _Case, experts: dict) -> dict[str, Any]:
    """The table config under uneven routing: expert popularity falling off along the expert
    index (Gumbel scores plus a linear bias), as an unbalanced router would route."""
    kx, ki = jax.random.split(jax.random.key(200 + case.t))
    x = jax.random.normal(kx, (case.t, D), jnp.bfloat16)
    scores = jax.random.gumbel(ki, (case.t, E)) + jnp.linspace(3.0, 0.0, E)
    ids = jax.lax.top_k(scores, TOP_K)[1].astype(jnp.int32)
    w = jax.nn.softmax(jax.random.normal(kx, (case.t, TOP_K)), axis=-1)
    counts = np.bincount(np.asarray(ids).reshape(-1), minlength=E)
    skewed = dataclasses.replace(
        case,
        sets=[(x, ids, w, experts)],
        want=_f32_rows(x[case.rows], ids[case.rows], w[case.rows], experts),
        distinct=float((counts > 0).sum()),
    )
    cfg = _table(case.t)
    row = _measure("skewed routing: table", _with_config(cfg), skewed, replays=10) | {
        "config": _describe(cfg)
    }
    return row | {"note": f"slots per expert {counts.min()}-{counts.max()}"}


def run(ceilings: harness.Ceilings | None = None, *, torch_peers: bool = False) -> list[dict]:
    """All rows (T x implementation); ``ceilings`` are measured here when not passed.

    Pass 1 runs the tuning table's config and the baselines at every T; pass 2 sweeps the tile
    variants, largest T first (the least certain configs), while ``BUDGET_S`` lasts.
    """
    start = time.perf_counter()
    ceilings = ceilings or harness.measure_ceilings(torch_peers)
    experts = jax.block_until_ready(_make_weights(jax.random.key(0)))
    print(f"moe: weights at {time.perf_counter() - start:.0f}s; stream {ceilings.stream_gbs:.0f} GB/s")

    cases = [_case(t, experts, ceilings) for t in TOKENS]
    results: list[dict] = []
    for case in cases:
        results.append(_pallas(case, "table", _table(case.t)))
        if case.t <= min(128, REFERENCE_MAX_T):
            results.append(_measure("ragged_dot", ref.moe_experts, case, replays=10))
        else:
            note = "skipped: ~0.1 s+ per call (all 256 experts per slot)" if case.t > 128 else "skipped"
            results.append(case.common | {"impl": "ragged_dot", "note": note})
        if case.t <= min(32, REFERENCE_MAX_T):
            results.append(_measure("gather", _gather_moe, case, replays=10))
        if torch_peers:
            results.append(_torch_grouped(case))
        if case.t >= 512 and DIAGNOSTICS:
            try:
                results += [*_phases(case), _skewed(case, experts)]
            except Exception:  # noqa: BLE001 - diagnostics must not end the batched run
                traceback.print_exc()
        # Written after every T, so a call cut short by its time limit keeps the finished rows.
        _write_report(results, ceilings, time.perf_counter() - start)
    for case in reversed(cases):
        results += _sweep(case, start)

    for t in TOKENS:
        timed = [r for r in results if r["T"] == t and r["impl"].startswith("pallas") and "us" in r]
        if timed:
            min(timed, key=lambda r: r["us"])["impl"] += " (best)"
    results.sort(key=lambda r: (r["T"], not r["impl"].startswith("pallas")))
    _write_report(results, ceilings, time.perf_counter() - start)
    return results


def _torch_grouped(case: _Case) -> dict[str, Any]:
    """torch ``_grouped_mm`` on the same buffers as ours (DLPack), checked and timed as ours."""
    from benchmarks import peers

    row = case.common | {"impl": "torch _grouped_mm"}
    ex = case.sets[0][3]
    gate_up, down = peers.to_torch(ex["gate_up"]), peers.to_torch(ex["down"])
    sets = [tuple(peers.to_torch(a) for a in s[:3]) for s in case.sets]
    try:
        out = peers.to_jax(peers.grouped_moe(*sets[0], gate_up, down))
        finite = bool(jnp.isfinite(out.astype(jnp.float32)).all())
        err = harness.rel_l2(out[case.rows], case.want) if finite else float("inf")
        if err > TOLERANCE:
            return row | {"rel_err": err, "note": f"FAILED check (rel L2 {err:.2e})"}
        sec, how = peers.time_torch(
            lambda x, ids, w: peers.grouped_moe(x, ids, w, gate_up, down), sets, replays=10
        )
    except Exception as exc:  # noqa: BLE001 - a failing peer must not end the batched run
        traceback.print_exc()
        return row | {"note": f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"}
    print(f"moe T={case.t} torch _grouped_mm: {sec * 1e6:.1f} us ({how}), rel {err:.1e}")
    return row | {"rel_err": err, "config": how} | _rates(case, sec)


def _summary(results: list[dict]) -> list[dict]:
    """One line per T: the best Pallas config against the baselines and the anchors' torch."""
    out = []
    for t in TOKENS:
        mine = [r for r in results if r["T"] == t]
        if not mine:
            continue
        by_impl = {r["impl"].removesuffix(" (best)"): r for r in mine}
        best = next((r for r in mine if r["impl"].endswith("(best)")), {})
        us = lambda name, by_impl=by_impl: by_impl.get(name, {}).get("us", "")  # noqa: E731
        out.append(
            {
                "T": t,
                "floor us": mine[0]["floor us"],
                "pallas best us": best.get("us", ""),
                "config": best.get("config", ""),
                "% stream": best.get("% stream", ""),
                "TFLOP/s": best.get("TFLOP/s", ""),
                "pallas table us": us("pallas:table"),
                "torch _grouped_mm us": us("torch _grouped_mm"),
                "ragged_dot us": us("ragged_dot"),
                "gather us": us("gather"),
                "torch _grouped_mm us (anchor)": TORCH_GROUPED_ANCHOR_US[t],
            }
        )
    return out


SUMMARY_COLUMNS = (
    "T",
    "floor us",
    "pallas best us",
    "config",
    "% stream",
    "TFLOP/s",
    "pallas table us",
    "torch _grouped_mm us",
    "ragged_dot us",
    "gather us",
    "torch _grouped_mm us (anchor)",
)
COLUMNS = (
    "T",
    "distinct experts",
    "MB",
    "floor us",
    "impl",
    "config",
    "us",
    "GB/s",
    "% stream",
    "TFLOP/s",
    "% mm",
    "rel_err",
    "note",
)


def _write_report(results: list[dict], ceilings: harness.Ceilings, elapsed: float) -> None:
    device = harness.device_header()["device"]
    lines = [
        *harness.report_header(
            f"MoE experts at GLM-5 shapes (E={E}, top-{TOP_K}, D={D}, N={N}, bf16) on {device}",
            harness.ceiling_rows(ceilings, elapsed),
        ),
        "Method: see the docstring of `benchmarks/moe.py`. `% stream` is of the memory ceiling above,",
        "`% mm` of the matmul ceiling above; `floor us` = touched bytes at the memory ceiling.",
        "`(best)` marks the fastest Pallas config per T.",
        "",
        "## Summary",
        "",
        harness.markdown_table(_summary(results), SUMMARY_COLUMNS),
        "",
        "## All rows",
        "",
        harness.markdown_table(results, COLUMNS),
        "",
    ]
    suffix = "" if TOKENS == ALL_TOKENS else "-sweep"
    out = harness.write_result("moe", "\n".join(lines), suffix, rows=results)
    print(f"moe: wrote {out}")


def main() -> None:
    # The gather path at T = 32 holds ~19 GB of gathered weights next to the 19.3 GB of experts.
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.92")
    run()


if __name__ == "__main__":
    main()
