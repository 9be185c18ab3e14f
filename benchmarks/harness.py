"""Timing and reporting shared by the GPU benchmark scripts.

Method (as in docs/anchors.md): one jit runs the op over R distinct input sets back to back
(so the inputs are not L2-resident), wall clock / R, median over replays after warm-up. A replay
enqueues several such calls and waits once, on the last, so the host's dispatch of one call
overlaps the device work of the one before (as in a serving loop); timing single synchronous calls
charged each small kernel the dispatch and sync latency (up to 2x at decode shapes, seen against
Nsight Compute's kernel durations). That loop is :mod:`benchmarks.timing`'s; torch peers
(:mod:`benchmarks.peers`) are timed by it too, their R calls captured in one CUDA graph as XLA's
command buffers hold ours.

Ceilings are measured in the same process, so every percentage is of this run's machine. The
memory ceiling is the fastest of a copy and a read-only reduction, in JAX and (with the peers) in
torch: a copy ceiling alone was beaten by kernels that mostly read (MoE at 103-106 % of JAX's
``x + 1``), and a figure above 100 % means the ceiling, not the kernel, is wrong.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib.metadata
import json
import os
import pathlib
import platform
import subprocess
import time
import urllib.request
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import timing


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


def median_seconds(
    run: Callable[[], Any], per_call: int, replays: int, wait: Callable[[Any], Any] = jax.block_until_ready
) -> float:
    """:func:`benchmarks.timing.median_seconds`, waiting on JAX results unless told otherwise."""
    return timing.median_seconds(run, per_call, replays, wait)


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
    x = jax.random.normal(jax.random.key(2), (nbytes // 4,), jnp.float32)
    sec = time_op(lambda a: a + 1, [(x,)], replays=10)
    return 2 * nbytes / sec / 1e9


def read_ceiling_gbs(nbytes: int = 1 << 30) -> float:
    """HBM read bandwidth of a sum over a 1 GiB float32 array (nothing written but a scalar), GB/s."""
    x = jax.random.normal(jax.random.key(3), (nbytes // 4,), jnp.float32)
    sec = time_op(jnp.sum, [(x,)], replays=10)
    return nbytes / sec / 1e9


def matmul_ceiling_tflops(n: int = 8192) -> float:
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.bfloat16)
    b = jax.random.normal(jax.random.key(1), (n, n), jnp.bfloat16)
    sec = time_op(lambda x, y: x @ y, [(a, b)], replays=10)
    return 2 * n**3 / sec / 1e12


@dataclasses.dataclass(frozen=True)
class Ceilings:
    """This process's ceilings: memory streams (GB/s) and bf16 matmuls (TFLOP/s) by name."""

    streams: dict[str, float]
    matmuls: dict[str, float]

    @property
    def stream_gbs(self) -> float:
        """The percentage base for memory-bound rows: the fastest stream measured."""
        return max(self.streams.values())

    @property
    def matmul_tflops(self) -> float:
        return max(self.matmuls.values())

    def rows(self) -> dict[str, str]:
        """Report-header rows: every measurement, then the two bases."""
        rows = {f"stream: {k}": f"{v:.0f} GB/s" for k, v in self.streams.items()}
        rows |= {f"matmul: {k}": f"{v:.0f} TFLOP/s" for k, v in self.matmuls.items()}
        rows["memory ceiling (% base)"] = f"{self.stream_gbs:.0f} GB/s, the fastest stream above"
        rows["matmul ceiling (% base)"] = f"{self.matmul_tflops:.0f} TFLOP/s, the faster matmul above"
        return rows


