"""GPU benchmark: weights kept quantized, at GLM-5 shapes. INT4 (compressed-tensors, asymmetric
group 32), FP8 (128x128 float32 scales) and bf16, for the routed experts (E = 256, top-8 + the shared
expert, D = 6144, N = 2048) and the attention / dense linears, T in {1, 8, 32, 128, 512, 4096}.

Run ``python -m benchmarks.quant`` on a GPU. Per format and T it times, in one process:

* ``pallas``: ``moe_experts`` (routed experts; the shared expert is the ``shared`` linears) and
  ``quant_matmul`` (each linear) with the tuning tables, e4m3 decoded the device's default way;
* ``pallas:software``: FP8 with the sm_80 integer e4m3 decode forced (``decode="software"``), the
  path A100s run (on parts where it is the default, ``pallas`` is that path already);
* ``torch``: dequantize to bf16 then ``torch._grouped_mm`` / ``torch.matmul``
  (:mod:`benchmarks.torch_peer`) on the same arrays, shared through DLPack; skipped without torch;
* bf16 rows: the bf16 MoE kernel and XLA's dot, the unquantized baselines.

Every implementation is first checked against a float32 reference on sampled rows (the weights
dequantized by their formats' definitions; rel L2 <= 1e-2). Bytes moved: the weight bytes read
(codes + scales + zero points of the experts the batch touches, mean over the input sets; the
whole matrix for a linear) plus the activations in and out. "% ceiling" is of the faster of the copy
(``x + 1``) and read-only (``sum(x)``) ceilings measured in this run; TFLOP/s counts 2 x M x K x N
per matmul. Weights are random: codes uniform (FP8's NaN codes excluded), scales ~1/sqrt(K).
``QUANT_TOKENS=1,4096`` / ``QUANT_FORMATS=int4,fp8`` restrict the run; no new measurement starts
after ``QUANT_BUDGET_S`` seconds (default 480, so a call fits the 10-minute device limit; a whole run
is about 160 measurements per format, so split it by format). Holds one format's weights at a time
(bf16 experts: 19.3 GB). Writes ``benchmarks/results/quant-<gpu>.md`` (device, versions, commit,
date, ceilings, a summary per T and format, then every measurement; skipped ones are counted).
"""

from __future__ import annotations

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
from pallas_kernels.moe import kernel as moe_kernel
from pallas_kernels.quant_matmul import kernel as qmm_kernel
from pallas_kernels.quant_matmul.decode import fp_decode
from pallas_kernels.quant_matmul.layout import QuantizedWeight, dequantize

