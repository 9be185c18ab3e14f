"""GPU benchmark: lightning-indexer logits and top-k select kernels vs their pure-JAX references.

Run ``python -m benchmarks.kernels_indexer`` on a GPU (``--only decode,prefill,topk,fp8,paged``
picks sections), or call :func:`run` from a batched driver. Shapes follow
``docs/anchors.md`` (D = 128, page 64, k = 2048):

* ``decode``: 32 sequences x 1 query, each with its own S keys in 64-token pages scattered at
  random over the pool, Hi in {32, 64} x S in {8k, 32k, 128k}; bf16. bytes = 32*S*128*2 + 32*S*4.
* ``fp8``: the same at Hi = 64 with e4m3 keys + f32 row scales: the in-kernel cast (sm_89+) and the
  integer decode (the sm_80/86 path, forced here). bytes = 32*S*132 + 32*S*4.
* ``prefill``: T = 4096 queries, S shared keys, every key visible (q_pos = S - 1, as in the
  anchors), flat form. flops = 2*T*S*Hi*128.
* ``paged``: the same through the paged form, one long sequence in scattered pages.
* ``topk``: k = 2048 over f32 N(0,1) logits at [32|4096] x [8192|32768|131072] and [32, 262144].

Every implementation is checked before it is timed: indexer outputs against the float32 reference
on up to 64 sampled queries (rel L2 <= 1e-2, -inf pattern equal; fp8 against the reference on the
same fp8 keys); top-k by the multiset of selected values (must equal lax.top_k's; ties make index
sets ambiguous) and the index-set recall vs lax.top_k. Time = one jit over R distinct input sets / R,
median of replays (:func:`benchmarks.harness.time_op`); R is chosen so the R sets exceed the L2.
Pallas rows sweep a few tuning variants per shape (``pallas:<name>``; ``(best)`` marks the fastest);
after ``BUDGET_S`` seconds only the tuning table's config runs (``KERNELS_INDEXER_VARIANTS``
names the only variants to run). With ``torch_peers`` the top-k rows add ``torch.topk``
(unsorted) on the same input buffers, checked like ours and timed as ours
(:mod:`benchmarks.peers`). Percentages are of the ceilings passed in (or measured here;
:class:`benchmarks.harness.Ceilings`). ``anchor us`` is not measured in this run: the anchors'
best peer per shape in ``docs/anchors.md`` (2026-11-21; vLLM's indexer made bf16,
torch.topk unsorted, another process, CUDA events).
Writes ``benchmarks/results/kernels_indexer-<gpu>.md`` (and ``.json``).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import os
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import harness
from pallas_kernels._triton import compute_capability
from pallas_kernels.indexer_logits import kernel as ikernel
from pallas_kernels.indexer_logits import ref as iref
from pallas_kernels.indexer_logits import tuning as ituning
from pallas_kernels.topk import kernel as tkernel
from pallas_kernels.topk import ref as tref
from pallas_kernels.topk import tuning as ttuning

D, PAGE, BATCH, T_PREFILL, TOPK = 128, 64, 32, 4096, 2048
HEADS = (32, 64)
SEQ = (8192, 32768, 131072)
# Sweep order: the shapes behind the torch.topk anchor first (the time budget cuts the tail).
TOPK_SHAPES = (
    (4096, 32768),
    (4096, 131072),
    (4096, 8192),
    (32, 8192),
    (32, 32768),
    (32, 131072),
    (32, 262144),
)
TOLERANCE = 1e-2
CHECK_ROWS = 64
L2_BYTES = 50 << 20
BUDGET_S = float(os.environ.get("KERNELS_INDEXER_BUDGET_S", "150"))
# The pure-JAX indexer references (decode and prefill rows; top-k always times lax.top_k).
WITH_REFERENCE = os.environ.get("KERNELS_INDEXER_SKIP_REFERENCE", "0") != "1"
# Comma-separated variant names: the only sweep variants to run, in every section ("none": none).
ONLY_VARIANTS = [v.strip() for v in os.environ.get("KERNELS_INDEXER_VARIANTS", "").split(",") if v.strip()]
MAX_SETS = 16
SECTIONS = ("decode", "prefill", "topk", "fp8", "paged")  # run order: later sweeps are cut first

# Best peer per shape from docs/anchors.md (H100, microseconds).
ANCHOR_DECODE_US = {
    (64, 8192): 35.1,
    (64, 32768): 118.6,
    (64, 131072): 448.8,
    (32, 8192): 34.6,
    (32, 32768): 99.2,
    (32, 131072): 375.4,
}
ANCHOR_PREFILL_US = {
    (64, 8192): 3530.0,
    (64, 32768): 14010.0,
    (64, 131072): 55540.0,
    (32, 8192): 1770.0,
    (32, 32768): 7080.0,
    (32, 131072): 28240.0,
}
ANCHOR_TOPK_US = {
    (32, 8192): 45.7,
    (32, 32768): 59.7,
    (32, 131072): 101.1,
    (4096, 8192): 556.4,
    (4096, 32768): 1756.4,
    (4096, 131072): 6361.8,
}

# Sweep variants (sized for the H100; one that fails to compile is reported, not fatal).
ROW_VARIANTS = {
    "s128w4": ituning.RowConfig(block_s=128, num_warps=4),
    "s256w8": ituning.RowConfig(block_s=256, num_warps=8),
    "s128x4w4s3": ituning.RowConfig(block_s=128, num_warps=4, num_stages=3, steps=4),
    "s256x2w8s3": ituning.RowConfig(block_s=256, num_warps=8, num_stages=3, steps=2),
}
TILE_VARIANTS = {
    "t64s128w4": ituning.TileConfig(block_t=64, block_s=128, num_warps=4, num_stages=3),
    "t128s128w8": ituning.TileConfig(block_t=128, block_s=128, num_warps=8, num_stages=3),
    "t64s256w8": ituning.TileConfig(block_t=64, block_s=256, num_warps=8, num_stages=3),
}
TOPK_VARIANTS = {
    # false-position cutoff search: 10.5 block counts instead of 19 on normal rows (benchmarks/topk_probes.py)
    "c8192e32 secant": ttuning.TopkConfig(chunk=8192, elems_per_thread=32, search="secant"),
    "c8192e16 secant": ttuning.TopkConfig(chunk=8192, elems_per_thread=16, search="secant"),
    "c16384e32 secant": ttuning.TopkConfig(chunk=16384, elems_per_thread=32, search="secant"),
    "c8192e32": ttuning.TopkConfig(chunk=8192, elems_per_thread=32),
    "c16384e32": ttuning.TopkConfig(chunk=16384, elems_per_thread=32),
    "c8192e16": ttuning.TopkConfig(chunk=8192, elems_per_thread=16),
    "c4096e16": ttuning.TopkConfig(chunk=4096, elems_per_thread=16),
    "c16384e64": ttuning.TopkConfig(chunk=16384, elems_per_thread=64),
    "c4096e8": ttuning.TopkConfig(chunk=4096, elems_per_thread=8),
}


class _Clock:
    """Wall time since the start; past ``BUDGET_S`` only the tuning table's configs run."""

    def __init__(self) -> None:
        self.start = time.perf_counter()

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def over_budget(self) -> bool:
        return self.elapsed() > BUDGET_S