def measure_ceilings(torch_peers: bool = False) -> Ceilings:
    """JAX's copy (``x + 1``), read-only sum and bf16 matmul; with ``torch_peers`` also torch's
    ``copy_``, ``sum`` and matmul on the same device (:func:`benchmarks.peers.torch_ceilings`)."""
    streams = {"jax x+1 (copy, 1 GiB)": copy_ceiling_gbs(), "jax sum (read, 1 GiB)": read_ceiling_gbs()}
    matmuls = {"jax bf16 8192^3": matmul_ceiling_tflops()}
    if torch_peers:
        from benchmarks import peers

        more_streams, more_matmuls = peers.torch_ceilings()
        streams |= more_streams
        matmuls |= more_matmuls
    return Ceilings(streams, matmuls)


def device_header() -> dict[str, str]:
    """Device, versions, the commit measured and the date: the first rows of every results file."""
    dev = jax.devices()[0]
    import jaxlib

    header = {
        "device": getattr(dev, "device_kind", str(dev)),
        "compute_capability": str(getattr(dev, "compute_capability", "n/a")),
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
    }
    for package in ("torch", "triton"):
        try:
            header[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            pass
    header |= {
        "python": platform.python_version(),
        "commit": commit(),
        "date": datetime.date.today().isoformat(),
    }
    return header


def commit() -> str:
    """The measured tree's commit: ``JAXDSA_COMMIT`` (a copied tree has no .git), else git's HEAD."""
    if os.environ.get("JAXDSA_COMMIT"):
        return os.environ["JAXDSA_COMMIT"]
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True, cwd=RESULTS.parent
        )
    except OSError:
        return "unknown"
    return out.stdout.strip() or "unknown"


RESULTS = pathlib.Path(__file__).resolve().parent / "results"


def wait_health(url: str, proc: subprocess.Popen, timeout: float, poll: float = 1.0) -> None:
    """Wait until the server ``proc`` answers 200 on ``url``/health, polling every ``poll`` seconds;
    SystemExit if it exits first or ``timeout`` seconds pass."""
    start = time.time()
    while time.time() - start < timeout:
        if proc.poll() is not None:
            raise SystemExit(f"serve exited with {proc.returncode} before becoming healthy")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(poll)
    raise SystemExit(f"serve not healthy after {timeout:.0f}s")


def results_dir() -> pathlib.Path:
    """``JAXDSA_RESULTS`` (a device run writes where its files come back), else benchmarks/results."""
    return pathlib.Path(os.environ.get("JAXDSA_RESULTS") or RESULTS)


def write_result(name: str, text: str, suffix: str = "", rows: list[dict] | None = None) -> pathlib.Path:
    """Write ``<results>/<name>-<gpu><suffix>.md`` and, with ``rows``, a ``.json`` beside it
    (the header and the rows) that :mod:`benchmarks.readme_table` reads; return the .md path."""
    out = results_dir()
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}-{gpu_slug()}{suffix}.md"
    path.write_text(text, encoding="utf-8")
    if rows is not None:
        dump_json(str(path.with_suffix(".json")), {"header": device_header(), "rows": rows})
    return path


def report_header(title: str, rows: dict[str, Any]) -> list[str]:
    """``# title`` and a two-column table: device, versions and date, then ``rows``."""
    return [f"# {title}", "", *header_table({**device_header(), **rows}), ""]


def header_table(rows: dict[str, Any]) -> list[str]:
    """A results file's header: ``rows`` as a two-column markdown table."""
    return ["| | |", "|---|---|", *[f"| {k} | {v} |" for k, v in rows.items()]]


# ---- the tail of a run that can be merged (benchmarks/quant.py, benchmarks/v4_kernels.py) --------------
# One process measures some rows, writes its results file and, where ``$<json_env>`` names a file, dumps
# its header and rows there; ``python -m benchmarks.<name> merge OUT.md A.json B.json ...`` joins
# several processes' dumps into one results file.


def merged_header(headers: Sequence[dict[str, str]]) -> dict[str, str]:
    """One header for rows several processes measured: every key once, in first-seen order; a value
    that differs between them is each process's, joined by ' / ' in process order."""
    keys = list(dict.fromkeys(k for h in headers for k in h))
    return {k: " / ".join(dict.fromkeys(h.get(k, "") for h in headers)) for k in keys}


