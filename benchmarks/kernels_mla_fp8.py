"""GPU benchmark: decode sparse MLA over bf16 rows vs FP8 latent rows (native and software e4m3).

Run ``python -m benchmarks.kernels_mla_fp8`` on a GPU. Decode shapes, one query per sequence:
B in {1, 8, 32, 64, 128} x H in {16, 64} x context in {8k, 64k} tokens per sequence, top-k 2048,
576-wide rows (512 latent + 64 rope), bf16 queries, no sink. Each context gets one pool of
``128 * context`` slots (sequence b owns slots ``[b * context, (b + 1) * context)``; 9.7 GB bf16 +
5.5 GB fp8 at 64k), the bf16 rows random normal and the FP8 rows their
:func:`pallas_kernels.quant.kv_fp8.quantize_latent` (three arrays: e4m3 values, float32 scales,
bf16 rope), so both kinds hold the same rows. A query's indices are 2048 distinct random positions
of its own sequence (``top_k`` of random logits).

Per shape three rows, each the kernel with the tuning table's config (``kernel.sparse_mla``'s own
choice): ``bf16`` rows, ``fp8 native`` (the e4m3 cast) and ``fp8 software`` (the integer decode
sm_80 runs, forced with ``fp8_decode="software"``). Each is checked on the first input set against
the float32 reference over the same cache (rel L2 <= 1e-2 on out; the fp8 reference dequantizes
the gathered rows), then timed as :mod:`benchmarks.kernels_mla` times (its
:func:`~benchmarks.kernels_mla.compile_and_check`: R input sets back to back in one jit, median of
20 replays). Input set r takes the sequences from ``r * B`` on (modulo 128), so at small B the sets
read different sequences and a replay touches >= 2.5x the 50 MiB L2 (R capped at ``MAX_SETS``:
at B = 1 the fp8 sets then hold 1.3x the L2, the bf16 ones 2.2x; B = 1 times are noisy).
``records (70830ee) us`` is the fp8 native time of the same shape with the previous layout (one
656-byte ``fp8_ds_mla`` record per token, read byte-wise;
``benchmarks/results/kernels_mla_fp8-<gpu>-records.json``), not measured in this run.

bytes = gathered rows (B * 2048 * 1152 for bf16, * 656 for FP8) + q + out (bf16) + indices;
``% stream`` is of the memory ceiling measured in the same process (:class:`benchmarks.harness.Ceilings`).
``KERNELS_MLA_FP8_ONLY`` (comma-separated ``ctx=8k H=16 B=1`` labels) limits the shapes;
``KERNELS_MLA_FP8_BUDGET_S`` (default 330) stops starting new shapes after that many seconds (the
rest are listed as skipped), ``KERNELS_MLA_FP8_FIRST_BUDGET_S`` likewise for the contexts before the
last; ``KERNELS_MLA_FP8_SOFTWARE_CTX`` (default ``8k,64k``) the contexts that time fp8 software. A
config that does not build is kept as its error and followed by ``(bn/2)`` (half the gather step),
then ``(no prefetch)``. The results file is rewritten after every shape, so a run cut short keeps
what it measured. ``b12e627 native us`` is fp8 native before the prefetching FP8 loop
(``kernels_mla_fp8-<gpu>-b12e627.json``), not measured in this run.

V4-Flash (after the profile; ``KERNELS_MLA_FP8_V4_BUDGET_S``, default 540, as the budget above;
labels ``V4-Flash 16k entries H=64 B=1`` for ``KERNELS_MLA_FP8_ONLY``): DeepSeek-V4-Flash's decode
over its compressed entries, B in {1, 8, 32, 64, 128} x its 64 attention heads (TP = 1), 512-wide
rows (448 nope + 64 rope) of which the whole row is the value (``v_dim`` 512), softmax scale
512^-0.5, 512 distinct indices per query (the indexer's top-512; the 128-token window is a second
call of its own in the model) among 16k entries per sequence (64k tokens at one entry per 4). The
pool is bf16 rows ``[128 * 16k, 512]`` (2.1 GB) and their ``kv_fp8.MODEL1`` parts (e4m3 ``[., 448]``,
ue8m0 bytes ``[., 7]``, bf16 rope ``[., 64]``: 583 bytes a row, 1.2 GB). The same three rows per
shape, checked and timed as above; bytes = B * 512 * (1024 or 583) + q + out + indices. Its own
summary section; its rows join ``Every measurement``.

Sweep (``KERNELS_MLA_FP8_SWEEP_S`` > 0: until that many seconds into the run), on the last
context's pools before its main rows: fp8 native at each of :data:`SWEEP_SHAPES` over
:data:`SWEEP_KNOBS` (warps, gather step, stages, prefetch) crossed around the table's config,
nearest first, round-robin over the shapes, each checked and timed (10 replays).

Profile (``KERNELS_MLA_FP8_PROFILE``: ``auto``, the default, runs it when fp8 native is not faster
than bf16 at some B >= 32; ``1`` always; ``0`` never), on the last context's pools until
``KERNELS_MLA_FP8_PROFILE_S`` seconds into the run: per :data:`PROFILE_SHAPES`, fp8 variants timed
with 10 replays and no correctness check (some compute wrong values on purpose): the value loader
with the e4m3 decode replaced by an integer-to-float cast (``cast``), without the scale load and
multiply (``no scale``), or both (``bytes only``: the codes converted straight to bf16); then the
native kernel at other configs (gather step, warps, stages, head block). Differences to the
``native`` row place the time: the decode, the scales, the tiling.
Writes ``benchmarks/results/kernels_mla_fp8-<gpu>.md`` (and ``.json``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import math
import os
import time
from collections.abc import Callable, Iterator

import jax
import jax.numpy as jnp
from jax import lax

from benchmarks import harness
from benchmarks.kernels_mla import DV, L2_BYTES, SCALE, TOPK, D, compile_and_check, describe
from pallas_kernels._triton import compute_capability, pltriton
from pallas_kernels.quant import kv_fp8
from pallas_kernels.sparse_mla import kernel, ref, tuning
from pallas_kernels.sparse_mla.tuning import MlaConfig

SEQS = 128  # sequences per pool: the largest B
CONTEXTS = (8192, 65536)
BATCHES = (1, 8, 32, 64, 128)
HEADS = (16, 64)
MAX_SETS = 48  # each set is one more kernel call in the timed jit
IMPLS = {"bf16": None, "fp8 native": "native", "fp8 software": "software"}  # name -> fp8_decode
BUDGET_S = float(os.environ.get("KERNELS_MLA_FP8_BUDGET_S", "330"))
FIRST_BUDGET_S = float(os.environ.get("KERNELS_MLA_FP8_FIRST_BUDGET_S", str(BUDGET_S)))
SOFTWARE_CTX = [
    int(c.strip().removesuffix("k")) * 1024
    for c in os.environ.get("KERNELS_MLA_FP8_SOFTWARE_CTX", "8k,64k").split(",")
    if c.strip()
]
SWEEP_S = float(os.environ.get("KERNELS_MLA_FP8_SWEEP_S", "0"))
ONLY = [s.strip() for s in os.environ.get("KERNELS_MLA_FP8_ONLY", "").split(",") if s.strip()]
PROFILE = os.environ.get("KERNELS_MLA_FP8_PROFILE", "auto").strip().lower()
PROFILE_S = float(os.environ.get("KERNELS_MLA_FP8_PROFILE_S", "420"))
V4_BUDGET_S = float(os.environ.get("KERNELS_MLA_FP8_V4_BUDGET_S", "540"))


@dataclasses.dataclass(frozen=True)
class Rows:
    """A model's cached rows: ``d`` columns (the queries' width), the first ``nope`` of them e4m3 in
    the FP8 form ``fmt`` (the rest bf16 rope), the first ``dv`` the value; ``topk`` indices per query,
    softmax scale ``scale``."""

    name: str
    d: int
    nope: int
    dv: int
    fmt: kv_fp8.LatentFormat
    topk: int
    scale: float

    @property
    def fp8_bytes(self) -> int:
        """Bytes of one FP8 row's three parts (656 for GLM, 583 for V4-Flash)."""
        return self.fmt.row_bytes(self.nope, self.d - self.nope)

    @property
    def fp8_rows(self) -> tuning.Fp8Rows:
        """The FP8 rows as :func:`pallas_kernels.sparse_mla.tuning.choose` takes them."""
        tile = self.fmt.tile_width(self.nope)
        return tuning.Fp8Rows(self.nope, tile, jnp.dtype(self.fmt.scale_dtype).itemsize)


