"""GPU benchmark: weights kept quantized, at GLM-5 shapes. INT4 (compressed-tensors, asymmetric
group 32, in the loader's int32-word layout; ``int4-bytes``, asked for by name, the byte layout),
FP8 (128x128 float32 scales), bf16, V4's FP4 (e2m1, ue8m0 per 32; routed experts only; ``fp4-words``,
asked for by name, in int32 words) and ModelOpt's
NVFP4 (e2m1, e4m3 per 16, a float32 global scale per matrix; GLM-5.3's release format), for the
routed experts (E = 256, top-8 + the shared expert, D = 6144, N = 2048) and the attention / dense
linears, T in {1, 8, 32, 128, 512, 4096}.

Run ``python -m benchmarks.quant`` on a GPU. Per format and T it times, in one process:

* ``pallas``: ``moe_experts`` (routed experts; the shared expert is the ``shared`` linears) and
  ``quant_matmul`` (each linear) with the tuning tables, e4m3 decoded the device's default way;
* ``pallas:software``: FP8 with the sm_80 integer e4m3 decode forced (``decode="software"``), the
  path A100s run (on parts where it is the default, ``pallas`` is that path already); FP4 is
  always decoded with integer ops, on every part;
* ``pallas:gemv``: each quantized linear at T <= 4 (:data:`GEMV_TOKENS`) on the GEMV kernel with
  the table's GEMV tile (:mod:`pallas_kernels.quant_matmul.tuning`; the table leaves it off, and
  ``pallas`` takes it only where ``JAXDSA_QMM_GEMV_MAX_M`` turns it on), next to ``pallas``;
* variants (``QUANT_VARIANTS=0`` skips them): INT4 with each other INT4 arithmetic
  (``pallas:int4-f32`` / ``-bf16`` / ``-ptx``, :func:`pallas_kernels.quant.decode.int4_decode`),
  FP4 and NVFP4 with the other e2m1 decode (``pallas:fp4-f32`` / ``nvfp4-f32`` on a GPU, where 'ptx'
  is the default;
  ``QUANT_INT4_VARIANTS=0`` skips these), and at
  T <= 32 4-bit MoE tile variants (4 warps; 64-column tiles; or ``QUANT_MOE_TILES``, see
  :func:`_tile_variants`; ``QUANT_VARIANT_TOKENS=1,8`` picks the T) and quantized linears' variants
  at those T (``QUANT_QMM_TILES``, none by default; ``gemv=1`` among a variant's fields starts it
  from the GEMV tile, ``gemv=0`` from the tensor-core one); linears at T >= 128 both ways
  (``pallas:dequantize-first``: the weight dequantized in XLA, then XLA's dot; ``-never``: the
  kernel), whatever the tuning table picks for ``pallas``;
* ``torch``: dequantize to bf16 then ``torch._grouped_mm`` / ``torch.matmul``
  (:mod:`benchmarks.torch_peer`) on the same arrays, shared through DLPack; skipped without torch
  or with ``QUANT_TORCH=0``;
* bf16 rows: the bf16 MoE kernel and XLA's dot, the unquantized baselines.

Every implementation is first checked against a float32 reference on sampled rows (the weights
dequantized by their formats' definitions; rel L2 <= 1e-2). Bytes moved: the weight bytes read
(codes + scales + zero points of the experts the batch touches, mean over the input sets; the
whole matrix for a linear) plus the activations in and out. "% ceiling" is of the faster of the copy
(``x + 1``) and read-only (``sum(x)``) ceilings measured in this run; TFLOP/s counts 2 x M x K x N
per matmul. Weights are random: codes uniform (FP8's NaN codes excluded), scales ~1/sqrt(K).

Rows run most wanted first per format (every MoE row, then the linears, then the linears'
variants) and are compiled ``CHUNK`` at a time on ``QUANT_COMPILE_THREADS`` threads (default 1).
``QUANT_TOKENS=1,4096`` / ``QUANT_FORMATS=int4,fp8`` / ``QUANT_LINEAR_TOKENS=1,4096`` (the linears
only) restrict the run; ``QUANT_TP=4`` measures one GPU's share under 4-way tensor parallelism
(:func:`tp_shapes`); no new measurement starts after ``QUANT_BUDGET_S`` seconds (default 480, so a
call fits the 10-minute device limit), and ``QUANT_SLICES=int4:150,fp8:120`` gives each format a
slice of it (a format's unused time passes to the next). Holds one format's weights at a time
(bf16 experts: 19.3 GB); run as ``__main__`` it turns JAX's preallocation off, since torch shares
the GPU. Writes ``benchmarks/results/quant-<gpu>.md`` (device, versions, commit
(``$JAXDSA_COMMIT`` where the tree has no .git), date, ceilings, a summary per T and format, then
every measurement; skipped ones are counted); ``QUANT_JSON=path`` also dumps the rows, and
``python -m benchmarks.quant merge OUT.md A.json B.json ...`` writes one results file from several
processes' dumps.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import gc
import os
import pathlib
import subprocess
import time
import traceback
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import harness
from pallas_kernels._triton import compute_capability
from pallas_kernels.moe import kernel as moe_kernel
from pallas_kernels.moe import tuning as moe_tuning
from pallas_kernels.quant import decode
from pallas_kernels.quant.decode import fp_decode
from pallas_kernels.quant.layout import (
    WORD_KPACK,
    QuantizedWeight,
    codes_dtype,
    codes_per_element,
    default_kpack,
    dequantize,
)
from pallas_kernels.quant_matmul import kernel as qmm_kernel

FORMATS = ("int4", "fp8", "bf16", "fp4", "nvfp4")
# INT4 in the byte layout (layout.default_kpack's choice for K not a multiple of 256), to compare
# with the word layout on the same random codes' distribution: QUANT_FORMATS=int4,int4-bytes
INT4_BYTES = "int4-bytes"
# FP4 experts in int32 words (layout.WORD_KPACK), against the loader's bytes: QUANT_FORMATS=fp4,fp4-words
FP4_WORDS = "fp4-words"
MOE_ONLY = ("fp4", FP4_WORDS)  # V4's FP4 is for routed experts only: no linears
TOLERANCE = 1e-2


@dataclasses.dataclass(frozen=True)
class Shapes:
    experts: int
    top_k: int
    hidden: int  # D
    expert_width: int  # N
    linears: dict[str, tuple[int, int]]  # name -> (K, N) of y = x @ W
    tokens: tuple[int, ...]
    interpret: bool = False  # CPU smoke runs
    ceiling_bytes: int = 1 << 30
    replays: int = 20
    max_sets: int = 4  # distinct input sets per timing (fewer at large T)


GLM5 = Shapes(
    experts=256,
    top_k=8,
    hidden=6144,
    expert_width=2048,
    linears={  # GLM-5 at TP = 1 (docs/models.md §4.1), [in, out]
        "q_a": (6144, 2048),
        "kv_a (576 rows)": (6144, 576),
        "q_b": (2048, 16384),
        "kv_b": (512, 28672),
        "o_proj": (16384, 6144),
        "indexer wq_b": (2048, 4096),
        "dense gate|up": (6144, 24576),
        "dense down": (12288, 6144),
        "shared gate|up": (6144, 4096),
        "shared down": (2048, 6144),
    },
    tokens=(1, 8, 32, 128, 512, 4096),
)
# How tensor parallelism splits each of GLM-5's linears (jaxdsa.sharding's rules): "N" its output
# columns (heads, MLP columns), "K" its input rows (o_proj, the down projections), None replicated.
TP_SPLIT = {
    "q_a": None,
    "kv_a (576 rows)": None,
    "q_b": "N",
    "kv_b": "N",
    "o_proj": "K",
    "indexer wq_b": "N",
    "dense gate|up": "N",
    "dense down": "K",
    "shared gate|up": "N",
    "shared down": "K",
}


def tp_shapes(shapes: Shapes, tp: int) -> Shapes:
    """One GPU's share of ``shapes`` under ``tp``-way tensor parallelism without expert
    parallelism: every routed expert with 1/tp of its intermediate width, the linears split as
    :data:`TP_SPLIT` says (the shapes the kernels run at in ``-tp`` serving)."""

    def split(name: str, k: int, n: int) -> tuple[int, int]:
        where = TP_SPLIT.get(name)
        return (k // tp, n) if where == "K" else (k, n // tp) if where == "N" else (k, n)

    return dataclasses.replace(
        shapes,
        expert_width=shapes.expert_width // tp,
        linears={name: split(name, k, n) for name, (k, n) in shapes.linears.items()},
    )


# What tests/benchmarks/test_quant.py runs on the CPU (interpret mode).
SMALL = Shapes(
    8,
    2,
    128,
    64,
    {"kv_a (576 rows)": (128, 576)},
    (4,),
    interpret=True,
    ceiling_bytes=1 << 20,
    replays=2,
    max_sets=1,
)


def _env_list(name: str, default: tuple) -> tuple:
    """Comma-separated values of ``$name`` ('none': no values), else ``default``."""
    raw = os.environ.get(name)
    if raw == "none":
        return ()
    cast = type(default[0]) if default else int
    return tuple(cast(v) for v in raw.split(",")) if raw else default


# ---- weights and inputs, made on the device ------------------------------------------------------


@functools.partial(jax.jit, static_argnums=(1, 2, 3, 4))
def random_weight(key, fmt: str, lead: tuple[int, ...], k: int, n: int):
    """A random ``[*lead, K, N]`` weight in the kernels' layout (bf16: a plain array). Stacks are drawn
    one matrix at a time (``lax.map``), so the random bits' temporaries stay one matrix large (the
    bf16 experts' bits at once would be 26 GB next to their 13 GB)."""
    if lead:
        keys = jax.random.split(key, int(np.prod(lead)))
        stack = jax.lax.map(lambda kk: _random_matrix(kk, fmt, k, n, stacked=True), keys)
        return jax.tree.map(lambda a: a.reshape(*lead, *a.shape[1:]), stack)
    return _random_matrix(key, fmt, k, n, stacked=False)