def _n_sets(set_bytes: int) -> int:
    """Distinct input sets per timing so that one pass over them exceeds the L2 (capped: each set is
    one more kernel instance to compile; [32, 8192] top-k stays partly L2-resident)."""
    return max(1, min(MAX_SETS, math.ceil(4 * L2_BYTES / set_bytes)))


def _measure(
    name: str,
    fn: Callable,
    sets: Sequence[tuple],
    check: Callable[[Any], tuple[float, str]],
    *,
    replays: int,
    warmup: int = 2,
) -> dict[str, Any]:
    """Run ``fn`` on set 0 and ``check`` it (-> error, note), then time it over all sets."""
    try:
        err, note = check(jax.jit(fn)(*sets[0]))
        if note:
            return {"impl": name, "rel_err": err, "note": f"FAILED check: {note}"}
        sec = harness.time_op(fn, sets, replays=replays, warmup=warmup)
        return {"impl": name, "rel_err": err, "us": sec * 1e6}
    except Exception as exc:  # noqa: BLE001 - one failing variant must not end the batched run
        traceback.print_exc()
        return {"impl": name, "note": f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"}


def _rel_l2_check(want, rows=None) -> Callable[[Any], tuple[float, str]]:
    def check(out):
        got = out if rows is None else out[rows]
        err = harness.rel_l2(got, want)
        return err, "" if err <= TOLERANCE else f"rel L2 {err:.2e}"

    return check


def _mark_best(rows: list[dict]) -> None:
    timed = [r for r in rows if "us" in r and r["impl"].startswith("pallas")]
    if timed:
        min(timed, key=lambda r: r["us"])["impl"] += " (best)"


def _anchor(us: float | None) -> dict:
    return {} if us is None else {"anchor us": us}


def _rates(row: dict, *, mb: float = 0.0, gflop: float = 0.0, ceilings: harness.Ceilings) -> dict:
    if "us" not in row:
        return row
    sec = row["us"] * 1e-6
    if mb:
        gbs = mb * 1e6 / sec / 1e9
        row |= {"GB/s": gbs, "% stream": 100 * gbs / ceilings.stream_gbs}
    if gflop:
        tflops = gflop / sec / 1e3
        row |= {"TFLOP/s": tflops, "% mm": 100 * tflops / ceilings.matmul_tflops}
    if "anchor us" in row:
        row["vs anchor"] = row["anchor us"] / row["us"]
    return row


# --- indexer inputs ---------------------------------------------------------------------------


def _quantize_e4m3(k):
    """Per-row e4m3 quantization (scale = amax / 448), as the fp8 indexer cache stores keys."""
    scale = jnp.maximum(jnp.abs(k.astype(jnp.float32)).max(-1), 1e-4) / 448.0
    return (k.astype(jnp.float32) / scale[..., None]).astype(jnp.float8_e4m3fn), scale


@functools.partial(jax.jit, static_argnames=("heads", "s", "batch", "t", "fp8"))
def _paged_inputs(key, *, heads: int, s: int, batch: int, t: int, fp8: bool):
    """(q, w, k_pages, page_table, seq_ids, q_pos[, k_scale]): ``batch`` sequences of ``s`` keys in
    64-token pages scattered over the pool, ``t`` queries spread over the sequences in order, each
    seeing every key of its sequence."""
    m = s // PAGE
    kq, kw, kk, kp = jax.random.split(key, 4)
    q = jax.random.normal(kq, (t, heads, D), jnp.bfloat16)
    w = jax.random.normal(kw, (t, heads), jnp.float32) * heads**-0.5
    k_pages = jax.random.normal(kk, (batch * m, PAGE, D), jnp.bfloat16)
    table = jax.random.permutation(kp, batch * m).astype(jnp.int32).reshape(batch, m)
    seq_ids = (jnp.arange(t) * batch // t).astype(jnp.int32)
    q_pos = jnp.full((t,), s - 1, jnp.int32)
    if fp8:
        k8, scale = _quantize_e4m3(k_pages)
        return q, w, k8, table, seq_ids, q_pos, scale
    return q, w, k_pages, table, seq_ids, q_pos


@functools.partial(jax.jit, static_argnames=("heads", "s"))
def _flat_inputs(key, *, heads: int, s: int):
    """(q, w, k, q_pos) for the prefill form: T_PREFILL queries over ``s`` shared keys, all visible."""
    kq, kw, kk = jax.random.split(key, 3)
    q = jax.random.normal(kq, (T_PREFILL, heads, D), jnp.bfloat16)
    w = jax.random.normal(kw, (T_PREFILL, heads), jnp.float32) * heads**-0.5
    k = jax.random.normal(kk, (s, D), jnp.bfloat16)
    return q, w, k, jnp.full((T_PREFILL,), s - 1, jnp.int32)


def _describe_row(c: ituning.RowConfig) -> str:
    return f"row {c.steps}x{c.block_s}/w{c.num_warps}s{c.num_stages}"


def _describe_tile(c: ituning.TileConfig) -> str:
    return f"tile {c.block_t}x{c.block_s}/w{c.num_warps}s{c.num_stages}"


def _describe_topk(c: ttuning.TopkConfig) -> str:
    return f"chunk {c.chunk}/w{c.num_warps(c.chunk)}" + (f" {c.search}" if c.search != "bisect" else "")


def _sweep(
    common: dict,
    table_cfg,
    variants: Mapping[str, Any],
    make_fn: Callable,
    sets,
    check,
    clock: _Clock,
    *,
    describe: Callable,
    replays: int,
    warmup: int = 2,
) -> list[dict]:
    """The tuning table's config, then each distinct variant (while the time budget lasts)."""
    rows = []
    chosen = {n: v for n, v in variants.items() if not ONLY_VARIANTS or n in ONLY_VARIANTS}
    candidates = {"table": table_cfg} | {n: v for n, v in chosen.items() if v != table_cfg}
    for name, cfg in candidates.items():
        label = f"pallas:{name}"
        if name != "table" and clock.over_budget():
            rows.append(common | {"impl": label, "config": describe(cfg), "note": harness.SKIPPED})
            continue
        row = _measure(label, make_fn(cfg), sets, check, replays=replays, warmup=warmup)
        rows.append(common | row | {"config": describe(cfg)})
        print(f"  {label} {describe(cfg)}: {row.get('us', row.get('note'))}")
    _mark_best(rows)
    return rows


# --- sections ---------------------------------------------------------------------------------


def _decode(clock: _Clock, rate: dict) -> list[dict]:
    table = ituning.config_for()
    results = []
    for heads in HEADS:
        for s in SEQ:
            set_bytes = BATCH * s * (D * 2 + 4)
            keys = jax.random.split(jax.random.key(s + heads), _n_sets(set_bytes))
            sets = [_paged_inputs(k, heads=heads, s=s, batch=BATCH, t=BATCH, fp8=False) for k in keys]
            check = _rel_l2_check(iref.indexer_logits_paged(*sets[0]))
            common = {
                "kind": "decode",
                "Hi": heads,
                "T": BATCH,
                "S": s,
                "MB": set_bytes / 1e6,
                **_anchor(ANCHOR_DECODE_US.get((heads, s))),
            }
            print(f"decode Hi={heads} S={s} ({len(sets)} sets) at {clock.elapsed():.0f}s")

            def make(row_cfg):
                cfg = dataclasses.replace(table, row=row_cfg)
                return lambda *a: ikernel.indexer_logits_paged(*a, config=cfg)

            rows = _sweep(
                common, table.row, ROW_VARIANTS, make, sets, check, clock, describe=_describe_row, replays=20
            )
            if WITH_REFERENCE:
                rows.append(common | _measure("jax ref", iref.indexer_logits_paged, sets, check, replays=10))
            results += [_rates(r, mb=r["MB"], **rate) for r in rows]
    return results


def _fp8(clock: _Clock, rate: dict) -> list[dict]:
    table = ituning.config_for()
    native_ok = compute_capability() >= 89
    heads, results = 64, []
    for s in SEQ:
        set_bytes = BATCH * s * (D + 4 + 4)
        keys = jax.random.split(jax.random.key(7 * s), _n_sets(set_bytes))
        sets = [_paged_inputs(k, heads=heads, s=s, batch=BATCH, t=BATCH, fp8=True) for k in keys]
        q, w, k8, pt, seq, pos, scale = sets[0]
        check = _rel_l2_check(iref.indexer_logits_paged(q, w, k8, pt, seq, pos, k_scale=scale))
        common = {"kind": "decode fp8", "Hi": heads, "T": BATCH, "S": s, "MB": set_bytes / 1e6}
        print(f"fp8 decode S={s} at {clock.elapsed():.0f}s")
        rows = []
        for name, native in (("e4m3 cast (sm_89+)", True), ("int decode (sm_80/86 path)", False)):
            if native and not native_ok:
                rows.append(common | {"impl": f"pallas:{name}", "note": "skipped: no e4m3 cast below sm_89"})
                continue

            def fn(q, w, k8, pt, seq, pos, scale, native=native):
                return ikernel.indexer_logits_paged(
                    q, w, k8, pt, seq, pos, k_scale=scale, native_fp8=native, config=table
                )

            row = _measure(f"pallas:{name}", fn, sets, check, replays=20)
            rows.append(common | row | {"config": _describe_row(table.row)})

        def ref_fn(q, w, k8, pt, seq, pos, scale):
            return iref.indexer_logits_paged(q, w, k8, pt, seq, pos, k_scale=scale)

        rows.append(common | _measure("jax ref", ref_fn, sets, check, replays=10))
        results += [_rates(r, mb=r["MB"], **rate) for r in rows]
    return results


def _prefill_rows(clock: _Clock, rate: dict, *, paged: bool) -> list[dict]:
    """Flat form (``paged=False``) or the paged form on one long sequence."""
    table = ituning.config_for()
    variants = TILE_VARIANTS if not paged else {"t128s128w8": TILE_VARIANTS["t128s128w8"]}
    rng = np.random.default_rng(0)
    results = []
    for heads in HEADS:
        for s in SEQ:
            key = jax.random.key(11 * s + heads)
            rows_idx = jnp.asarray(np.sort(rng.choice(T_PREFILL, CHECK_ROWS, replace=False)))
            if paged:
                sets = [_paged_inputs(key, heads=heads, s=s, batch=1, t=T_PREFILL, fp8=False)]
                q, w, kp, pt, seq, pos = sets[0]
                want = iref.indexer_logits_paged(
                    q[rows_idx], w[rows_idx], kp, pt, seq[rows_idx], pos[rows_idx]
                )

                def make(tile_cfg):
                    cfg = dataclasses.replace(table, tile=tile_cfg)
                    return lambda *a: ikernel.indexer_logits_paged(*a, config=cfg)
            else:
                sets = [_flat_inputs(key, heads=heads, s=s)]
                q, w, k, pos = sets[0]
                want = iref.indexer_logits(q[rows_idx], w[rows_idx], k, q_pos=pos[rows_idx])

                def make(tile_cfg):
                    cfg = dataclasses.replace(table, tile=tile_cfg)
                    return lambda *a: ikernel.indexer_logits(*a[:3], q_pos=a[3], config=cfg)

            check = _rel_l2_check(want, rows_idx)
            gflop = 2 * T_PREFILL * s * heads * D / 1e9
            common = {
                "kind": "prefill paged" if paged else "prefill",
                "Hi": heads,
                "T": T_PREFILL,
                "S": s,
                "GFLOP": gflop,
                **_anchor(None if paged else ANCHOR_PREFILL_US.get((heads, s))),
            }
            print(f"{common['kind']} Hi={heads} S={s} at {clock.elapsed():.0f}s")
            replays = 5 if s >= 131072 else 10
            rows = _sweep(
                common,
                table.tile,
                variants,
                make,
                sets,
                check,
                clock,
                describe=_describe_tile,
                replays=replays,
                warmup=1,
            )
            if not paged and WITH_REFERENCE:
                ref_fn = lambda q, w, k, p: iref.indexer_logits(q, w, k, q_pos=p)  # noqa: E731
                rows.append(common | _measure("jax ref", ref_fn, sets, check, replays=3, warmup=1))
            results += [_rates(r, gflop=gflop, **rate) for r in rows]
    return results


@jax.jit
def _topk_agreement(x, got, want_values, want_idx):
    """(selected values == lax.top_k's as multisets, index-set recall vs lax.top_k)."""
    values = jnp.take_along_axis(x, jnp.maximum(got, 0), axis=1)
    same = jnp.all(got >= 0) & jnp.all(jnp.sort(values, axis=1) == jnp.sort(want_values, axis=1))
    both = jnp.sort(jnp.concatenate([got, want_idx], axis=1), axis=1)
    return same, jnp.sum(both[:, 1:] == both[:, :-1]) / got.size


def _topk_check(x) -> Callable[[Any], tuple[float, str]]:
    """Check against lax.top_k on ``x``: error = 1 - index-set recall, note on a value mismatch."""
    want_values, want_idx = jax.lax.top_k(x, TOPK)

    def check(got):
        same, recall = _topk_agreement(x, got, want_values, want_idx)
        return 1.0 - float(recall), "" if bool(same) else "selected values differ from lax.top_k"

    return check


def _topk(clock: _Clock, rate: dict, *, torch_peers: bool = False) -> list[dict]:
    results = []
    for t, s in TOPK_SHAPES:
        table = ttuning.config_for(rows=t, keys=s)
        keys = jax.random.split(jax.random.key(t + s), _n_sets(t * s * 4))
        sets = [(jax.random.normal(k, (t, s), jnp.float32),) for k in keys]
        check = _topk_check(sets[0][0])

        common = {
            "kind": f"top-k {TOPK}",
            "T": t,
            "S": s,
            "MB": t * s * 4 / 1e6,
            **_anchor(ANCHOR_TOPK_US.get((t, s))),
        }
        print(f"top-k [{t}, {s}] ({len(sets)} sets) at {clock.elapsed():.0f}s")
        replays = 5 if t * s >= 4096 * 131072 else 20

        def make(cfg):
            return lambda x: tkernel.topk_indices(x, TOPK, config=cfg)

        rows = _sweep(
            common,
            table,
            TOPK_VARIANTS,
            make,
            sets,
            check,
            clock,
            describe=_describe_topk,
            replays=replays,
        )
        if torch_peers:
            rows.append(common | _torch_topk(sets, check, replays))
        rows.append(
            common
            | _measure(
                "jax lax.top_k", lambda x: tref.topk_indices(x, TOPK), sets, check, replays=replays, warmup=1
            )
        )
        for r in rows:
            if "rel_err" in r:
                r["recall"] = 1.0 - r.pop("rel_err")
        results += [_rates(r, mb=r["MB"], **rate) for r in rows]
    return results


def _torch_topk(sets: Sequence[tuple], check: Callable, replays: int) -> dict[str, Any]:
    """``torch.topk`` (unsorted) on the same buffers, checked as ours (its indices back through
    DLPack), timed as ours."""
    from benchmarks import peers

    xs = [(peers.to_torch(x),) for (x,) in sets]
    try:
        err, note = check(peers.to_jax(peers.topk(xs[0][0], TOPK).int()))
        if note:
            return {"impl": "torch.topk", "rel_err": err, "note": f"FAILED check: {note}"}
        sec, how = peers.time_torch(lambda x: peers.topk(x, TOPK), xs, replays=replays)
    except Exception as exc:  # noqa: BLE001 - a failing peer must not end the batched run
        traceback.print_exc()
        return {"impl": "torch.topk", "note": f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"}
    print(f"  torch.topk: {sec * 1e6:.1f} us ({how})")
    return {"impl": "torch.topk", "rel_err": err, "us": sec * 1e6, "config": f"sorted=False, {how}"}


_SECTION_FNS = {
    "decode": _decode,
    "prefill": functools.partial(_prefill_rows, paged=False),
    "topk": _topk,
    "fp8": _fp8,
    "paged": functools.partial(_prefill_rows, paged=True),
}


def run(
    ceilings: harness.Ceilings | None = None,
    sections: Sequence[str] = SECTIONS,
    *,
    torch_peers: bool = False,
) -> list[dict]:
    """All rows (one per shape x implementation), ``sections`` in the order given (the sweep
    budget goes to the first); ``ceilings`` are measured here when not passed."""
    clock = _Clock()
    ceilings = ceilings or harness.measure_ceilings(torch_peers)
    print(f"kernels_indexer: stream {ceilings.stream_gbs:.0f} GB/s at {clock.elapsed():.0f}s")
    rate = {"ceilings": ceilings}
    fns = _SECTION_FNS | {"topk": functools.partial(_topk, torch_peers=torch_peers)}
    results: list[dict] = []
    for i, name in enumerate(sections):
        results += fns[name](clock, rate)
        # Rewritten after every section, so a run cut short by its time limit keeps its finished rows.
        _write_report(results, ceilings, clock.elapsed(), pending=sections[i + 1 :])
    return results


COLUMNS = (
    "kind",
    "Hi",
    "T",
    "S",
    "MB",
    "GFLOP",
    "impl",
    "config",
    "us",
    "anchor us",
    "vs anchor",
    "GB/s",
    "% stream",
    "TFLOP/s",
    "% mm",
    "rel_err",
    "recall",
    "note",
)


def _write_report(
    results: list[dict], ceilings: harness.Ceilings, elapsed: float, pending: Sequence[str]
) -> None:
    table = harness.markdown_table(results, COLUMNS)
    lines = [
        *harness.report_header(
            f"Indexer logits and top-k kernels on {harness.device_header()['device']}",
            harness.ceiling_rows(ceilings, elapsed),
        ),
        "Method: see the docstring of `benchmarks/kernels_indexer.py`. `vs anchor` = anchor us / us",
        "(> 1: faster than the anchors' best peer). `(best)` marks the fastest Pallas config per shape.",
        *([f"Sections still to run when this was written: {', '.join(pending)}."] if pending else []),
        "",
        table,
        "",
    ]
    out = harness.write_result("kernels_indexer", "\n".join(lines), rows=results)
    if not pending:
        print(table)
    print(f"kernels_indexer: wrote {out}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--only", default=",".join(SECTIONS), help=f"comma-separated subset of {','.join(SECTIONS)}"
    )
    parser.add_argument("--torch-peers", action="store_true", help="time torch.topk beside our top-k")
    args = parser.parse_args()
    sections = [s.strip() for s in args.only.split(",") if s.strip()]
    unknown = set(sections) - set(SECTIONS)
    if unknown:
        parser.error(f"unknown sections {sorted(unknown)}")
    run(sections=sections, torch_peers=args.torch_peers)


if __name__ == "__main__":
    main()