GLM = Rows("GLM-5", D, DV, DV, kv_fp8.DS_MLA, TOPK, SCALE)
# DeepSeek-V4-Flash's compressed entries: K = V = the 448 + 64 row, the indexer's top-512 per query
V4_FLASH = Rows("V4-Flash", 512, 448, 512, kv_fp8.MODEL1, 512, 512**-0.5)


@dataclasses.dataclass(frozen=True)
class Shape:
    context: int  # pool rows per sequence
    h: int
    b: int
    rows: Rows = GLM

    @property
    def label(self) -> str:
        if self.rows is GLM:
            return f"ctx={self.context // 1024}k H={self.h} B={self.b}"
        return f"{self.rows.name} {self.context // 1024}k entries H={self.h} B={self.b}"

    def nbytes(self, row_bytes: int) -> int:
        r = self.rows
        return self.b * r.topk * row_bytes + self.b * self.h * (r.d + r.dv) * 2 + self.b * r.topk * 4

    @property
    def sets(self) -> int:
        return max(1, min(MAX_SETS, math.ceil(2.5 * L2_BYTES / self.nbytes(self.rows.fp8_bytes))))


SHAPES = [Shape(c, h, b) for c in CONTEXTS for h in HEADS for b in BATCHES]
# V4-Flash decode (its 64 heads at TP = 1): 16k compressed entries per sequence (64k tokens, one
# entry per 4 on its CSA layers), 2.1 GB of bf16 rows in all.
V4_CONTEXT = 16384
V4_SHAPES = [Shape(V4_CONTEXT, 64, b, V4_FLASH) for b in BATCHES]
# Profile shapes (the last context's pools): one pass of 64-head programs, 16 heads over two
# splits, and a K-split batch of 64-head programs.
PROFILE_SHAPES = [Shape(CONTEXTS[-1], 64, 128), Shape(CONTEXTS[-1], 16, 128), Shape(CONTEXTS[-1], 64, 32)]
# Config sweep shapes (the last context's pools), and the knobs it crosses.
SWEEP_SHAPES = [Shape(CONTEXTS[-1], h, b) for b in (128, 32) for h in (16, 64)]
SWEEP_KNOBS = {"num_warps": (4, 8), "block_n": (32, 64), "num_stages": (1, 2, 3), "prefetch": (False, True)}


