"""Timing and reporting shared by the GPU benchmark scripts.

Method (as in ../shared/anchors): one jit runs the op over R distinct input sets back to back
(so the inputs are not L2-resident), wall clock / R, median over replays after warm-up. A replay
enqueues several such calls and waits once, on the last, so the host's dispatch of one call
overlaps the device work of the one before (as in a serving loop); timing single synchronous calls
charged each small kernel the dispatch and sync latency (up to 2x at decode shapes, seen against
Nsight Compute's kernel durations). Ceilings are measured in the same process so every
percentage is of this run's machine.
"""

from __future__ import annotations

import datetime
import json
import pathlib
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def time_op(
    fn: Callable[..., Any], input_sets: Sequence[tuple], *, replays: int = 20, warmup: int = 2
) -> float:
    """Median seconds per call of ``fn(*inputs)``, the R input sets run back to back in one jit."""

    @jax.jit
    def run_all(sets):
        return [fn(*s) for s in sets]

    sets = list(input_sets)
    for _ in range(warmup):
        jax.block_until_ready(run_all(sets))
    return median_seconds(lambda: run_all(sets), len(sets), replays)


REPLAY_S = 0.02  # a replay enqueues calls until it lasts about this long
MAX_CALLS = 8  # calls in flight hold their outputs: 8 x 1 GiB at the copy ceiling


def median_seconds(run: Callable[[], Any], per_call: int, replays: int) -> float:
    """Median over ``replays`` of the wall time per op: each replay enqueues ``calls`` runs of
    ``run()`` back to back and blocks on the last (one stream runs them in order), divided by
    ``calls * per_call``. ``calls`` is sized from one synchronous run so a replay lasts about
    ``REPLAY_S``; the one unhidden dispatch then costs at most a few percent."""
    t0 = time.perf_counter()
    jax.block_until_ready(run())
    calls = max(1, min(MAX_CALLS, round(REPLAY_S / (time.perf_counter() - t0))))
    times = []
    for _ in range(replays):
        t0 = time.perf_counter()
        for _ in range(calls - 1):
            run()
        jax.block_until_ready(run())
        times.append((time.perf_counter() - t0) / (calls * per_call))
    return statistics.median(times)


def rel_l2(got, want) -> float:
    got = np.asarray(jnp.asarray(got, jnp.float32), np.float64)
    want = np.asarray(jnp.asarray(want, jnp.float32), np.float64)
    finite = np.isfinite(want)
    if not np.array_equal(finite, np.isfinite(got)):
        return float("inf")
    diff = np.where(finite, got - want, 0.0)
    return float(np.linalg.norm(diff) / max(np.linalg.norm(np.where(finite, want, 0.0)), 1e-30))


def copy_ceiling_gbs(nbytes: int = 1 << 30) -> float:
    """HBM copy bandwidth (read + write) of ``x + 1`` over a 1 GiB float32 array, GB/s."""
    x = jnp.ones((nbytes // 4,), jnp.float32)
    sec = time_op(lambda a: a + 1, [(x,)], replays=10)
    return 2 * nbytes / sec / 1e9


def matmul_ceiling_tflops(n: int = 8192) -> float:
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.bfloat16)
    b = jax.random.normal(jax.random.key(1), (n, n), jnp.bfloat16)
    sec = time_op(lambda x, y: x @ y, [(a, b)], replays=10)
    return 2 * n**3 / sec / 1e12


def device_header() -> dict[str, str]:
    dev = jax.devices()[0]
    import jaxlib

    return {
        "device": getattr(dev, "device_kind", str(dev)),
        "compute_capability": str(getattr(dev, "compute_capability", "n/a")),
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "python": platform.python_version(),
        "date": datetime.date.today().isoformat(),
    }


RESULTS = pathlib.Path(__file__).resolve().parent / "results"


def write_result(name: str, text: str, suffix: str = "") -> pathlib.Path:
    """Write ``benchmarks/results/<name>-<gpu><suffix>.md`` and return its path."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}-{gpu_slug()}{suffix}.md"
    path.write_text(text, encoding="utf-8")
    return path


def report_header(title: str, rows: dict[str, Any]) -> list[str]:
    """``# title`` and a two-column table: device, versions and date, then ``rows``."""
    table = {**device_header(), **rows}
    return [f"# {title}", "", "| | |", "|---|---|", *[f"| {k} | {v} |" for k, v in table.items()], ""]


def ceiling_rows(copy_gbs: float, mm_tflops: float, elapsed: float) -> dict[str, str]:
    return {
        "copy ceiling (jax x+1, 1 GiB)": f"{copy_gbs:.0f} GB/s",
        "matmul ceiling (jax bf16 8192^3)": f"{mm_tflops:.0f} TFLOP/s",
        "benchmark wall time": f"{elapsed:.0f} s",
    }


SKIPPED = "skipped: time budget"


def markdown_table(rows: list[dict[str, Any]], columns: Sequence[str]) -> str:
    """Rows as a markdown table; sweep variants the time budget cut (note ``SKIPPED``) are counted
    in a line below it rather than listed as empty rows."""

    def fmt(v):
        if isinstance(v, float):
            return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"
        return str(v)

    shown = [r for r in rows if r.get("note") != SKIPPED]
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(fmt(r.get(c, "")) for c in columns) + " |" for r in shown]
    if len(shown) < len(rows):
        lines += ["", f"{len(rows) - len(shown)} sweep variants were not run (time budget)."]
    return "\n".join(lines)


def gpu_slug() -> str:
    kind = getattr(jax.devices()[0], "device_kind", "cpu").lower()
    for name in ("h100", "h200", "a100", "b200", "rtx pro 6000", "gb10"):
        if name in kind:
            return name.replace(" ", "")
    return kind.replace(" ", "-")


def dump_json(path: str, payload: Any) -> None:
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(payload, fh, indent=1, default=str)