def _random_matrix(key, fmt: str, k: int, n: int, *, stacked: bool):
    """One matrix of :func:`random_weight`; ``stacked``: it belongs to an expert stack (INT4 in words)."""
    kc, ks, kz = jax.random.split(key, 3)
    if fmt == "bf16":
        return jax.random.normal(kc, (k, n), jnp.bfloat16) * jnp.bfloat16(k**-0.5)  # no f32 copy
    if fmt in ("int4", INT4_BYTES):  # int4: the loader's layout (int32 words for expert stacks)
        kpack = 64 if fmt == INT4_BYTES else default_kpack(k, "int4", words=stacked)
        per = codes_per_element(kpack)
        codes = jax.random.bits(kc, (k // per, n), jnp.uint32 if per == 8 else jnp.uint8)
        codes = jax.lax.bitcast_convert_type(codes, codes_dtype(kpack))
        scales = (jax.random.uniform(ks, (k // 32, n), minval=0.5, maxval=1.5) / (8 * k**0.5)).astype(
            jnp.bfloat16
        )
        zeros = jax.random.randint(kz, (k // 32, n), 0, 16).astype(jnp.uint8)
        return QuantizedWeight(codes, scales, zeros, "int4", (32, 1), kpack)
    if fmt in ("fp4", FP4_WORDS):  # V4's routed experts: e2m1 codes, ue8m0 scales per 32 (2^-10 .. 2^-4)
        kpack = WORD_KPACK if fmt == FP4_WORDS else 64
        per = codes_per_element(kpack)
        codes = jax.random.bits(kc, (k // per, n), jnp.uint32 if per == 8 else jnp.uint8)
        codes = jax.lax.bitcast_convert_type(codes, codes_dtype(kpack))
        exps = jax.random.randint(ks, (k // 32, n), 117, 124).astype(jnp.uint8)
        scales = jax.lax.bitcast_convert_type(exps, jnp.float8_e8m0fnu)
        return QuantizedWeight(codes, scales, None, "fp4", (32, 1), kpack)
    if fmt == "nvfp4":  # e2m1 codes, e4m3 scales per 16 (4 .. 16), one global scale per matrix
        codes = jax.random.bits(kc, (k // 2, n), jnp.uint8)
        scales = jax.random.uniform(ks, (k // 16, n), minval=4.0, maxval=16.0).astype(jnp.float8_e4m3fn)
        gk, gn = k & -k, n & -n
        global_scales = jnp.full((k // gk, n // gn), 1 / (64 * k**0.5), jnp.float32)
        return QuantizedWeight(codes, scales, None, "nvfp4", (16, 1), 64, global_scales, (gk, gn))
    codes = jax.random.bits(kc, (k, n), jnp.uint8)
    codes = jnp.where((codes & 0x7F) == 0x7F, jnp.uint8(0x7E), codes)  # no NaN codes
    scales = jax.random.uniform(ks, (-(-k // 128), -(-n // 128)), minval=0.5, maxval=2) / (64 * k**0.5)
    return QuantizedWeight(
        jax.lax.bitcast_convert_type(codes, jnp.float8_e4m3fn), scales, None, "fp8", (128, 128), 0
    )


def weight_bytes(w) -> int:
    return w.nbytes if isinstance(w, QuantizedWeight) else w.size * w.dtype.itemsize


def _dense(w, dtype=jnp.float32):
    return dequantize(w, dtype) if isinstance(w, QuantizedWeight) else w.astype(dtype)


def _take(w, index):
    return jax.tree.map(lambda a: a[index], w)


# ---- timing -----------------------------------------------------------------------------------------


@dataclasses.dataclass
class Case:
    """One (op, format, T): its input sets, the rows checked and their float32 reference, bytes, flops."""

    op: str
    fmt: str
    t: int
    sets: list
    rows: np.ndarray
    want: jax.Array
    mbytes: float
    gflop: float

    def common(self) -> dict[str, Any]:
        return {"op": self.op, "format": self.fmt, "T": self.t, "MB": self.mbytes}


def _rates(case: Case, sec: float, ceiling_gbs: float) -> dict[str, float]:
    gbs = case.mbytes * 1e6 / sec / 1e9
    return {
        "us": sec * 1e6,
        "GB/s": gbs,
        "% ceiling": 100 * gbs / ceiling_gbs,
        "TFLOP/s": case.gflop / sec / 1e3,
    }


def compile_all(items: list[tuple[Callable, list]], threads: int) -> list:
    """Each ``(fn, sets)`` as one compiled function of all its input sets (``[fn(*s) for s in sets]``),
    or the exception that stopped it. Tracing runs here in turn; XLA's compilations (the Triton ones
    included) run on ``threads`` threads: most of a row's wall time is its compile."""
    lowered = []
    for fn, sets in items:
        try:
            lowered.append(jax.jit(lambda s, fn=fn: [fn(*x) for x in s]).lower(sets))
        except Exception as exc:  # noqa: BLE001 - reported in the item's row
            traceback.print_exc()
            lowered.append(exc)

    def build(low):
        if isinstance(low, Exception):
            return low
        try:
            return low.compile()
        except Exception as exc:  # noqa: BLE001
            traceback.print_exc()
            return exc

    if threads <= 1 or len(lowered) <= 1:
        return [build(low) for low in lowered]
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        return list(pool.map(build, lowered))


def _measure(name: str, run_all, case: Case, ceiling_gbs: float, replays: int) -> dict[str, Any]:
    """Check the compiled ``run_all`` (:func:`compile_all`, or the exception that stopped it) on input
    set 0 (sampled rows vs the float32 reference), then time it (:func:`benchmarks.harness.time_op`'s
    method)."""
    row = case.common() | {"impl": name}
    if isinstance(run_all, Exception):
        return row | {"note": harness.error_note(run_all)}
    try:
        out = jax.block_until_ready(run_all(case.sets))[0]
        err = harness.rel_l2(out[case.rows], case.want)
        if not err <= TOLERANCE:
            log(f"quant {case.op} {case.fmt} T={case.t} {row['impl']}: FAILED check (rel L2 {err:.2e})")
            return row | {"rel_err": err, "note": f"FAILED check (rel L2 {err:.2e})"}
        jax.block_until_ready(run_all(case.sets))  # warm-up
        sec = harness.median_seconds(lambda: run_all(case.sets), len(case.sets), replays)
    except Exception as exc:  # noqa: BLE001 - one failure must not end the run
        traceback.print_exc()
        return row | {"note": harness.error_note(exc)}
    log(f"quant {case.op} {case.fmt} T={case.t} {name}: {sec * 1e6:.1f} us, err {err:.1e}")
    return row | {"rel_err": err} | _rates(case, sec, ceiling_gbs)


def _measure_torch(fn: Callable, case: Case, ceiling_gbs: float, replays: int, cache: dict) -> dict[str, Any]:
    row = case.common() | {"impl": "torch"}
    try:
        from benchmarks import torch_peer
    except ImportError:
        return row | {"note": "skipped: torch not installed"}
    try:
        sets = [tuple(_to_torch(a, cache) for a in s) for s in case.sets]
        out = fn(*sets[0])
        err = harness.rel_l2(jnp.asarray(out[case.rows].float().cpu().numpy()), case.want)
        if not err <= TOLERANCE:
            log(f"quant {case.op} {case.fmt} T={case.t} {row['impl']}: FAILED check (rel L2 {err:.2e})")
            return row | {"rel_err": err, "note": f"FAILED check (rel L2 {err:.2e})"}
        sec = torch_peer.median_seconds(fn, sets, replays=replays)
    except Exception as exc:  # noqa: BLE001
        traceback.print_exc()
        return row | {"note": harness.error_note(exc)}
    log(f"quant {case.op} {case.fmt} T={case.t} torch: {sec * 1e6:.1f} us, err {err:.1e}")
    return row | {"rel_err": err} | _rates(case, sec, ceiling_gbs)


def _to_torch(a, cache: dict):
    """JAX arrays -> torch tensors through DLPack (no copy); QuantizedWeight -> TorchWeight, made once
    per weight (``cache``, by identity): fp8 codes travel as bytes (a bitcast copy, 9.7 GB for the
    experts) and ue8m0 scales as float32 (exact), since DLPack has no float8."""
    import torch

    from benchmarks import torch_peer

    if isinstance(a, QuantizedWeight):
        if id(a) not in cache:
            codes = a.codes if a.format != "fp8" else jax.lax.bitcast_convert_type(a.codes, jnp.uint8)
            scales = a.scales if a.scales.dtype != jnp.float8_e8m0fnu else fp_decode_e8m0(a.scales)
            z = None if a.zeros is None else torch.from_dlpack(a.zeros)
            tw = torch_peer.TorchWeight(
                torch.from_dlpack(codes), torch.from_dlpack(scales), z, a.format, a.group, a.kpack
            )
            cache[id(a)] = (a, tw)  # holds a, so its id is not reused while cached
        return cache[id(a)][1]
    if isinstance(a, dict):
        return {k: _to_torch(v, cache) for k, v in a.items()}
    return torch.from_dlpack(a)


@jax.jit
def fp_decode_e8m0(scales):
    return decode.e8m0_to_f32(jax.lax.bitcast_convert_type(scales, jnp.uint8))


# ---- the two ops ------------------------------------------------------------------------------------


def _rows(t: int) -> np.ndarray:
    return np.arange(t) if t <= 32 else np.sort(np.random.default_rng(t).choice(t, 32, replace=False))


def _sets(shapes: Shapes, t: int) -> int:
    return min(shapes.max_sets, 4 if t <= 128 else (2 if t <= 512 else 1))


def linear_case(shapes: Shapes, name: str, fmt: str, t: int, w) -> Case:
    k, n = w.shape[-2:]
    keys = jax.random.split(jax.random.key(t), _sets(shapes, t))
    sets = [(jax.random.normal(key, (t, k), jnp.bfloat16), w) for key in keys]
    rows = _rows(t)
    want = jnp.dot(sets[0][0][rows].astype(jnp.float32), _dense(w), precision=jax.lax.Precision.HIGHEST)
    mbytes = (weight_bytes(w) + 2 * t * (k + n)) / 1e6
    return Case(name, fmt, t, sets, rows, want, mbytes, 2 * t * k * n / 1e9)


@jax.jit
def _moe_rows(x, ids, w, experts):
    """Float32 reference per row: only the row's experts dequantized."""

    def one(args):
        xr, idr, wr = args
        gu, dn = _dense(_take(experts["gate_up"], idr)), _dense(_take(experts["down"], idr))
        h = jnp.einsum("d,jdn->jn", xr.astype(jnp.float32), gu, precision=jax.lax.Precision.HIGHEST)
        n = h.shape[-1] // 2
        y = jnp.einsum(
            "jn,jnd->jd", jax.nn.silu(h[:, :n]) * h[:, n:], dn, precision=jax.lax.Precision.HIGHEST
        )
        return (wr[:, None] * y).sum(0)

    return jax.lax.map(one, (x, ids, w))


def moe_case(shapes: Shapes, fmt: str, t: int, experts: dict) -> Case:
    sets = []
    for key in jax.random.split(jax.random.key(1000 + t), _sets(shapes, t)):
        kx, ki, kw = jax.random.split(key, 3)
        x = jax.random.normal(kx, (t, shapes.hidden), jnp.bfloat16)
        ids = jax.lax.top_k(jax.random.uniform(ki, (t, shapes.experts)), shapes.top_k)[1].astype(jnp.int32)
        sets.append((x, ids, jax.nn.softmax(jax.random.normal(kw, (t, shapes.top_k)), axis=-1), experts))
    distinct = float(np.mean([np.unique(np.asarray(s[1])).size for s in sets]))
    per_expert = (weight_bytes(experts["gate_up"]) + weight_bytes(experts["down"])) / shapes.experts
    rows = _rows(t)
    x0, ids0, w0, _ = sets[0]
    want = _moe_rows(x0[rows], ids0[rows], w0[rows], experts)
    mbytes = (distinct * per_expert + 4 * t * shapes.hidden) / 1e6
    gflop = t * shapes.top_k * 2 * shapes.hidden * shapes.expert_width * 3 / 1e9
    return Case("routed experts", fmt, t, sets, rows, want, mbytes, gflop)


@dataclasses.dataclass(frozen=True)
class Impl:
    """One JAX row of a case: the implementation and what it forces."""

    name: str
    decode: str | None = None  # e4m3 path (None: the device's default)
    int4: str | None = None  # INT4 arithmetic (None: decode.int4_decode's default)
    tiles: Callable | None = None  # MoeConfig -> MoeConfig (QmmConfig -> QmmConfig for linears): a variant
    variant: bool = False  # a tuning variant (QUANT_VARIANTS=0 skips them)
    dequantize_first: bool | None = None  # linears: dequantize in XLA, then XLA's dot (None: the table)
    gemv: bool | None = None  # linears: the GEMV config (True), a tensor-core one (False), the table's


def _moe_fn(shapes: Shapes, impl: Impl) -> Callable:
    def fn(x, ids, w, ex):
        config = None if impl.tiles is None else impl.tiles(moe_kernel.default_config(x, ids, ex))
        return moe_kernel.moe_experts(
            x,
            ids,
            w,
            ex,
            interpret=shapes.interpret,
            decode=impl.decode,
            int4_decode=impl.int4,
            config=config,
        )

    return fn


def _linear_fn(shapes: Shapes, fmt: str, impl: Impl) -> Callable:
    if fmt == "bf16":
        return lambda x, w: jnp.dot(x, w, preferred_element_type=jnp.float32).astype(x.dtype)

    def fn(x, w):
        config = None
        if impl.tiles is not None or impl.gemv is not None:
            config = qmm_kernel.default_config(x.shape[0], w, x.dtype, gemv=impl.gemv)
            config = config if impl.tiles is None else impl.tiles(config)
        return qmm_kernel.quant_matmul(
            x,
            w,
            interpret=shapes.interpret,
            decode=impl.decode,
            int4_decode=impl.int4,
            dequantize_first=impl.dequantize_first,
            config=config,
        )

    return fn


# ---- the run ------------------------------------------------------------------------------------------


def read_ceiling_gbs(nbytes: int) -> float:
    """HBM read bandwidth of ``sum(x)`` over ``nbytes`` of float32, GB/s."""
    x = jnp.ones((nbytes // 4,), jnp.float32)
    return nbytes / harness.time_op(jnp.sum, [(x,)], replays=10) / 1e9


def moe_variant(**changes) -> Callable:
    """A config variant: fields of :class:`~pallas_kernels.moe.tuning.MoeConfig` (``absorb_m``,
    ``block_m`` ...) set on the config, fields of its ``Tile`` on both kernels' tiles, or on one
    kernel's with a ``gu_`` (gate|up) or ``dn_`` (down) prefix."""
    own = {f.name for f in dataclasses.fields(moe_tuning.MoeConfig)}
    config = {k: v for k, v in changes.items() if k in own}
    tile = {k: v for k, v in changes.items() if k not in own and not k.startswith(("gu_", "dn_"))}
    only = lambda prefix: {k[3:]: v for k, v in changes.items() if k.startswith(prefix)}  # noqa: E731
    return lambda cfg: dataclasses.replace(
        cfg,
        gate_up=dataclasses.replace(cfg.gate_up, **tile, **only("gu_")),
        down=dataclasses.replace(cfg.down, **tile, **only("dn_")),
        **config,
    )


VARIANT_TOKENS = (1, 8, 32)  # 4-bit MoE tile variants are tried at these T (default)
DEQUANTIZE_VARIANT_TOKENS = 128  # linears from this T on: also dequantize-then-dot, and the kernel forced
GEMV_TOKENS = 4  # quantized linears up to this T: also the GEMV kernel (pallas:gemv)


def _impls(fmt: str, kind: str, t: int) -> list[Impl]:
    """The JAX rows of a case. bf16: the bf16 MoE kernel and XLA's dot (the unquantized baselines).
    FP8: also the software e4m3 decode where it is not already the default (sm_80 / sm_86, the CPU).
    INT4: also each other INT4 arithmetic (:func:`decode.int4_decode`); 4-bit MoE (INT4, FP4) at small
    T: two tile variants (4 warps, the tiles' own before ``warps_4bit``; 64-column tiles, twice the
    programs). Quantized linears at T <= :data:`GEMV_TOKENS`: also the GEMV kernel, as a main row
    (not a variant: the comparison it makes is the point of the run at decode)."""
    if fmt == "bf16":
        return [Impl("pallas bf16" if kind == "moe" else "XLA dot")]
    impls = [Impl("pallas")]
    if kind == "linear" and t <= GEMV_TOKENS:
        impls.append(Impl("pallas:gemv", gemv=True))
    if fmt in ("fp8", "nvfp4") and fp_decode() != "software":  # NVFP4's e4m3 scales, FP8's codes
        impls.append(Impl("pallas:software", decode="software"))
    if os.environ.get("QUANT_INT4_VARIANTS", "1") != "0":
        default = decode.int4_decode()
        if fmt == "int4":
            runnable = [
                m for m in decode.INT4_MODES if m != "ptx" or compute_capability() >= 80
            ]  # no CPU PTX
            impls += [Impl(f"pallas:int4-{m}", int4=m, variant=True) for m in runnable if m != default]
        if fmt in ("fp4", FP4_WORDS, "nvfp4") and default == "ptx":  # e2m1's other decode: integer ops
            impls.append(Impl(f"pallas:{'nvfp4' if fmt == 'nvfp4' else 'fp4'}-f32", int4="f32", variant=True))
    if kind == "linear" and t >= DEQUANTIZE_VARIANT_TOKENS:
        impls += [
            Impl(f"pallas:dequantize-{'first' if on else 'never'}", dequantize_first=on, variant=True)
            for on in (True, False)
        ]
    if t not in _env_list("QUANT_VARIANT_TOKENS", VARIANT_TOKENS):
        return impls
    if fmt in ("int4", "fp4", FP4_WORDS, "nvfp4") and kind == "moe":
        impls += [
            Impl(f"pallas:{name}", tiles=moe_variant(**changes), variant=True)
            for name, changes in _tile_variants("QUANT_MOE_TILES", "w4:num_warps=4,n64:block_n=64")
        ]
    if fmt != "bf16" and kind == "linear":
        for name, changes in _tile_variants("QUANT_QMM_TILES", ""):
            gemv = bool(changes.pop("gemv")) if "gemv" in changes else None
            tiles = functools.partial(dataclasses.replace, **changes)
            impls.append(Impl(f"pallas:{name}", tiles=tiles, gemv=gemv, variant=True))
    return impls


def _tile_variants(env: str, default: str) -> list[tuple[str, dict[str, int]]]:
    """Tile variants from ``$env`` (else ``default``) as ``name:field=value+field=value,...``: for the
    4-bit MoE (``QUANT_MOE_TILES``) fields of :class:`pallas_kernels.moe.tuning.Tile`, applied to
    both kernels, or of ``MoeConfig`` (see :func:`moe_variant`); for the quantized linears
    (``QUANT_QMM_TILES``, none by default) fields of
    :class:`pallas_kernels.quant_matmul.tuning.QmmConfig`, ``gemv=1`` (``0``) taking the table's GEMV
    (tensor-core) config as the one the other fields change."""
    out = []
    for item in filter(None, os.environ.get(env, default).split(",")):
        name, fields = parse_variant(item)
        out.append((name, {k: int(v) for k, v in fields.items()}))
    return out


def parse_variant(text: str) -> tuple[str, dict[str, str]]:
    """``name:field=value+field=value`` -> ``(name, {field: value})``, the values as written."""
    name, _, fields = text.partition(":")
    return name, dict(item.split("=") for item in filter(None, fields.split("+")))


@dataclasses.dataclass
class _Item:
    key: tuple  # ("moe", T) or ("linear", name, T): the case it measures
    impl: Impl | None  # None: the torch peer

    @property
    def kind(self) -> str:
        return self.key[0]


def _work(shapes: Shapes, fmt: str, linear_tokens: tuple[int, ...], variants: bool) -> list[_Item]:
    """The rows of one format, most wanted first: every MoE row (variants and torch included), then
    the linears' rows, then the linears' variant rows, each phase by T. ``QUANT_TORCH=0`` leaves the
    torch peer's rows out (it dequantizes every touched expert per call: slow to time at large T)."""
    torch = os.environ.get("QUANT_TORCH", "1") != "0"
    items = []
    for t in shapes.tokens:
        impls = [i for i in _impls(fmt, "moe", t) if variants or not i.variant]
        items += [_Item(("moe", t), i) for i in impls] + [_Item(("moe", t), None)] * torch
    names = () if fmt in MOE_ONLY else tuple(shapes.linears)
    keys = [("linear", name, t) for t in linear_tokens for name in names]
    for key in keys:
        items += [_Item(key, i) for i in _impls(fmt, "linear", key[2]) if not i.variant]
        items += [_Item(key, None)] * torch
    if variants:
        items += [_Item(key, i) for key in keys for i in _impls(fmt, "linear", key[2]) if i.variant]
    return items


CHUNK = 12  # JAX rows compiled together
_START = [time.perf_counter()]


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - _START[0]:6.1f}s] {msg}", flush=True)


def _deadlines(formats, budget_s: float, slices: dict[str, float]) -> dict[str, float]:
    """Seconds from the start by which each format stops starting rows: cumulative ``slices`` (time a
    format leaves unused passes to the next), never past ``budget_s``."""
    out, total = {}, 0.0
    for fmt in formats:
        total += slices.get(fmt, budget_s)
        out[fmt] = min(total, budget_s)
    return out


def run(
    shapes: Shapes = GLM5,
    *,
    formats=FORMATS,
    budget_s: float = float("inf"),
    variants: bool = True,
    threads: int = 1,
    slices: dict[str, float] | None = None,
    linear_tokens: tuple[int, ...] | None = None,
) -> tuple[list[dict], dict]:
    """All rows, and the ceilings measured."""
    start = _START[0] = time.perf_counter()
    copy_gbs = harness.copy_ceiling_gbs(shapes.ceiling_bytes)
    read_gbs = read_ceiling_gbs(shapes.ceiling_bytes)
    ceiling = max(copy_gbs, read_gbs)
    log(f"quant: copy {copy_gbs:.0f} GB/s, read {read_gbs:.0f} GB/s")
    rows: list[dict] = []
    deadline = _deadlines(formats, budget_s, slices or {})
    linear_tokens = shapes.tokens if linear_tokens is None else linear_tokens
    for fmt in formats:
        over = lambda fmt=fmt: time.perf_counter() - start > deadline[fmt]  # noqa: E731
        items = _work(shapes, fmt, linear_tokens, variants)
        if over():
            log(f"quant: {fmt} skipped (budget)")
            rows += [_skipped(shapes, fmt, it) for it in items]
            continue
        key = jax.random.key((*FORMATS, INT4_BYTES, FP4_WORDS).index(fmt))
        lead = (shapes.experts,)
        experts = {
            "gate_up": random_weight(
                jax.random.fold_in(key, 0), fmt, lead, shapes.hidden, 2 * shapes.expert_width
            ),
            "down": random_weight(jax.random.fold_in(key, 1), fmt, lead, shapes.expert_width, shapes.hidden),
        }
        linears = (
            {}
            if fmt in MOE_ONLY
            else {
                name: random_weight(jax.random.fold_in(key, 2 + i), fmt, (), k, n)
                for i, (name, (k, n)) in enumerate(shapes.linears.items())
            }
        )
        jax.block_until_ready((experts, linears))
        log(f"quant: {fmt} weights ready")
        cases: dict[tuple, Case] = {}

        def case_of(key: tuple, fmt=fmt, experts=experts, linears=linears, cases=cases) -> Case:
            if key not in cases:
                if key[0] == "moe":
                    cases[key] = moe_case(shapes, fmt, key[1], experts)
                else:
                    cases[key] = linear_case(shapes, key[1], fmt, key[2], linears[key[1]])
            return cases[key]

        torch_cache: dict = {}
        for i in range(0, len(items), CHUNK):
            chunk = items[i : i + CHUNK]
            if over():
                rows += [_skipped(shapes, fmt, it) for it in chunk]
                continue
            jax_items = [it for it in chunk if it.impl is not None]
            fns = [
                (
                    _moe_fn(shapes, it.impl) if it.kind == "moe" else _linear_fn(shapes, fmt, it.impl),
                    case_of(it.key).sets,
                )
                for it in jax_items
            ]
            compiled = dict(zip(map(id, jax_items), compile_all(fns, threads)))
            log(f"quant: {fmt} compiled {len(fns)} rows")
            for it in chunk:
                case = case_of(it.key)
                if over():
                    rows.append(_skipped(shapes, fmt, it))
                elif it.impl is None:
                    rows.append(
                        _measure_torch(_torch_fn(it.kind), case, ceiling, shapes.replays, torch_cache)
                    )
                else:
                    rows.append(_measure(it.impl.name, compiled[id(it)], case, ceiling, shapes.replays))
            del compiled
        del experts, linears, torch_cache, cases, items
        gc.collect()
        _torch_free()
    ceilings = {"copy_gbs": copy_gbs, "read_gbs": read_gbs, "elapsed_s": time.perf_counter() - start}
    return rows, ceilings


def _skipped(shapes: Shapes, fmt: str, it: _Item) -> dict:
    op = "routed experts" if it.kind == "moe" else it.key[1]
    name = it.impl.name if it.impl is not None else "torch"
    return {"op": op, "format": fmt, "T": it.key[-1], "impl": name, "note": harness.SKIPPED}


def _torch_free() -> None:
    """Give torch's cached blocks back, so the next format's JAX arrays have the memory."""
    try:
        import torch
    except ImportError:
        return
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _torch_fn(kind: str) -> Callable:
    def fn(*args):
        from benchmarks import torch_peer

        return (
            torch_peer.moe(*args[:3], args[3]["gate_up"], args[3]["down"])
            if kind == "moe"
            else torch_peer.linear(*args)
        )

    return fn


COLUMNS = ("op", "format", "T", "impl", "us", "MB", "GB/s", "% ceiling", "TFLOP/s", "rel_err", "note")
SUMMARY_COLUMNS = (
    "T",
    "format",
    "experts us",
    "experts % ceiling",
    "experts best variant",
    "experts sw-decode us",
    "experts torch us",
    "linears us (sum)",
    "linears sw-decode us",
    "linears torch us",
)
OURS = ("pallas", "pallas bf16", "XLA dot")


def _total(rows: list[dict], experts: bool, impls: tuple[str, ...]) -> float | str:
    """Summed microseconds of the expert (or linear) rows of ``impls``; blank if one is missing."""
    picked = [r for r in rows if (r["op"] == "routed experts") == experts and r["impl"] in impls]
    return sum(r["us"] for r in picked) if picked and all("us" in r for r in picked) else ""


def _best_variant(rows: list[dict]) -> str:
    """The fastest timed Pallas variant row of the routed experts, as 'name: us (% ceiling)'."""
    timed = [
        r for r in rows if r["op"] == "routed experts" and r["impl"].startswith("pallas:int4") and "us" in r
    ]
    if not timed:
        return ""
    best = min(timed, key=lambda r: r["us"])
    return f"{best['impl'].removeprefix('pallas:')}: {best['us']:.1f} ({best['% ceiling']:.1f} %)"


def summary(rows: list[dict]) -> list[dict]:
    """Per (T, format): the routed experts and the sum over the linears, JAX rows against torch."""
    out = []
    for t in sorted({r["T"] for r in rows}):
        for fmt in dict.fromkeys(r["format"] for r in rows):
            mine = [r for r in rows if r["T"] == t and r["format"] == fmt]
            if not mine:
                continue
            experts = next(
                (r for r in mine if r["op"] == "routed experts" and r["impl"] in OURS and "us" in r),
                next((r for r in mine if r["op"] == "routed experts" and r["impl"] in OURS), {}),
            )
            out.append(
                {
                    "T": t,
                    "format": fmt,
                    "experts us": experts.get("us", ""),
                    "experts % ceiling": experts.get("% ceiling", ""),
                    "experts best variant": _best_variant(mine),
                    "experts sw-decode us": _total(mine, True, ("pallas:software",)),
                    "experts torch us": _total(mine, True, ("torch",)),
                    "linears us (sum)": _total(mine, False, OURS),
                    "linears sw-decode us": _total(mine, False, ("pallas:software",)),
                    "linears torch us": _total(mine, False, ("torch",)),
                }
            )
    return out


def commit() -> str:
    """``$JAXDSA_COMMIT`` (set where the tree was copied without .git), else git's HEAD."""
    if os.environ.get("JAXDSA_COMMIT"):
        return os.environ["JAXDSA_COMMIT"]
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        )
        dirty = subprocess.run(
            ["git", "status", "--porcelain"], capture_output=True, text=True
        ).stdout.strip()
        return out.stdout.strip() + (" (uncommitted changes)" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "n/a"


def _torch_version() -> str:
    try:
        import torch

        return torch.__version__
    except ImportError:
        return "not installed"


def header_rows(ceilings: dict, shapes: Shapes) -> dict[str, str]:
    """Device, versions, date, commit and ceilings of one process (:func:`report`'s table)."""
    return harness.device_header() | {
        "commit": commit(),
        "torch": _torch_version(),
        "shapes": f"E={shapes.experts} top-{shapes.top_k} D={shapes.hidden} N={shapes.expert_width}",
        "copy ceiling (jax x+1)": f"{ceilings['copy_gbs']:.0f} GB/s",
        "read ceiling (jax sum(x))": f"{ceilings['read_gbs']:.0f} GB/s",
        "benchmark wall time": f"{ceilings['elapsed_s']:.0f} s",
    }


def report(rows: list[dict], headers: list[dict[str, str]]) -> str:
    """The results file. ``headers``: one per process that measured some of ``rows`` (a merged run
    lists each process's values, joined by ' / ', where they differ)."""
    return harness.summary_report(
        "Weights kept quantized: MoE experts and linears (benchmarks/quant.py)",
        headers,
        (summary(rows), SUMMARY_COLUMNS),
        (rows, COLUMNS),
    )


def merge(out: pathlib.Path, parts: list[pathlib.Path]) -> pathlib.Path:
    """One results file from the JSON dumps (``QUANT_JSON``) of several processes (a row one process
    skipped is dropped where another measured it)."""

    def select(runs: list[list[dict]]) -> list[dict]:
        rows = [r for run_rows in runs for r in run_rows]
        key = lambda r: (r["op"], r["format"], r["T"], r["impl"])  # noqa: E731
        measured = {key(r) for r in rows if r.get("note") != harness.SKIPPED}
        rows = [r for r in rows if r.get("note") != harness.SKIPPED or key(r) not in measured]
        order = {f: i for i, f in enumerate(FORMATS)}
        # stable: the op order within a format and T is kept
        return sorted(rows, key=lambda r: (order.get(r["format"], len(order)), r["T"]))

    return harness.merge_runs(out, parts, report, select)


def main(shapes: Shapes = GLM5, out: pathlib.Path | None = None) -> pathlib.Path:
    shapes = dataclasses.replace(shapes, tokens=_env_list("QUANT_TOKENS", shapes.tokens))
    if int(os.environ.get("QUANT_TP", "1")) > 1:
        shapes = tp_shapes(shapes, int(os.environ["QUANT_TP"]))
    formats = _env_list("QUANT_FORMATS", FORMATS)
    rows, ceilings = run(
        shapes,
        formats=formats,
        budget_s=float(os.environ.get("QUANT_BUDGET_S", "480")),
        variants=os.environ.get("QUANT_VARIANTS", "1") != "0",
        threads=int(os.environ.get("QUANT_COMPILE_THREADS", "1")),
        slices={
            f: float(v) for f, v in (p.split(":") for p in os.environ.get("QUANT_SLICES", "").split(",") if p)
        },
        linear_tokens=_env_list("QUANT_LINEAR_TOKENS", shapes.tokens),
    )
    return harness.finish_run("quant", report, rows, header_rows(ceilings, shapes), "QUANT_JSON", out)


if __name__ == "__main__":
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch shares the GPU
    harness.main_or_merge(__doc__, main, merge)