def _pools(context: int, rows: Rows = GLM) -> tuple[tuple[jax.Array], tuple[jax.Array, ...]]:
    """bf16 rows ``[SEQS * context, d]`` and their FP8 parts in ``rows.fmt`` (quantized in chunks, so
    the float32 temporaries stay small)."""
    n = SEQS * context
    pool = jax.jit(lambda k: jax.random.normal(k, (n, rows.d), jnp.bfloat16))(jax.random.key(context))
    chunk = math.gcd(n, 1 << 16)

    @jax.jit
    def quantize(r):
        parts = lax.map(lambda c: rows.fmt.quantize(c, rows.nope), r.reshape(-1, chunk, rows.d))
        return tuple(p.reshape(n, -1) for p in parts)

    return jax.block_until_ready(((pool,), quantize(pool)))


@functools.partial(jax.jit, static_argnames=("b", "h", "context", "rows"))
def _make_set(key, first, *, b: int, h: int, context: int, rows: Rows = GLM):
    """q [b, h, d] bf16 and indices [b, topk]: distinct positions of sequences first .. first+b-1."""
    kq, ki = jax.random.split(key)
    q = jax.random.normal(kq, (b, h, rows.d), jnp.bfloat16)
    _, pos = jax.lax.top_k(jax.random.uniform(ki, (b, context)), rows.topk)
    seqs = (first + jnp.arange(b, dtype=jnp.int32)) % SEQS
    return q, seqs[:, None] * context + pos.astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("rows",))
