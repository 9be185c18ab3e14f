"""GPU benchmark: the DeepSeek-V4 kernels at V4-Flash widths, each against its reference.

Run ``python -m benchmarks.v4_kernels`` on a GPU. V4-Flash (docs/models.md §1.1, §3): hidden 4096,
hc_mult 4 (Sinkhorn 20 iterations), 64 heads of one shared 512-wide K = V row, window 128, CSA
ratio 4 (top-512 of its compressed entries by a 64 x 128 indexer), HCA ratio 128. Kernels and
shapes, with the arguments and dtypes :mod:`jaxdsa.models.deepseek_v4` passes (streams and
activations bf16, the compressor's rows float32):

* ``hc_pre`` / ``hc_post`` (mHC): streams ``[T, 4, 4096]`` bf16, ``fn [16384, 24]`` float32;
  T in {1, 8, 32, 128, 512, 4096};
* ``compress_pool``: float32 ``kv`` / ``score`` windows: CSA (m = 4, 2 x 512 channels, the previous
  window carried), HCA (m = 128, 512), the indexer's compressor (m = 4, 2 x 128); W = 1 and 32
  windows (decode steps of 1 and 32 sequences), 1024 CSA windows (a 4096-token prefill);
* ``indexer_logits`` (prefill form, as ``indexer.select`` calls it) and ``topk_indices`` (k = 512):
  a 4096-token prefill over its 1024 entries (causal), and one query over 16384 / 65536 entries
  (64K / 256K tokens of context);
* ``sparse_mla`` (no sink) + ``merge_states`` (with the per-head sink), as ``attention_sequence``
  joins its window and compressed parts: decode batches B in {1, 8, 32, 128} (window: 128 rows,
  CSA: 512 entries, gathered from pools of 262144 / 65536 rows at random), the 4096-token prefill
  (window rows = the tokens, CSA picks among the complete entries, HCA all complete entries); each
  part alone, the merge alone, and window + CSA + merge in one jit ("attention").

Method: every kernel is first checked against its pure-JAX reference (``pallas_kernels/*/ref.py``)
evaluated in float32 on the same inputs (rel L2 of each output <= 1e-2; top-k: the selected values
must be the k largest), then timed as :mod:`benchmarks.harness` does: one jit over R distinct input
sets (R sized so a replay touches >= 2.5x the 50 MiB L2, at most 32), median over 20 replays. The
reference itself is timed on the same inputs (the ``reference`` kernel backend, XLA). Bytes are the
minimum a call moves through HBM: every input read once (for gathers, the gathered rows once each;
prefill window rows, read by 128 queries each, count once), every output written once; "% ceiling"
is of the faster of the copy and read-only ceilings measured in this run, "% mm" of the bf16
matmul ceiling (flops: 2 per multiply-add of the dots). ``V4_BUDGET_S`` (default 300) stops new
measurements; ``V4_KERNELS=sparse_mla,indexer_logits:decode`` runs only those kernels' cases
(``kernel:prefix``: the cases whose shape starts so); ``V4_MAX_SETS`` caps R (each set is a copy
of the kernel in the timed jit, so compile time grows with it) and ``V4_REFERENCE=0`` times only
the kernels (the reference still checks them). ``hc_pre`` runs
twice per T: the tuning table's choice and the fused kernel (``splits`` = 1, see
:mod:`pallas_kernels.mhc.tuning`). Writes ``benchmarks/results/v4_kernels-<gpu>.md`` (and
``V4_JSON=path`` dumps the rows; ``python -m benchmarks.v4_kernels merge OUT.md A.json B.json``
joins several runs' dumps into one file).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import pathlib
import time
import traceback
import zlib
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import harness, quant
from pallas_kernels.compress_pool import kernel as pool_kernel
from pallas_kernels.compress_pool import ref as pool_ref
from pallas_kernels.indexer_logits import kernel as idx_kernel
from pallas_kernels.indexer_logits import ref as idx_ref
from pallas_kernels.merge_states import kernel as merge_kernel
from pallas_kernels.merge_states import ref as merge_ref
from pallas_kernels.mhc import kernel as mhc_kernel
from pallas_kernels.mhc import ref as mhc_ref
from pallas_kernels.mhc import tuning as mhc_tuning
from pallas_kernels.sparse_mla import kernel as mla_kernel
from pallas_kernels.sparse_mla import ref as mla_ref
from pallas_kernels.topk import kernel as topk_kernel
from pallas_kernels.topk import ref as topk_ref

TOLERANCE = 1e-2
L2_BYTES = 50 * 2**20
MAX_SETS = 32


@dataclasses.dataclass(frozen=True)
class Widths:
    hidden: int
    hc_mult: int
    heads: int
    head_dim: int
    window: int
    index_heads: int
    index_dim: int
    index_topk: int
    csa: int  # CSA compression ratio m
    hca: int
    tokens: tuple[int, ...]  # mHC token counts
    batches: tuple[int, ...]  # decode batch sizes
    prefill: int  # prefill length
    contexts: tuple[int, ...]  # decode contexts (tokens) of the indexer rows
    pools: tuple[int, int]  # decode pools: window rows, compressed entries
    pool_windows: tuple[int, ...]  # W of the compress_pool rows (prefill // csa is added)
    sinkhorn_iters: int = 20
    eps: float = 1e-6
    interpret: bool = False
    ceiling_bytes: int = 1 << 30
    replays: int = 20


FLASH = Widths(
    hidden=4096,
    hc_mult=4,
    heads=64,
    head_dim=512,
    window=128,
    index_heads=64,
    index_dim=128,
    index_topk=512,
    csa=4,
    hca=128,
    tokens=(1, 8, 32, 128, 512, 4096),
    batches=(1, 8, 32, 128),
    prefill=4096,
    contexts=(65536, 262144),
    pools=(262144, 65536),
    pool_windows=(1, 32),
)
# tests/benchmarks/test_v4_kernels.py: every case at toy widths in interpret mode on the CPU.
TINY = Widths(
    hidden=64,
    hc_mult=4,
    heads=4,
    head_dim=64,
    window=8,
    index_heads=16,
    index_dim=32,
    index_topk=8,
    csa=4,
    hca=16,
    tokens=(5,),
    batches=(2,),
    prefill=64,
    contexts=(256,),
    pools=(128, 64),
    pool_windows=(1,),
    interpret=True,
    ceiling_bytes=1 << 20,
    replays=2,
)


@dataclasses.dataclass
class Case:
    """One kernel at one shape: input sets, both implementations, the check, bytes and flops."""

    kernel: str
    shape: str
    make: Callable[[jax.Array], tuple]  # key -> one input set
    pallas: Callable
    reference: Callable
    mbytes: float
    gflop: float = 0.0
    check: Callable | None = None  # (got, f32 reference, inputs) -> rel error; default: rel L2 per output
    time_reference: bool = True  # False where another case already times the same reference


# ---- inputs -------------------------------------------------------------------------------------------


def _normal(key, shape, dtype=jnp.bfloat16, scale=1.0):
    return (jax.random.normal(key, shape, jnp.float32) * scale).astype(dtype)


def _mhc_cases(w: Widths) -> list[Case]:
    n, d = w.hc_mult, w.hidden
    mix = (2 + n) * n
    kw = dict(iters=w.sinkhorn_iters, hc_eps=w.eps, norm_eps=w.eps)
    out = []
    for t in w.tokens:

        def make_pre(key, t=t):
            k1, k2, k3 = jax.random.split(key, 3)
            scale = jnp.array([0.8, 1.1, 0.9], jnp.float32)
            return (
                _normal(k1, (t, n, d)),
                _normal(k2, (n * d, mix), jnp.float32, (n * d) ** -0.5),
                _normal(k3, (mix,), jnp.float32, 0.5),
                scale,
            )

        def make_post(key, t=t):
            k1, k2, k3, k4 = jax.random.split(key, 4)
            comb = jax.nn.softmax(_normal(k4, (t, n, n), jnp.float32), axis=-1)
            return _normal(k1, (t, n, d)), _normal(k2, (t, d)), _normal(k3, (t, n), jnp.float32), comb

        pre_bytes = t * n * d * 2 + n * d * mix * 4 + t * d * 2 + t * (n + n * n) * 4
        out.append(
            Case(
                "hc_pre",
                f"T={t}",
                make_pre,
                lambda *a: mhc_kernel.hc_pre(*a, **kw, interpret=w.interpret),
                lambda *a: mhc_ref.hc_pre(*a, **kw),
                pre_bytes / 1e6,
                (2 * t * n * d * mix + 2 * t * n * d) / 1e9,
            )
        )
        fused = mhc_tuning.MhcConfig(**{**dataclasses.asdict(mhc_tuning.choose(t, n, d)), "splits": 1})
        out.append(
            Case(
                "hc_pre",
                f"T={t} fused",
                make_pre,
                lambda *a, fused=fused: mhc_kernel.hc_pre(*a, **kw, interpret=w.interpret, config=fused),
                lambda *a: mhc_ref.hc_pre(*a, **kw),
                pre_bytes / 1e6,
                (2 * t * n * d * mix + 2 * t * n * d) / 1e9,
                time_reference=False,
            )
        )
        post_bytes = 2 * t * n * d * 2 + t * d * 2 + t * (n + n * n) * 4
        out.append(
            Case(
                "hc_post",
                f"T={t}",
                make_post,
                lambda *a: mhc_kernel.hc_post(*a, interpret=w.interpret),
                mhc_ref.hc_post,
                post_bytes / 1e6,
            )
        )
    return out


def _pool_cases(w: Widths) -> list[Case]:
    kinds = [  # (name, window rows m, entry width d, overlapping)
        ("CSA", w.csa, w.head_dim, True),
        ("HCA", w.hca, w.head_dim, False),
        ("indexer CSA", w.csa, w.index_dim, True),
    ]
    out = []
    for name, m, d, overlap in kinds:
        cd = 2 * d if overlap else d
        counts = list(w.pool_windows) + ([w.prefill // m] if w.prefill // m not in w.pool_windows else [])
        for windows in counts:

            def make(key, windows=windows, m=m, d=d, cd=cd, overlap=overlap):
                k1, k2, k3, k4, k5 = jax.random.split(key, 5)
                kv = _normal(k1, (windows, m, cd), jnp.float32)
                score = _normal(k2, (windows, m, cd), jnp.float32)
                norm = 1.0 + _normal(k3, (d,), jnp.float32, 0.1)
                if not overlap:
                    return kv, score, norm
                return kv, score, norm, _normal(k4, (m, d), jnp.float32), _normal(k5, (m, d), jnp.float32)

            def call(fn, *a, **extra):
                prev = dict(prev_kv=a[3], prev_score=a[4]) if len(a) == 5 else {}
                return fn(a[0], a[1], a[2], eps=w.eps, **prev, **extra)

            nbytes = 2 * windows * m * cd * 4 + windows * d * 4 + d * 4 + (2 * m * d * 4 if overlap else 0)
            out.append(
                Case(
                    "compress_pool",
                    f"{name} m={m} d={d} W={windows}",
                    make,
                    lambda *a: call(pool_kernel.compress_pool, *a, interpret=w.interpret),
                    lambda *a: call(pool_ref.compress_pool, *a),
                    nbytes / 1e6,
                )
            )
    return out


def _topk_check(got, want_logits, inputs) -> float:
    """Fraction of rows whose selected values are not the k largest (ties aside)."""
    logits = np.asarray(inputs[0], np.float32)
    got = np.asarray(got)
    k = got.shape[1]
    picked = np.where(got >= 0, np.take_along_axis(logits, np.maximum(got, 0), axis=1), -np.inf)
    top = -np.sort(-logits, axis=1)[:, :k]
    bad = ~np.all(np.sort(picked, axis=1) == np.sort(top, axis=1), axis=1)
    return float(bad.mean())


def _indexer_cases(w: Widths) -> list[Case]:
    hi, di = w.index_heads, w.index_dim
    shapes = [("prefill", w.prefill, w.prefill // w.csa)] + [("decode", 1, c // w.csa) for c in w.contexts]
    out = []
    for kind, t, s in shapes:

        def make(key, t=t, s=s, kind=kind):
            k1, k2, k3 = jax.random.split(key, 3)
            q = _normal(k1, (t, hi, di))
            wts = _normal(k2, (t, hi), jnp.float32, hi**-0.5 * di**-0.5)
            keys = _normal(k3, (s, di))
            if kind == "prefill":  # query p sees the entries complete at p: j < (p + 1) // m
                q_pos = (jnp.arange(t, dtype=jnp.int32) + 1) // w.csa - 1
            else:
                q_pos = jnp.full((t,), s - 1, jnp.int32)
            return q, wts, keys, q_pos

        nbytes = t * hi * di * 2 + t * hi * 4 + s * di * 2 + t * 4 + t * s * 4
        label = f"{kind} T={t} S={s}"
        out.append(
            Case(
                "indexer_logits",
                label,
                make,
                lambda q, wt, k, p: idx_kernel.indexer_logits(q, wt, k, q_pos=p, interpret=w.interpret),
                lambda q, wt, k, p: idx_ref.indexer_logits(q, wt, k, q_pos=p),
                nbytes / 1e6,
                2 * t * s * hi * di / 1e9,
            )
        )
        k = min(w.index_topk, s)

        def make_logits(key, t=t, s=s, kind=kind):
            logits = jax.random.normal(key, (t, s), jnp.float32)
            if kind == "prefill":
                visible = (jnp.arange(t)[:, None] + 1) // w.csa > jnp.arange(s)[None, :]
                logits = jnp.where(visible, logits, -jnp.inf)
            return (logits,)

        out.append(
            Case(
                "topk_indices",
                f"{label} k={k}",
                make_logits,
                lambda x, k=k: topk_kernel.topk_indices(x, k, interpret=w.interpret),
                lambda x, k=k: topk_ref.topk_indices(x, k),
                (t * s * 4 + t * k * 4) / 1e6,
                check=_topk_check,
            )
        )
    return out


@functools.lru_cache(maxsize=4)
def _pool(rows: int, d: int) -> jax.Array:
    """A decode KV pool, shared by every input set and case of its size: the gathered rows are random
    over 262144 (65536) rows, far beyond the L2, so one pool serves (and saves 32 x 268 MB)."""
    return _normal(jax.random.key(rows), (rows, d))


def _random_picks(key, t: int, k: int, pool: int) -> jax.Array:
    return jax.random.randint(key, (t, k), 0, pool, jnp.int32)


def _prefill_picks(key, t: int, k: int, ratio: int, *, everything: bool) -> jax.Array:
    """Per query p, entries complete at p (j < (p + 1) // m): all of them (HCA) or k at random (CSA,
    standing in for the indexer's choice), -1 past the complete ones."""
    complete = (jnp.arange(t, dtype=jnp.int32) + 1) // ratio
    if everything:
        j = jnp.arange(k, dtype=jnp.int32)[None, :]
        return jnp.where(j < complete[:, None], j, -1)
    draw = jax.random.randint(key, (t, k), 0, 1 << 30) % jnp.maximum(complete, 1)[:, None]
    return jnp.where(jnp.arange(k)[None, :] < complete[:, None], draw, -1).astype(jnp.int32)


def _mla_cases(w: Widths) -> list[Case]:
    h, d = w.heads, w.head_dim
    scale = d**-0.5
    win_pool, cmp_pool = w.pools
    k_win, k_cmp = w.window, w.index_topk
    mla = lambda q, kv, idx: mla_kernel.sparse_mla(q, kv, idx, sm_scale=scale, v_dim=d, interpret=w.interpret)  # noqa: E731
    mla_r = lambda q, kv, idx: mla_ref.sparse_mla(q, kv, idx, sm_scale=scale, v_dim=d)  # noqa: E731

    def merge(parts, sink, impl):
        outs, lses = zip(*parts)
        if impl is merge_ref.merge_states:
            return impl(jnp.stack(outs), jnp.stack(lses), sink=sink)
        return impl(jnp.stack(outs), jnp.stack(lses), sink, interpret=w.interpret)

    def attention(impl_mla, impl_merge):
        return lambda q, kv_w, i_w, kv_c, i_c, sink: merge(
            [impl_mla(q, kv_w, i_w), impl_mla(q, kv_c, i_c)], sink, impl_merge
        )

    def mla_bytes(t, k_valid, kv_item=2):
        return t * k_valid * d * kv_item + 2 * t * h * d * 2 + t * h * 4 + t * k_valid * 4

    out = []
    for b in w.batches:

        def make_part(key, b=b, k=k_win, pool=win_pool):
            k1, k3 = jax.random.split(key)
            return _normal(k1, (b, h, d)), _pool(pool, d), _random_picks(k3, b, k, pool)

        for name, k, pool in (("window", k_win, win_pool), ("CSA", k_cmp, cmp_pool)):
            out.append(
                Case(
                    "sparse_mla",
                    f"decode {name} B={b} K={k}",
                    lambda key, b=b, k=k, pool=pool: make_part(key, b, k, pool),
                    mla,
                    mla_r,
                    mla_bytes(b, k) / 1e6,
                    2 * b * h * k * 2 * d / 1e9,
                )
            )

        def make_merge(key, b=b):
            k1, k2, k3 = jax.random.split(key, 3)
            lses = _normal(k2, (2, b, h), jnp.float32, 3.0)
            return _normal(k1, (2, b, h, d)), lses, _normal(k3, (h,), jnp.float32)

        out.append(
            Case(
                "merge_states",
                f"decode 2 parts + sink B={b}",
                make_merge,
                lambda o, ls, s: merge_kernel.merge_states(o, ls, s, interpret=w.interpret),
                lambda o, ls, s: merge_ref.merge_states(o, ls, sink=s),
                (3 * b * h * d * 2 + 3 * b * h * 4 + h * 4) / 1e6,
            )
        )

        def make_attn(key, b=b):
            k1, k3, k5, k6 = jax.random.split(key, 4)
            return (
                _normal(k1, (b, h, d)),
                _pool(win_pool, d),
                _random_picks(k3, b, k_win, win_pool),
                _pool(cmp_pool, d),
                _random_picks(k5, b, k_cmp, cmp_pool),
                _normal(k6, (h,), jnp.float32),
            )

        out.append(
            Case(
                "attention",
                f"decode window + CSA + sink B={b}",
                make_attn,
                attention(mla, merge_kernel.merge_states),
                attention(mla_r, merge_ref.merge_states),
                (mla_bytes(b, k_win + k_cmp) + b * h * d * 2 * 2) / 1e6,  # + the merge's two partials
                2 * b * h * (k_win + k_cmp) * 2 * d / 1e9,
            )
        )

    # Prefill of T tokens from position 0, as attention_sequence: window keys are the token rows.
    t = w.prefill
    n_cmp, n_hca = t // w.csa, t // w.hca
    win_idx = jnp.arange(t, dtype=jnp.int32)[:, None] - (k_win - 1) + jnp.arange(k_win, dtype=jnp.int32)
    win_idx = jnp.where(win_idx >= 0, win_idx, -1)
    k_csa = min(k_cmp, n_cmp)
    valid = {  # mean selected keys per query, for flops
        "window": float(np.mean(np.minimum(np.arange(t) + 1, k_win))),
        "CSA": float(np.mean(np.minimum((np.arange(t) + 1) // w.csa, k_csa))),
        "HCA": float(np.mean((np.arange(t) + 1) // w.hca)),
    }

    def make_prefill(key, kind, kv_dtype=jnp.bfloat16):
        k1, k2, k3 = jax.random.split(key, 3)
        q = _normal(k1, (t, h, d))
        if kind == "window":
            return q, _normal(k2, (t, d)), win_idx
        if kind == "CSA":
            return q, _normal(k2, (n_cmp, d), kv_dtype), _prefill_picks(k3, t, k_csa, w.csa, everything=False)
        return q, _normal(k2, (n_hca, d), kv_dtype), _prefill_picks(k3, t, n_hca, w.hca, everything=True)

    rows_read = {"window": t, "CSA": n_cmp, "HCA": n_hca}
    for kind in ("window", "CSA", "HCA"):
        k = {"window": k_win, "CSA": k_csa, "HCA": n_hca}[kind]
        nbytes = rows_read[kind] * d * 2 + 2 * t * h * d * 2 + t * h * 4 + t * k * 4
        out.append(
            Case(
                "sparse_mla",
                f"prefill {kind} T={t} K={k}",
                lambda key, kind=kind: make_prefill(key, kind),
                mla,
                mla_r,
                nbytes / 1e6,
                2 * t * h * valid[kind] * 2 * d / 1e9,
            )
        )
    # The compressed entries as attention_sequence passes them today: float32 (the compressor's dtype).
    out.append(
        Case(
            "sparse_mla",
            f"prefill CSA T={t} K={k_csa} f32 entries",
            lambda key: make_prefill(key, "CSA", jnp.float32),
            mla,
            mla_r,
            (n_cmp * d * 4 + 2 * t * h * d * 2 + t * h * 4 + t * k_csa * 4) / 1e6,
            2 * t * h * valid["CSA"] * 2 * d / 1e9,
        )
    )

    def make_attn_prefill(key):
        k1, k2 = jax.random.split(key)
        q, kv_w, i_w = make_prefill(k1, "window")
        _, kv_c, i_c = make_prefill(k2, "CSA")
        return q, kv_w, i_w, kv_c, i_c, _normal(k2, (h,), jnp.float32)

    out.append(
        Case(
            "attention",
            f"prefill window + CSA + sink T={t}",
            make_attn_prefill,
            attention(mla, merge_kernel.merge_states),
            attention(mla_r, merge_ref.merge_states),
            ((t + n_cmp) * d * 2 + 6 * t * h * d * 2 + t * (k_win + k_csa) * 4) / 1e6,
            2 * t * h * (valid["window"] + valid["CSA"]) * 2 * d / 1e9,
        )
    )
    return out


def cases(w: Widths, kernels: tuple[str, ...] = ()) -> list[Case]:
    """Every case, or those ``kernels`` names: ``kernel`` (as in the ``kernel`` column) or
    ``kernel:shape prefix``."""

    def wanted(c: Case) -> bool:
        for k in kernels:
            name, _, prefix = k.partition(":")
            if c.kernel == name and c.shape.startswith(prefix):
                return True
        return not kernels

    every = _mhc_cases(w) + _pool_cases(w) + _indexer_cases(w) + _mla_cases(w)
    return [c for c in every if wanted(c)]


# ---- measuring ---------------------------------------------------------------------------------------


def _f32(tree):
    return jax.tree.map(lambda a: a.astype(jnp.float32) if jnp.issubdtype(a.dtype, jnp.floating) else a, tree)


def _rel_err(got, want) -> float:
    return max(harness.rel_l2(g, r) for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(want)))


def _num_sets(case: Case, w: Widths) -> int:
    if w.interpret:
        return 1
    cap = int(os.environ.get("V4_MAX_SETS", MAX_SETS))
    return max(1, min(cap, math.ceil(2.5 * L2_BYTES / max(case.mbytes * 1e6, 1))))


def measure(case: Case, w: Widths, ceilings: dict, budget_left: Callable[[], bool]) -> list[dict]:
    """Check the kernel against the float32 reference, then time it and the reference."""
    base = {"kernel": case.kernel, "shape": case.shape, "MB": case.mbytes, "GFLOP": case.gflop}
    if not budget_left():
        return [base | {"impl": "pallas", "note": harness.SKIPPED}]
    try:
        keys = jax.random.split(
            jax.random.key(zlib.crc32(f"{case.kernel} {case.shape}".encode())), _num_sets(case, w)
        )
        sets = [case.make(k) for k in keys]
        want = jax.jit(case.reference)(*_f32(sets[0]))
    except Exception as exc:  # noqa: BLE001 - one failure must not end the run
        traceback.print_exc()
        return [base | {"impl": "pallas", "note": f"inputs/reference: {type(exc).__name__}: {exc}"[:160]}]
    rows = []
    timed_ref = case.time_reference and os.environ.get("V4_REFERENCE", "1") != "0"
    impls = [("pallas", case.pallas)] + ([("reference", case.reference)] if timed_ref else [])
    for impl, fn in impls:
        row = base | {"impl": impl}
        try:
            run_all = jax.jit(lambda sets, fn=fn: [fn(*s) for s in sets])
            got = jax.block_until_ready(run_all(sets))[0]
            err = case.check(got, want, sets[0]) if case.check else _rel_err(got, want)
            row["rel_err"] = err
            if impl == "pallas" and not err <= TOLERANCE:
                log(f"v4 {case.kernel} {case.shape} {impl}: FAILED check ({err:.2e})")
                rows.append(row | {"note": f"FAILED check ({err:.2e})"})
                continue
            jax.block_until_ready(run_all(sets))
            sec = harness.median_seconds(lambda run_all=run_all: run_all(sets), len(sets), w.replays)
        except Exception as exc:  # noqa: BLE001
            traceback.print_exc()
            rows.append(row | {"note": f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"})
            continue
        gbs = case.mbytes * 1e3 / (sec * 1e6)
        row |= {
            "us": sec * 1e6,
            "GB/s": gbs,
            "% ceiling": 100 * gbs / ceilings["bw"],
            "TFLOP/s": case.gflop / sec / 1e3 if case.gflop else "",
            "% mm": 100 * case.gflop / sec / 1e3 / ceilings["mm"] if case.gflop else "",
            "sets": len(sets),
        }
        log(f"v4 {case.kernel} {case.shape} {impl}: {sec * 1e6:.1f} us, err {err:.2e}")
        rows.append(row)
    return rows


_START = [time.perf_counter()]


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - _START[0]:6.1f}s] {msg}", flush=True)


def run(
    w: Widths = FLASH, *, budget_s: float = float("inf"), kernels: tuple[str, ...] = ()
) -> tuple[list[dict], dict]:
    start = _START[0] = time.perf_counter()
    copy_gbs = harness.copy_ceiling_gbs(w.ceiling_bytes)
    read_gbs = quant.read_ceiling_gbs(w.ceiling_bytes)
    mm = harness.matmul_ceiling_tflops(8192 if not w.interpret else 256)
    ceilings = {"copy": copy_gbs, "read": read_gbs, "bw": max(copy_gbs, read_gbs), "mm": mm}
    log(f"v4: copy {copy_gbs:.0f} GB/s, read {read_gbs:.0f} GB/s, matmul {mm:.0f} TFLOP/s")
    rows: list[dict] = []
    left = lambda: time.perf_counter() - start < budget_s  # noqa: E731
    for case in cases(w, kernels):
        rows += measure(case, w, ceilings, left)
    ceilings["elapsed_s"] = time.perf_counter() - start
    return rows, ceilings


COLUMNS = (
    "kernel",
    "shape",
    "impl",
    "us",
    "MB",
    "GB/s",
    "% ceiling",
    "GFLOP",
    "TFLOP/s",
    "% mm",
    "rel_err",
    "sets",
    "note",
)
SUMMARY_COLUMNS = (
    "kernel",
    "shape",
    "pallas us",
    "% ceiling",
    "TFLOP/s",
    "reference us",
    "speed-up",
    "rel_err",
)


def summary(rows: list[dict]) -> list[dict]:
    out = []
    for key in dict.fromkeys((r["kernel"], r["shape"]) for r in rows):
        mine = {r["impl"]: r for r in rows if (r["kernel"], r["shape"]) == key}
        p, ref = mine.get("pallas", {}), mine.get("reference", {})
        out.append(
            {
                "kernel": key[0],
                "shape": key[1],
                "pallas us": p.get("us", p.get("note", "")),
                "% ceiling": p.get("% ceiling", ""),
                "TFLOP/s": p.get("TFLOP/s", ""),
                "reference us": ref.get("us", ref.get("note", "")),
                "speed-up": ref["us"] / p["us"] if "us" in p and "us" in ref else "",
                "rel_err": p.get("rel_err", ""),
            }
        )
    return out


def header_rows(ceilings: dict, w: Widths) -> dict[str, str]:
    """Device, versions, date, commit, widths and ceilings of one run."""
    return harness.device_header() | {
        "commit": quant.commit(),
        "widths": (
            f"D={w.hidden} hc={w.hc_mult} H={w.heads} d={w.head_dim} window={w.window} "
            f"indexer {w.index_heads}x{w.index_dim} top-{w.index_topk} CSA m={w.csa} HCA m={w.hca}"
        ),
        "copy ceiling (jax x+1)": f"{ceilings['copy']:.0f} GB/s",
        "read ceiling (jax sum(x))": f"{ceilings['read']:.0f} GB/s",
        "matmul ceiling (jax bf16 8192^3)": f"{ceilings['mm']:.0f} TFLOP/s",
        "benchmark wall time": f"{ceilings['elapsed_s']:.0f} s",
    }


def report(rows: list[dict], headers: list[dict[str, str]]) -> str:
    """The results file; ``headers``: one per run that measured some of ``rows`` (values that differ
    between runs are joined by ' / ', in run order)."""
    return harness.summary_report(
        "DeepSeek-V4 kernels at V4-Flash widths (benchmarks/v4_kernels.py)",
        headers,
        (summary(rows), SUMMARY_COLUMNS),
        (rows, COLUMNS),
        method=(
            "Method: see the docstring of `benchmarks/v4_kernels.py`. `% ceiling` is of the faster of",
            "the copy and read ceilings above, `% mm` of the matmul ceiling; `speed-up` = reference us /",
            "pallas us.",
        ),
    )


def merge(out: pathlib.Path, parts: list[pathlib.Path], w: Widths = FLASH) -> pathlib.Path:
    """One results file from several runs' ``V4_JSON`` dumps: a later run's row replaces an earlier
    one of the same (kernel, shape, impl); rows in :func:`cases` order; skipped rows only where no
    run measured the case."""

    def select(runs: list[list[dict]]) -> list[dict]:
        best: dict[tuple, dict] = {}
        for run_rows in runs:
            for r in run_rows:
                key = (r["kernel"], r["shape"], r["impl"])
                if r.get("note") != harness.SKIPPED or key not in best:
                    best[key] = r
        order = {(c.kernel, c.shape): i for i, c in enumerate(cases(w))}
        rows = sorted(
            best.values(), key=lambda r: (order.get((r["kernel"], r["shape"]), len(order)), r["impl"])
        )
        measured = {(r["kernel"], r["shape"]) for r in rows if r.get("note") != harness.SKIPPED}
        return [
            r for r in rows if r.get("note") != harness.SKIPPED or (r["kernel"], r["shape"]) not in measured
        ]

    return harness.merge_runs(out, parts, report, select)


def main(w: Widths = FLASH, out: pathlib.Path | None = None) -> pathlib.Path:
    kernels = tuple(k for k in os.environ.get("V4_KERNELS", "").split(",") if k)
    rows, ceilings = run(w, budget_s=float(os.environ.get("V4_BUDGET_S", "300")), kernels=kernels)
    return harness.finish_run("v4_kernels", report, rows, header_rows(ceilings, w), "V4_JSON", out)


if __name__ == "__main__":
    harness.main_or_merge(__doc__, main, merge)
