"""GPU benchmark: sparse MLA (Pallas kernel vs the pure-JAX reference) at the anchor shapes.

Run ``python -m benchmarks.kernels_mla`` on a GPU (or call :func:`run` from a batched driver).
Shapes (docs/anchors.md): decode H in {16, 64, 128} x B in {1, 8, 32, 128}, one
query per sequence, top-k 2048 over a 262144-slot pool; prefill T in {1024, 4096} x H in
{64, 128} over a 65536-slot pool. q/kv bf16 random normal, indices uniform over the pool (no
-1s, no causal structure), 576-wide rows (512 value + 64 rope), no sink.

Two phases, so the required rows always exist and the sweep only spends what is left:

1. per shape: the kernel with the tuning table's config (``pallas:table``, 20 replays), checked
   against the float32 reference (rel L2 <= 1e-2 on out, LSE error reported), and the pure-JAX
   reference (``reference``; bf16 inputs, float32 math, as in the anchors; fewer input sets and
   replays at big shapes);
2. a sweep of tile / split variants per shape (5 replays each), each shape getting an equal
   share of the remaining budget (``BUDGET_S`` of wall time in all; ``KERNELS_MLA_VARIANTS``
   names the only variants to run, each everywhere or at one shape: ``splits*2,stages3/decode
   H=64 B=32``); the best variant is
   re-timed with 20 replays when it beats the table. The printed ``TUNED`` lines can be pasted
   into ``pallas_kernels/sparse_mla/tuning.py``.

Method (as ``harness.time_op``): one jit runs the op over R distinct input sets back to back (R
sized so a replay touches >= 2.5x the 50 MiB L2, capped at 32), wall clock / R, median over
replays after warm-up; here the same executable also returns the first set's output for the
correctness check, so a config compiles once. bytes = T*K*576*2 (gathered rows, each read once)
+ q + out + idx; flops = 2*T*H*K*(576+512). Percentages are of the ceilings passed in (or
measured here; :class:`benchmarks.harness.Ceilings`). ``vLLM us (anchor)`` is the best vLLM
Triton figure per shape in ``docs/anchors.md`` (2026-11-21, another process, CUDA
events; auto or forced split count), not measured in this run.
Writes ``benchmarks/results/kernels_mla-<gpu>.md`` (and ``.json``).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import time
import traceback
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from benchmarks import harness
from pallas_kernels._triton import compute_capability
from pallas_kernels.sparse_mla import kernel, ref, tuning
from pallas_kernels.sparse_mla.tuning import MlaConfig

D, DV, TOPK = 576, 512, 2048
SCALE = 192**-0.5  # DeepSeek-V3.2's qk_head_dim (128 nope + 64 rope); any scale would do
DECODE_POOL, PREFILL_POOL = 262144, 65536
TOLERANCE = 1e-2
# Best vLLM Triton sparse-MLA time per shape, us (docs/anchors.md, 2026-11-21, H100):
# decode (H, B) from runs 1 and 3 (forced split counts), prefill (H, T) from run 1.
ANCHOR_VLLM_US = {
    ("decode", 16, 1): 18.2,
    ("decode", 16, 8): 21.6,
    ("decode", 16, 32): 56.8,
    ("decode", 16, 128): 231.4,
    ("decode", 64, 1): 19.2,
    ("decode", 64, 8): 40.2,
    ("decode", 64, 32): 117.2,
    ("decode", 64, 128): 360.0,
    ("decode", 128, 1): 19.8,
    ("decode", 128, 8): 62.9,
    ("decode", 128, 32): 213.8,
    ("decode", 128, 128): 692.4,
    ("prefill", 64, 1024): 2890.0,
    ("prefill", 128, 1024): 5770.0,
    ("prefill", 64, 4096): 11540.0,
    ("prefill", 128, 4096): 22920.0,
}
L2_BYTES = 50 * 2**20
MAX_SETS = 32
CHECK_QUERIES = 256  # prefill: queries compared with the float32 reference
BUDGET_S = float(os.environ.get("KERNELS_MLA_BUDGET_S", "210"))
ONLY_VARIANTS = [v.strip() for v in os.environ.get("KERNELS_MLA_VARIANTS", "").split(",") if v.strip()]


@dataclasses.dataclass(frozen=True)
class Shape:
    kind: str  # "decode" (T = batch of one-token sequences) or "prefill"
    t: int
    h: int
    pool: int

    @property
    def label(self) -> str:
        return f"{self.kind} H={self.h} {'B' if self.kind == 'decode' else 'T'}={self.t}"

    @property
    def nbytes(self) -> int:
        return self.t * TOPK * D * 2 + self.t * self.h * (D + DV) * 2 + self.t * TOPK * 4

    @property
    def flops(self) -> float:
        return 2.0 * self.t * self.h * TOPK * (D + DV)

    @property
    def sets(self) -> int:
        return max(1, min(MAX_SETS, math.ceil(2.5 * L2_BYTES / self.nbytes)))


SHAPES = [Shape("decode", b, h, DECODE_POOL) for h in (16, 64, 128) for b in (1, 8, 32, 128)] + [
    Shape("prefill", t, h, PREFILL_POOL) for t in (1024, 4096) for h in (64, 128)
]


def describe(cfg: MlaConfig) -> str:
    flags = (" prefetch" if cfg.prefetch else "") + (" bf16-partials" if cfg.narrow_partials else "")
    return f"bh{cfg.block_h} bn{cfg.block_n} w{cfg.num_warps} s{cfg.num_stages} splits{cfg.splits}{flags}"


def _table_config(shape: Shape, block_h: int | None = None) -> MlaConfig:
    return tuning.choose(shape.t, shape.h, TOPK, d_v=DV, d_r=D - DV, itemsize=2, block_h=block_h)


def _variants(shape: Shape, base: MlaConfig) -> dict[str, MlaConfig]:
    """Sweep candidates around the table's config, most promising first."""
    r = functools.partial(dataclasses.replace, base)
    other_name, other = ("bn64", r(block_n=64)) if base.block_n < 64 else ("bn32", r(block_n=32))
    # 64 heads at 8 warps hold a 128 KiB f32 accumulator: 255 registers and local-memory spills
    # (Nsight Compute, H100, H = 64 B = 32); 16 warps halve the registers per thread.
    wide = [("warps16", r(num_warps=16))] if base.block_h >= 64 else []
    if shape.kind == "decode":
        more = lambda cfg, f: dataclasses.replace(cfg, splits=min(cfg.splits * f, TOPK // cfg.block_n))  # noqa: E731
        cands = [
            # B = 1 writes and merges as many partial bytes as it gathers (H = 64: 4 MB of float32)
            *([("bf16 partials", r(narrow_partials=True))] if base.splits > 1 and shape.t == 1 else []),
            ("prefetch", r(prefetch=True)),
            *wide,
            ("splits*2", more(base, 2)),
            (other_name, other),
            (f"{other_name} splits*2", more(other, 2)),
            ("splits*4", more(base, 4)),
            # B = 1: twice the programs, each walking half the rows (shorter dependent chain)
            ("bn16 splits*2", more(r(block_n=16), 2)),
            # the split rule re-applied to 16 heads per program / to all heads (up to 64) per program
            ("bh16", _table_config(shape, block_h=16)),
            ("all_heads", _table_config(shape, block_h=min(64, max(16, shape.h)))),
            ("splits/2", r(splits=max(1, base.splits // 2))),
            ("stages3", r(num_stages=3)),
        ]
    else:
        cands = [
            ("prefetch", r(prefetch=True)),
            *wide,
            (other_name, other),
            ("stages3", r(num_stages=3)),
            ("bn16", r(block_n=16)),
            ("warps4", r(num_warps=4)),
            ("bh/2", r(block_h=max(16, base.block_h // 2))),
        ]
    # No 128-head variant: its epilogue converts a 256 KiB f32 accumulator through shared memory (more
    # than any part has) and at 16 warps ptxas runs out of registers (both seen on H100).
    out: dict[str, MlaConfig] = {}
    for name, cfg in cands:
        wanted = not ONLY_VARIANTS or name in ONLY_VARIANTS or f"{name}/{shape.label}" in ONLY_VARIANTS
        if cfg != base and cfg not in out.values() and wanted:
            out[name] = cfg
    return out


@functools.partial(jax.jit, static_argnames=("t", "h", "pool"))
def _make_set(key, *, t: int, h: int, pool: int):
    kq, ki = jax.random.split(key)
    q = jax.random.normal(kq, (t, h, D), jnp.bfloat16)
    return q, jax.random.randint(ki, (t, TOPK), 0, pool, jnp.int32)


def _make_sets(shape: Shape, kv: jax.Array, n: int) -> list[tuple]:
    keys = jax.random.split(jax.random.key(1000 * shape.h + shape.t), n)
    return [(*_make_set(k, t=shape.t, h=shape.h, pool=shape.pool), kv) for k in keys]


def _checked_queries(shape: Shape) -> int:
    return min(shape.t, CHECK_QUERIES)


def _expected(shape: Shape, q, idx, kv):
    """Float32 reference on the first queries of set 0 (bf16 kv rows are upcast inside)."""
    n = _checked_queries(shape)
    fn = jax.jit(functools.partial(ref.sparse_mla, sm_scale=SCALE, v_dim=DV))
    return jax.block_until_ready(fn(q[:n].astype(jnp.float32), kv, idx[:n]))


def compile_and_check(
    fn: Callable, sets: list, want, n_check: int
) -> tuple[dict, Callable[[int], float] | None]:
    """Compile ``fn`` over all sets in one jit, check set 0 against ``want``.

    Returns the check's row fields and, when it passed, ``timer(replays) -> us per call`` that
    reuses the compiled executable (so a sweep winner is re-timed without a second compile).
    ``fn`` is jitted on its own, so its R calls share one trace and one lowering (the kernel is
    lowered once, not R times: 2.5 s vs 0.08 s for 48 sets on the CPU); the executable is the same.
    """
    one = jax.jit(fn)

    @jax.jit
    def run_all(sets):
        return [one(*s) for s in sets]

    try:
        out, lse = jax.block_until_ready(run_all(sets))[0]
        err = harness.rel_l2(out[:n_check], want[0])
        lse_err = float(jnp.max(jnp.abs(lse[:n_check] - want[1])))
    except Exception as exc:  # noqa: BLE001 - one failing variant must not end the batched run
        traceback.print_exc()
        return {"note": f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:120]}"}, None
    checked = {"rel_err": err, "lse_err": lse_err}
    if not err <= TOLERANCE:
        return checked | {"note": f"FAILED check (rel L2 {err:.2e})"}, None

    def timer(replays: int) -> float:
        jax.block_until_ready(run_all(sets))
        return harness.median_seconds(lambda: run_all(sets), len(sets), replays) * 1e6

    return checked, timer


def _with_rates(row: dict, shape: Shape, *, ceilings: harness.Ceilings) -> dict:
    anchor = ANCHOR_VLLM_US.get((shape.kind, shape.h, shape.t))
    if anchor is not None:
        row["vLLM us (anchor)"] = anchor
    if "us" in row:
        sec = row["us"] * 1e-6
        gbs = shape.nbytes / sec / 1e9
        tflops = shape.flops / sec / 1e12
        row |= {
            "GB/s": gbs,
            "% stream": 100 * gbs / ceilings.stream_gbs,
            "TFLOP/s": tflops,
            "% mm": 100 * tflops / ceilings.matmul_tflops,
        }
    return row


def _kernel_fn(cfg: MlaConfig | None) -> Callable:
    return lambda q, idx, kv: kernel.sparse_mla(q, kv, idx, sm_scale=SCALE, v_dim=DV, config=cfg)


def _reference_fn(q, idx, kv):
    return ref.sparse_mla(q, kv, idx, sm_scale=SCALE, v_dim=DV)


def run(ceilings: harness.Ceilings | None = None) -> list[dict]:
    """All rows (per shape: table config, reference, sweep variants); ``ceilings`` are measured
    here when not passed."""
    start = time.perf_counter()
    clock = lambda: time.perf_counter() - start  # noqa: E731
    ceilings = ceilings or harness.measure_ceilings()
    rates = functools.partial(_with_rates, ceilings=ceilings)
    cc = compute_capability()
    pools = {
        n: jax.block_until_ready(jax.random.normal(jax.random.key(n), (n, D), jnp.bfloat16))
        for n in (DECODE_POOL, PREFILL_POOL)
    }
    print(f"kernels_mla: cc {cc}, stream {ceilings.stream_gbs:.0f} GB/s, ready at {clock():.0f}s")

    rows: dict[Shape, list[dict]] = {}
    wants: dict[Shape, Any] = {}
    only = [s.strip() for s in os.environ.get("KERNELS_MLA_ONLY", "").split(",") if s.strip()]
    shapes = [s for s in SHAPES if not only or s.label in only]
    with_reference = os.environ.get("KERNELS_MLA_SKIP_REFERENCE", "0") != "1"
    for shape in shapes:  # phase 1: the required rows
        kv = pools[shape.pool]
        sets = _make_sets(shape, kv, shape.sets)
        wants[shape] = _expected(shape, sets[0][0], sets[0][1], kv)
        common = {"shape": shape.label, "MB": shape.nbytes / 1e6, "sets": len(sets)}
        table = common | {"impl": "pallas:table", "config": describe(_table_config(shape))}
        checked, timer = compile_and_check(_kernel_fn(None), sets, wants[shape], _checked_queries(shape))
        table |= checked | ({"us": timer(20)} if timer else {})
        rows[shape] = [rates(table, shape)]
        if with_reference:
            ref_sets = sets[: max(1, len(sets) // 4)]
            us = 1e6 * harness.time_op(_reference_fn, ref_sets, replays=5 if shape.kind == "prefill" else 10)
            rows[shape].append(rates(common | {"impl": "reference", "sets": len(ref_sets), "us": us}, shape))
        print(f"{shape.label}: table {table.get('us', table.get('note'))} us [{clock():.0f}s]")

    # The required rows reach the results file before the sweep, so a run cut short keeps them.
    _write_report([r for shape in shapes for r in rows[shape]], [], ceilings, clock(), sweep_done=False)
    tuned = []
    for i, shape in enumerate(shapes):  # phase 2: the sweep, with what is left of the budget
        share = (BUDGET_S - clock()) / (len(shapes) - i)
        shape_start = clock()
        sets = _make_sets(shape, pools[shape.pool], shape.sets)
        common = {"shape": shape.label, "MB": shape.nbytes / 1e6, "sets": len(sets)}
        best = None  # (us, row, cfg, timer) of the fastest variant
        for name, cfg in _variants(shape, _table_config(shape)).items():
            row = common | {"impl": f"pallas:{name}", "config": describe(cfg)}
            if clock() - shape_start >= share:
                rows[shape].append(row | {"note": harness.SKIPPED})
                continue
            checked, timer = compile_and_check(_kernel_fn(cfg), sets, wants[shape], _checked_queries(shape))
            row |= checked | ({"us": timer(5)} if timer else {})
            rows[shape].append(rates(row, shape))
            if timer and (best is None or row["us"] < best[0]):
                best = (row["us"], row, cfg, timer)
            print(f"{shape.label} {name} {describe(cfg)}: {row.get('us', row.get('note'))} [{clock():.0f}s]")
        table = rows[shape][0]
        if best and "us" in table and best[0] < table["us"]:
            _, row, cfg, timer = best
            row |= rates({"us": timer(20)}, shape)  # full timing for the winner
            if row["us"] < 0.97 * table["us"]:
                note = f"{row['us']:.1f} us vs table {table['us']:.1f} us"
                tuned.append(f"    ({cc}, {shape.h}, {shape.t}): {cfg!r},  # {note}")
        timed = [r for r in rows[shape] if r["impl"].startswith("pallas") and "us" in r]
        if timed:
            min(timed, key=lambda r: r["us"])["impl"] += " (best)"

    results = [r for shape in shapes for r in rows[shape]]
    _write_report(results, tuned, ceilings, clock())
    return results


COLUMNS = (
    "shape",
    "MB",
    "impl",
    "config",
    "sets",
    "us",
    "vLLM us (anchor)",
    "GB/s",
    "% stream",
    "TFLOP/s",
    "% mm",
    "rel_err",
    "lse_err",
    "note",
)


def _write_report(
    results: list[dict], tuned: list[str], ceilings: harness.Ceilings, elapsed: float, sweep_done: bool = True
) -> None:
    table = harness.markdown_table(results, COLUMNS)
    lines = [
        *harness.report_header(
            f"Sparse MLA (576/512, top-{TOPK}, bf16) on {harness.device_header()['device']}",
            harness.ceiling_rows(ceilings, elapsed),
        ),
        "Method: see the docstring of `benchmarks/kernels_mla.py`. `(best)` marks the fastest Pallas",
        "config per shape (re-timed with 20 replays when it is a sweep variant).",
        "",
        table,
        "",
        *(
            [
                "Sweep winners (>3 % better than the table) for"
                " `pallas_kernels/sparse_mla/tuning.py` `TUNED`:",
                "",
                "```python",
                *(tuned or ["    # none"]),
                "```",
            ]
            if sweep_done
            else ["The tuning sweep had not run when this was written."]
        ),
        "",
    ]
    text = "\n".join(lines)
    if sweep_done:
        print(text)
    out = harness.write_result("kernels_mla", text, rows=results)
    print(f"kernels_mla: wrote {out}")


if __name__ == "__main__":
    run()