def _reference(q, idx, kv, kv_scale=None, kv_rope=None, *, rows: Rows = GLM):
    return ref.sparse_mla(q, kv, idx, sm_scale=rows.scale, v_dim=rows.dv, kv_scale=kv_scale, kv_rope=kv_rope)


def _kernel_fn(fp8_decode: str | None, config: MlaConfig | None = None, rows: Rows = GLM) -> Callable:
    def fn(q, idx, kv, kv_scale=None, kv_rope=None):
        return kernel.sparse_mla(
            q,
            kv,
            idx,
            sm_scale=rows.scale,
            v_dim=rows.dv,
            kv_scale=kv_scale,
            kv_rope=kv_rope,
            fp8_decode=fp8_decode,
            config=config,
        )

    return fn


def _config(shape: Shape, fp8: bool) -> MlaConfig:
    """The config ``kernel.sparse_mla`` chooses for the shape's bf16 (or FP8) rows."""
    r = shape.rows
    if fp8:
        return tuning.choose(shape.b, shape.h, r.topk, d_v=r.dv, d_r=r.d - r.nope, itemsize=2, fp8=r.fp8_rows)
    return tuning.choose(shape.b, shape.h, r.topk, d_v=r.dv, d_r=r.d - r.dv, itemsize=2)


def _shape_sets(shape: Shape) -> list[tuple]:
    keys = jax.random.split(jax.random.key(1000 * shape.h + shape.b), shape.sets)
    return [
        _make_set(k, r * shape.b, b=shape.b, h=shape.h, context=shape.context, rows=shape.rows)
        for r, k in enumerate(keys)
    ]


def _time_row(shape: Shape, us: float, row_bytes: int, ceilings: harness.Ceilings) -> dict:
    gbs = shape.nbytes(row_bytes) / (us * 1e-6) / 1e9
    return {"us": us, "GB/s": gbs, "% stream": 100 * gbs / ceilings.stream_gbs}


def run(ceilings: harness.Ceilings | None = None) -> list[dict]:
    start = time.perf_counter()
    clock = lambda: time.perf_counter() - start  # noqa: E731
    ceilings = ceilings or harness.measure_ceilings()
    print(
        f"kernels_mla_fp8: cc {compute_capability()}, stream {ceilings.stream_gbs:.0f} GB/s [{clock():.0f}s]"
    )
    shapes = [s for s in SHAPES if not ONLY or s.label in ONLY]
    rows: list[dict] = []
    profile: list[dict] = []
    sweep: list[dict] = []
    v4: list[dict] = []

    def write() -> None:
        _write_report(rows, profile, ceilings, clock(), sweep, v4)

    pools: dict[str, tuple] = {}
    for context in CONTEXTS:
        todo = [s for s in shapes if s.context == context]
        if not todo:
            continue
        pools.clear()  # the last context's pools go before the next ones are made
        pools.update(zip(("bf16", "fp8"), _pools(context), strict=True))
        print(f"kernels_mla_fp8: pools for {context} tokens ready [{clock():.0f}s]")
        last = context == CONTEXTS[-1]
        if last and SWEEP_S > 0:
            _sweep(pools, sweep, ceilings, clock, write)
        budget = BUDGET_S if last else FIRST_BUDGET_S
        for shape in todo:
            _measure(shape, pools, rows, ceilings, clock, budget)
            write()
    if PROFILE == "1" or (PROFILE == "auto" and _fp8_not_faster(rows)):
        _profile(pools, profile, ceilings, clock, write)
    v4_shapes = [s for s in V4_SHAPES if not ONLY or s.label in ONLY]
    if v4_shapes:
        pools.clear()
        pools.update(zip(("bf16", "fp8"), _pools(V4_CONTEXT, V4_FLASH), strict=True))
        print(f"kernels_mla_fp8: {V4_FLASH.name} pools ready [{clock():.0f}s]")
        for shape in v4_shapes:
            _measure(shape, pools, v4, ceilings, clock, V4_BUDGET_S)
            write()
    write()
    return rows + v4