def summary_report(
    title: str,
    headers: Sequence[dict[str, str]],
    summary: tuple[list[dict], Sequence[str]],
    rows: tuple[list[dict], Sequence[str]],
    method: Sequence[str] = (),
) -> str:
    """A mergeable run's results file: ``# title``, the :func:`merged_header` of ``headers``, the
    ``method`` lines, then ``## Summary`` and ``## Every measurement``, each ``(rows, columns)``."""
    return "\n".join(
        [
            f"# {title}",
            "",
            *header_table(merged_header(headers)),
            "",
            *([*method, ""] if method else []),
            "## Summary",
            "",
            markdown_table(*summary),
            "",
            "## Every measurement",
            "",
            markdown_table(*rows),
            "",
        ]
    )


Report = Callable[[list[dict], list[dict[str, str]]], str]  # (rows, one header per process) -> file text


def finish_run(
    name: str,
    report: Report,
    rows: list[dict],
    header: dict[str, str],
    json_env: str,
    out: pathlib.Path | None,
) -> pathlib.Path:
    """The end of a mergeable run's ``main``: header and rows dumped to ``$<json_env>`` if set, then
    ``report(rows, [header])`` written to ``out``, or by :func:`write_result` as ``<name>-<gpu>.md``."""
    if os.environ.get(json_env):
        dump_json(os.environ[json_env], {"header": header, "rows": rows})
    text = report(rows, [header])
    if out is None:
        return write_result(name, text)
    out.write_text(text, encoding="utf-8")
    return out


def merge_runs(
    out: pathlib.Path,
    parts: Sequence[pathlib.Path],
    report: Report,
    select: Callable[[list[list[dict]]], list[dict]],
) -> pathlib.Path:
    """One results file at ``out`` from the JSON dumps ``parts`` (:func:`finish_run`'s): ``select``
    makes the rows from each dump's, and ``report`` gets them with every dump's header."""
    loaded = [json.loads(p.read_text(encoding="utf-8")) for p in parts]
    rows = select([part["rows"] for part in loaded])
    out.write_text(report(rows, [part["header"] for part in loaded]), encoding="utf-8")
    return out


def main_or_merge(
    doc: str,
    main: Callable[[], pathlib.Path],
    merge: Callable[[pathlib.Path, list[pathlib.Path]], pathlib.Path],
    argv: Sequence[str] | None = None,
) -> None:
    """``python -m benchmarks.<name>``: run ``main()`` (the environment variables of ``doc``, the
    module docstring ``--help`` prints, configure it); ``... merge OUT.md A.json B.json ...``:
    ``merge``. Prints the file written."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command")
    joined = commands.add_parser("merge", help="one results file from several runs' JSON dumps")
    joined.add_argument("out", type=pathlib.Path, help="the results file to write (.md)")
    joined.add_argument("parts", type=pathlib.Path, nargs="+", help="the runs' JSON dumps, in run order")
    args = parser.parse_args(argv)
    print(merge(args.out, args.parts) if args.command == "merge" else main())


def ceiling_rows(ceilings: Ceilings, elapsed: float) -> dict[str, str]:
    return {**ceilings.rows(), "benchmark wall time": f"{elapsed:.0f} s"}


SKIPPED = "skipped: time budget"


def error_note(exc: BaseException) -> str:
    """A row's note for the exception that stopped it: its type and first line."""
    lines = str(exc).splitlines()
    return f"{type(exc).__name__}: {lines[0][:120] if lines else ''}"


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
        json.dump(payload, fh, indent=1, default=_plain)


def _plain(value: Any) -> Any:
    """JSON for what ``json`` does not know: NumPy scalars as numbers, anything else as text."""
    return value.item() if isinstance(value, np.generic) else str(value)