FORMATS = ("int4", "fp8", "bf16")
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
    linears={  # GLM-5 at TP = 1 (models.md §4.1), [in, out]
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
    raw = os.environ.get(name)
    return tuple(type(default[0])(v) for v in raw.split(",")) if raw else default


# ---- weights and inputs, made on the device ------------------------------------------------------


@functools.partial(jax.jit, static_argnums=(1, 2, 3, 4))
def random_weight(key, fmt: str, lead: tuple[int, ...], k: int, n: int):
    """A random ``[*lead, K, N]`` weight in the kernels' layout (bf16: a plain array)."""
    kc, ks, kz = jax.random.split(key, 3)
    if fmt == "bf16":
        return jax.random.normal(kc, (*lead, k, n), jnp.bfloat16) * jnp.bfloat16(k**-0.5)  # no f32 copy
    if fmt == "int4":
        codes = jax.random.bits(kc, (*lead, k // 2, n), jnp.uint8)
        scales = (jax.random.uniform(ks, (*lead, k // 32, n), minval=0.5, maxval=1.5) / (8 * k**0.5)).astype(
            jnp.bfloat16
        )
        zeros = jax.random.randint(kz, (*lead, k // 32, n), 0, 16).astype(jnp.uint8)
        return QuantizedWeight(codes, scales, zeros, "int4", (32, 1), 64)
    codes = jax.random.bits(kc, (*lead, k, n), jnp.uint8)
    codes = jnp.where((codes & 0x7F) == 0x7F, jnp.uint8(0x7E), codes)  # no NaN codes
    scales = jax.random.uniform(ks, (*lead, -(-k // 128), -(-n // 128)), minval=0.5, maxval=2) / (64 * k**0.5)
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


def _measure(name: str, fn: Callable, case: Case, ceiling_gbs: float, replays: int) -> dict[str, Any]:
    """Check ``fn`` on input set 0 (sampled rows vs the float32 reference), then time it
    (:func:`benchmarks.harness.time_op`'s method, on the one compiled function)."""
    row = case.common() | {"impl": name}
    run_all = jax.jit(lambda sets: [fn(*s) for s in sets])
    try:
        out = jax.block_until_ready(run_all(case.sets))[0]
        err = harness.rel_l2(out[case.rows], case.want)
        if not err <= TOLERANCE:
            return row | {"rel_err": err, "note": f"FAILED check (rel L2 {err:.2e})"}
        jax.block_until_ready(run_all(case.sets))  # warm-up
        sec = harness.median_seconds(lambda: run_all(case.sets), len(case.sets), replays)
    except Exception as exc:  # noqa: BLE001 - one failure must not end the run
        traceback.print_exc()
        return row | {"note": f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"}
    print(f"quant {case.op} {case.fmt} T={case.t} {name}: {sec * 1e6:.1f} us")
    return row | {"rel_err": err} | _rates(case, sec, ceiling_gbs)


def _measure_torch(fn: Callable, case: Case, ceiling_gbs: float, replays: int) -> dict[str, Any]:
    row = case.common() | {"impl": "torch"}
    try:
        from benchmarks import torch_peer
    except ImportError:
        return row | {"note": "skipped: torch not installed"}
    try:
        sets = [tuple(_to_torch(a) for a in s) for s in case.sets]
        out = fn(*sets[0])
        err = harness.rel_l2(jnp.asarray(out[case.rows].float().cpu().numpy()), case.want)
        if not err <= TOLERANCE:
            return row | {"rel_err": err, "note": f"FAILED check (rel L2 {err:.2e})"}
        sec = torch_peer.median_seconds(fn, sets, replays=replays)
    except Exception as exc:  # noqa: BLE001
        traceback.print_exc()
        return row | {"note": f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"}
    print(f"quant {case.op} {case.fmt} T={case.t} torch: {sec * 1e6:.1f} us")
    return row | {"rel_err": err} | _rates(case, sec, ceiling_gbs)


def _to_torch(a):
    """JAX arrays -> torch tensors through DLPack (fp8 as bytes); QuantizedWeight -> TorchWeight."""
    import torch

    from benchmarks import torch_peer

    if isinstance(a, QuantizedWeight):
        codes = a.codes if a.format != "fp8" else jax.lax.bitcast_convert_type(a.codes, jnp.uint8)
        z = None if a.zeros is None else torch.from_dlpack(a.zeros)
        return torch_peer.TorchWeight(
            torch.from_dlpack(codes), torch.from_dlpack(a.scales), z, a.format, a.group, a.kpack
        )
    if isinstance(a, dict):
        return {k: _to_torch(v) for k, v in a.items()}
    return torch.from_dlpack(a)


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


def _moe_fn(shapes: Shapes, decode: str | None = None) -> Callable:
    return lambda x, ids, w, ex: moe_kernel.moe_experts(
        x, ids, w, ex, interpret=shapes.interpret, decode=decode
    )


def _linear_fn(shapes: Shapes, fmt: str, decode: str | None = None) -> Callable:
    if fmt == "bf16":
        return lambda x, w: jnp.dot(x, w, preferred_element_type=jnp.float32).astype(x.dtype)
    return lambda x, w: qmm_kernel.quant_matmul(x, w, interpret=shapes.interpret, decode=decode)


# ---- the run ------------------------------------------------------------------------------------------


def read_ceiling_gbs(nbytes: int) -> float:
    """HBM read bandwidth of ``sum(x)`` over ``nbytes`` of float32, GB/s."""
    x = jnp.ones((nbytes // 4,), jnp.float32)
    return nbytes / harness.time_op(jnp.sum, [(x,)], replays=10) / 1e9


def _impls(fmt: str, kind: str) -> list[tuple[str, str | None]]:
    """(row name, forced e4m3 decode) of the JAX rows of a format: bf16 runs the bf16 MoE kernel and
    XLA's dot (the unquantized baselines); FP8 also runs the software e4m3 decode where it is not
    already the default (sm_80 / sm_86, the CPU)."""
    if fmt == "bf16":
        return [("pallas bf16" if kind == "moe" else "XLA dot", None)]
    forced = fmt == "fp8" and fp_decode() != "software"
    return [("pallas", None)] + ([("pallas:software", "software")] if forced else [])


def run(shapes: Shapes = GLM5, *, formats=FORMATS, budget_s: float = float("inf")) -> tuple[list[dict], dict]:
    """All rows, and the ceilings measured."""
    start = time.perf_counter()
    copy_gbs = harness.copy_ceiling_gbs(shapes.ceiling_bytes)
    read_gbs = read_ceiling_gbs(shapes.ceiling_bytes)
    ceiling = max(copy_gbs, read_gbs)
    print(f"quant: copy {copy_gbs:.0f} GB/s, read {read_gbs:.0f} GB/s")
    rows: list[dict] = []
    over = lambda: time.perf_counter() - start > budget_s  # noqa: E731
    for f, fmt in enumerate(formats):
        key = jax.random.key(f)
        lead = (shapes.experts,)
        experts = {
            "gate_up": random_weight(
                jax.random.fold_in(key, 0), fmt, lead, shapes.hidden, 2 * shapes.expert_width
            ),
            "down": random_weight(jax.random.fold_in(key, 1), fmt, lead, shapes.expert_width, shapes.hidden),
        }
        linears = {
            name: random_weight(jax.random.fold_in(key, 2 + i), fmt, (), k, n)
            for i, (name, (k, n)) in enumerate(shapes.linears.items())
        }
        jax.block_until_ready((experts, linears))
        for t in shapes.tokens:
            cases = [(moe_case(shapes, fmt, t, experts), "moe")]
            cases += [(linear_case(shapes, name, fmt, t, w), "linear") for name, w in linears.items()]
            for case, kind in cases:
                for name, decode in _impls(fmt, kind):
                    fn = _moe_fn(shapes, decode) if kind == "moe" else _linear_fn(shapes, fmt, decode)
                    skip = case.common() | {"impl": name, "note": harness.SKIPPED}
                    rows.append(skip if over() else _measure(name, fn, case, ceiling, shapes.replays))
                if not over():
                    from_torch = _torch_fn(kind)
                    rows.append(_measure_torch(from_torch, case, ceiling, shapes.replays))
        del experts, linears
        gc.collect()
    ceilings = {"copy_gbs": copy_gbs, "read_gbs": read_gbs, "elapsed_s": time.perf_counter() - start}
    return rows, ceilings


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
    "experts sw-decode us",
    "experts torch us",
    "linears us (sum)",
    "linears sw-decode us",
    "linears torch us",
)


def _total(rows: list[dict], experts: bool, impls: tuple[str, ...]) -> float | str:
    """Summed microseconds of the expert (or linear) rows of ``impls``; blank if one is missing."""
    picked = [r for r in rows if (r["op"] == "routed experts") == experts and r["impl"] in impls]
    return sum(r["us"] for r in picked) if picked and all("us" in r for r in picked) else ""


def summary(rows: list[dict]) -> list[dict]:
    """Per (T, format): the routed experts and the sum over the linears, JAX rows against torch."""
    ours = ("pallas", "pallas bf16", "XLA dot")
    out = []
    for t in sorted({r["T"] for r in rows}):
        for fmt in dict.fromkeys(r["format"] for r in rows):
            mine = [r for r in rows if r["T"] == t and r["format"] == fmt]
            experts = next((r for r in mine if r["op"] == "routed experts" and r["impl"] in ours), {})
            out.append(
                {
                    "T": t,
                    "format": fmt,
                    "experts us": experts.get("us", ""),
                    "experts % ceiling": experts.get("% ceiling", ""),
                    "experts sw-decode us": _total(mine, True, ("pallas:software",)),
                    "experts torch us": _total(mine, True, ("torch",)),
                    "linears us (sum)": _total(mine, False, ours),
                    "linears sw-decode us": _total(mine, False, ("pallas:software",)),
                    "linears torch us": _total(mine, False, ("torch",)),
                }
            )
    return out


def commit() -> str:
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


def report(rows: list[dict], ceilings: dict, shapes: Shapes) -> str:
    try:
        import torch

        torch_version = torch.__version__
    except ImportError:
        torch_version = "not installed"
    header = harness.report_header(
        "Weights kept quantized: MoE experts and linears (benchmarks/quant.py)",
        {
            "commit": commit(),
            "torch": torch_version,
            "shapes": f"E={shapes.experts} top-{shapes.top_k} D={shapes.hidden} N={shapes.expert_width}",
            "copy ceiling (jax x+1)": f"{ceilings['copy_gbs']:.0f} GB/s",
            "read ceiling (jax sum(x))": f"{ceilings['read_gbs']:.0f} GB/s",
            "benchmark wall time": f"{ceilings['elapsed_s']:.0f} s",
        },
    )
    return "\n".join(
        [
            *header,
            "## Summary",
            "",
            harness.markdown_table(summary(rows), SUMMARY_COLUMNS),
            "",
            "## Every measurement",
            "",
            harness.markdown_table(rows, COLUMNS),
            "",
        ]
    )


def main(shapes: Shapes = GLM5, out: pathlib.Path | None = None) -> pathlib.Path:
    shapes = dataclasses.replace(shapes, tokens=_env_list("QUANT_TOKENS", shapes.tokens))
    formats = _env_list("QUANT_FORMATS", FORMATS)
    rows, ceilings = run(shapes, formats=formats, budget_s=float(os.environ.get("QUANT_BUDGET_S", "480")))
    text = report(rows, ceilings, shapes)
    if out is None:
        return harness.write_result("quant", text)
    out.write_text(text, encoding="utf-8")
    return out


if __name__ == "__main__":
    print(main())