def _measure(shape: Shape, pools: dict[str, tuple], rows: list[dict], ceilings, clock, budget: float) -> None:
    """Rows of :data:`IMPLS` at ``shape`` over ``pools`` (its model's bf16 rows and FP8 parts), each
    with the table's config (and fallbacks where it does not build), checked against the reference
    and timed; listed as not run once ``clock()`` is past ``budget``."""
    if clock() > budget:
        rows += [{"shape": shape.label, "impl": name, "note": "not run: time budget"} for name in IMPLS]
        return
    sets = _shape_sets(shape)
    q0, idx0 = sets[0]
    wants = {
        kind: _reference(q0.astype(jnp.float32), idx0, *kv, rows=shape.rows) for kind, kv in pools.items()
    }
    for name, mode in IMPLS.items():
        if mode == "software" and shape.rows is GLM and shape.context not in SOFTWARE_CTX:
            rows.append(
                {"shape": shape.label, "impl": name, "note": "not run (KERNELS_MLA_FP8_SOFTWARE_CTX)"}
            )
            continue
        kind = "bf16" if mode is None else "fp8"
        kv, want = pools[kind], wants[kind]
        row_bytes = shape.rows.fp8_bytes if mode else shape.rows.d * 2
        cfg = _config(shape, fp8=mode is not None)
        row = {"shape": shape.label, "impl": name, "config": describe(cfg), "sets": len(sets)}
        row["MB"] = shape.nbytes(row_bytes) / 1e6
        fn_sets = [(*s, *kv) for s in sets]
        checked, timer = compile_and_check(_kernel_fn(mode, rows=shape.rows), fn_sets, want, shape.b)
        fallbacks = [("bn/2", {"block_n": cfg.block_n // 2})] if cfg.block_n > 16 else []
        fallbacks += [("no prefetch", {"prefetch": False})] if cfg.prefetch else []
        for tag, change in fallbacks:
            if timer is not None or checked.get("note", "").startswith("FAILED"):
                break
            # the table's config did not build (shared memory?): keep its error, time a fallback
            rows.append(row | checked)
            cfg = dataclasses.replace(cfg, **change)
            row |= {"impl": f"{name} ({tag})", "config": describe(cfg)}
            checked, timer = compile_and_check(_kernel_fn(mode, cfg, shape.rows), fn_sets, want, shape.b)
        row |= checked
        if timer:
            row |= _time_row(shape, timer(20), row_bytes, ceilings)
        rows.append(row)
        print(f"{shape.label} {name}: {row.get('us', row.get('note'))} [{clock():.0f}s]")


def _fp8_not_faster(rows: list[dict]) -> bool:
    """Whether fp8 native is not faster than bf16 at some measured shape with B >= 32."""
    return any(
        line.get("bf16/native", 2.0) <= 1.0
        for line in _summary(rows)
        if int(line["shape"].split("B=")[1]) >= 32
    )


# ---- profile: where the fp8 time goes --------------------------------------------------------------


def _variant_values(decode: str, scaled: bool) -> Callable:
    """A stand-in for :func:`pallas_kernels.sparse_mla.kernel._load_values` on FP8 rows: ``decode``
    "native" (the e4m3 cast), "cast" (an integer-to-float cast of the codes: wrong values, no decode
    work) or "bytes" (the codes straight to the operand dtype; no float32 step, never scaled);
    ``scaled``: load and apply the per-row scales."""

    def load_values(kv_ref, scale_ref, rows, ok, g, dtype):
        tiles = []
        for group, (c, w, wp) in enumerate(g.groups):
            codes = kernel._load_tile(kv_ref, rows, ok, c, w, wp)
            if decode == "bytes":
                tiles.append(codes.astype(dtype))
                continue
            if decode == "native":
                values = lax.bitcast_convert_type(codes, jnp.float8_e4m3fn).astype(jnp.float32)
            else:
                values = codes.astype(jnp.float32)
            if scaled:
                scale = pltriton.load(scale_ref.at[rows * len(g.groups) + group], mask=ok, other=0.0)
                values = values * scale[:, None]
            tiles.append(values.astype(dtype))
        return tiles

    return load_values


@contextlib.contextmanager
def _loader(load_values: Callable | None) -> Iterator[None]:
    """Trace the kernel with ``load_values`` in place of its value loader (None: the kernel's own)."""
    own = kernel._load_values
    kernel._load_values = load_values or own
    try:
        yield
    finally:
        kernel._load_values = own


_DECODE_VARIANTS = {
    "native": None,
    "cast": _variant_values("cast", scaled=True),
    "no scale": _variant_values("native", scaled=False),
    "bytes only": _variant_values("bytes", scaled=False),
}


def _config_variants(base: MlaConfig) -> dict[str, MlaConfig]:
    r = functools.partial(dataclasses.replace, base)
    half = max(16, base.block_n // 2)
    cands = {  # most telling first: the profile's budget may stop the list
        "stages3": r(num_stages=3),
        "bn/2": r(block_n=half),
        "bn/2 stages3": r(block_n=half, num_stages=3),
        "warps16": r(num_warps=16),
        "warps4": r(num_warps=4),
        "stages1": r(num_stages=1),
        "bh/2": r(block_h=max(16, base.block_h // 2)),
        "bn*2": r(block_n=base.block_n * 2),
    }
    return {name: cfg for name, cfg in cands.items() if cfg != base}


def _time_only(fn: Callable, sets: list, replays: int = 10) -> float:
    """us per call of ``fn`` over ``sets`` (one jit, as :func:`compile_and_check` times), no check."""
    one = jax.jit(fn)
    run_all = jax.jit(lambda sets: [one(*s) for s in sets])
    jax.block_until_ready(run_all(sets))
    return harness.median_seconds(lambda: run_all(sets), len(sets), replays) * 1e6


def _profile(pools, profile: list[dict], ceilings, clock, write) -> None:
    print(f"kernels_mla_fp8: profile [{clock():.0f}s]")
    shapes = [s for s in PROFILE_SHAPES if s.context == CONTEXTS[-1]]
    # the value-loader stand-ins replace the loop that loads and decodes in one step (no prefetch)
    jobs = [
        (s, name, loader, dataclasses.replace(_config(s, fp8=True), prefetch=False))
        for s in shapes
        for name, loader in _DECODE_VARIANTS.items()
    ]
    for s in shapes:
        jobs += [(s, name, None, cfg) for name, cfg in _config_variants(_config(s, fp8=True)).items()]
    sets_of: dict[Shape, list] = {}
    for shape, name, loader, cfg in jobs:
        if clock() > PROFILE_S:
            profile.append({"shape": shape.label, "variant": name, "note": "not run: time budget"})
            continue
        if shape not in sets_of:
            sets_of[shape] = [(*s, *pools["fp8"]) for s in _shape_sets(shape)]
        row = {"shape": shape.label, "variant": name, "config": describe(cfg or _config(shape, fp8=True))}
        try:
            with _loader(loader):
                us = _time_only(_kernel_fn("native", cfg), sets_of[shape])
            row |= _time_row(shape, us, shape.rows.fp8_bytes, ceilings)
        except Exception as exc:  # noqa: BLE001 - a config that does not build is a row, not the end
            row["note"] = harness.error_note(exc)
        profile.append(row)
        print(f"profile {shape.label} {name}: {row.get('us', row.get('note'))} [{clock():.0f}s]")
        write()


# ---- config sweep ----------------------------------------------------------------------------------


def _sweep_candidates(base: MlaConfig) -> list[MlaConfig]:
    """:data:`SWEEP_KNOBS` crossed around ``base`` (its head block and splits), nearest first (the
    number of knobs that differ), so a sweep cut short by its budget has the one-knob moves."""
    names = list(SWEEP_KNOBS)
    cands = [
        dataclasses.replace(base, **dict(zip(names, vals, strict=True))) for vals in _product(SWEEP_KNOBS)
    ]
    order = ("prefetch", "num_warps", "block_n", "num_stages")  # among equals, the prefetch move first

    def key(c: MlaConfig) -> tuple:
        moved = [getattr(c, n) != getattr(base, n) for n in order]
        return sum(moved), [not m for m in moved]

    return sorted({c: None for c in [base, *cands]}, key=key)


def _product(knobs: dict) -> list[tuple]:
    out = [()]
    for vals in knobs.values():
        out = [(*o, v) for o in out for v in vals]
    return out


def _sweep(pools, sweep: list[dict], ceilings, clock, write) -> None:
    """fp8 native at :func:`_sweep_candidates` of the table's config per :data:`SWEEP_SHAPES`,
    round-robin over the shapes (nearest candidates first) until ``KERNELS_MLA_FP8_SWEEP_S``; each
    checked against the reference like the main rows, timed with 10 replays."""
    print(f"kernels_mla_fp8: sweep [{clock():.0f}s]")
    shapes = [s for s in SWEEP_SHAPES if s.context == CONTEXTS[-1]]
    queues = {s: _sweep_candidates(_config(s, fp8=True)) for s in shapes}
    budget = tuning.shared_memory_budget(compute_capability())
    state: dict[Shape, tuple] = {}
    while any(queues.values()):
        for shape in shapes:
            if not queues[shape]:
                continue
            cfg = queues[shape].pop(0)
            row = {"shape": shape.label, "config": describe(cfg)}
            row["default"] = "yes" if cfg == _config(shape, fp8=True) else ""
            if clock() > SWEEP_S:
                sweep.append(row | {"note": "not run: time budget"})
                continue
            if tuning.smem_bytes(cfg, d_v=DV, d_r=D - DV, itemsize=2, fp8=True) > budget:
                sweep.append(row | {"note": "not run: over the shared-memory estimate"})
                continue
            if shape not in state:
                sets = _shape_sets(shape)
                q0, idx0 = sets[0]
                want = _reference(q0.astype(jnp.float32), idx0, *pools["fp8"])
                state[shape] = ([(*s, *pools["fp8"]) for s in sets], want)
            fn_sets, want = state[shape]
            checked, timer = compile_and_check(_kernel_fn("native", cfg), fn_sets, want, shape.b)
            row |= checked
            if timer:
                row |= _time_row(shape, timer(10), shape.rows.fp8_bytes, ceilings)
            sweep.append(row)
            print(f"sweep {shape.label} {row['config']}: {row.get('us', row.get('note'))} [{clock():.0f}s]")
            write()


# ---- report ----------------------------------------------------------------------------------------

COLUMNS = ("shape", "impl", "config", "sets", "MB", "us", "GB/s", "% stream", "rel_err", "lse_err", "note")
PROFILE_COLUMNS = ("shape", "variant", "config", "us", "GB/s", "% stream", "note")
SWEEP_COLUMNS = ("shape", "config", "default", "us", "GB/s", "% stream", "rel_err", "note")


def _records_us() -> dict[str, float]:
    """fp8 native us per shape with the records layout (70830ee), where that file is here."""
    records = harness.RESULTS / f"kernels_mla_fp8-{harness.gpu_slug()}-records.json"
    if not records.exists():
        return {}
    rows = json.loads(records.read_text())["rows"]
    return {r["shape"]: r["us"] for r in rows if r.get("impl") == "fp8 native" and "us" in r}


def _b12e627_us() -> dict[str, tuple[float, str]]:
    """fp8 native (us, config) per shape at b12e627 (``kernels_mla_fp8-<gpu>-b12e627.json``): its
    main rows (the ``(bn/2)`` fallback where the table's tile did not build), else its profile's
    ``native`` row, else its profile row at the config b12e627's table chose there (bh64 bn64 s1)."""
    path = harness.RESULTS / f"kernels_mla_fp8-{harness.gpu_slug()}-b12e627.json"
    if not path.exists():
        return {}
    out: dict[str, tuple[float, str]] = {}
    rows = json.loads(path.read_text())["rows"]
    for r in rows:
        if r.get("impl", "").split(" (")[0] == "fp8 native" and "us" in r:
            out[r["shape"]] = (r["us"], r["config"])
    for variant in ("native", "stages1"):
        for r in rows:
            if r.get("variant") == variant and "us" in r:
                out.setdefault(r["shape"], (r["us"], f"{r['config']} (profile)"))
    return out


def _summary(rows: list[dict]) -> list[dict]:
    """One line per shape: each impl's us and % of the memory ceiling, and fp8's speed-up over bf16."""
    records = _records_us()
    previous = _b12e627_us()
    by_shape: dict[str, dict] = {}
    for r in rows:
        line = by_shape.setdefault(r["shape"], {"shape": r["shape"]})
        if "us" in r:
            impl = r["impl"].split(" (")[0]
            line[f"{impl} us"] = r["us"]
            line[f"{impl} %"] = r["% stream"]
    for line in by_shape.values():
        for name in ("fp8 native", "fp8 software"):
            if "bf16 us" in line and f"{name} us" in line:
                line[f"bf16/{name.split()[1]}"] = line["bf16 us"] / line[f"{name} us"]
        if line["shape"] in records:
            line["records (70830ee) us"] = records[line["shape"]]
        if line["shape"] in previous:
            line["b12e627 native us"], line["b12e627 config"] = previous[line["shape"]]
    return list(by_shape.values())


SUMMARY_COLUMNS = (
    "shape",
    "bf16 us",
    "bf16 %",
    "fp8 native us",
    "fp8 native %",
    "fp8 software us",
    "fp8 software %",
    "bf16/native",
    "bf16/software",
    "b12e627 native us",
    "b12e627 config",
    "records (70830ee) us",
)
V4_SUMMARY_COLUMNS = SUMMARY_COLUMNS[:9]  # no earlier layouts or commits to compare with


def _write_report(
    rows: list[dict],
    profile: list[dict],
    ceilings: harness.Ceilings,
    elapsed: float,
    sweep: list[dict] = (),
    v4: list[dict] = (),
) -> None:
    text = [
        *harness.report_header(
            f"Sparse MLA decode, bf16 rows vs FP8 latent rows (576/512, top-{TOPK}, bf16 q) on "
            f"{harness.device_header()['device']}",
            harness.ceiling_rows(ceilings, elapsed),
        ),
        "Method: see the docstring of `benchmarks/kernels_mla_fp8.py`. `%` is of the memory ceiling;",
        "`bf16/native` is the bf16 time over the fp8 one (above 1: fp8 faster). FP8 rows are three",
        "arrays (e4m3 values, f32 scales, bf16 rope); `records (70830ee) us` is fp8 native with the",
        "previous one-record-per-token layout, from `kernels_mla_fp8-h200-records.md` (not this run);",
        "`b12e627 native us` is fp8 native before the prefetching loop, from",
        "`kernels_mla_fp8-h200-b12e627.md` (not this run; `b12e627 config` its config, `(profile)`: a row",
        "of that run's profile). The V4-Flash section reads DeepSeek-V4's rows (512 = 448 + 64, K = V = the",
        "whole row) as bf16 rows or MODEL1 parts (e4m3 values, ue8m0 scale bytes per 64, bf16 rope; 583",
        f"bytes a row against 1,024), {V4_FLASH.topk} indices per query.",
        "",
    ]
    sections = (
        ("Summary", _summary(rows), SUMMARY_COLUMNS),
        (
            f"{V4_FLASH.name} decode: bf16 rows vs MODEL1 FP8 rows (512 = 448 + 64, top-{V4_FLASH.topk})",
            _summary(list(v4)),
            V4_SUMMARY_COLUMNS,
        ),
        ("Sweep: fp8 native configs (`default`: this table's choice)", list(sweep), SWEEP_COLUMNS),
        ("Profile: fp8 variants (timing only, some values wrong on purpose)", profile, PROFILE_COLUMNS),
        ("Every measurement", rows + list(v4), COLUMNS),
    )
    for title, table, columns in sections:
        if table:
            text += [f"## {title}", "", harness.markdown_table(table, columns), ""]
    out = harness.write_result(
        "kernels_mla_fp8", "\n".join(text), rows=rows + profile + list(sweep) + list(v4)
    )
    print(f"kernels_mla_fp8: wrote {out}")


if __name__ == "__main__":
    run()
