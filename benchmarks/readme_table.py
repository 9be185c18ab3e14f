"""The GPU table of ``docs/results.md``, built from the results files (``benchmarks/results/*.md``).

    python -m benchmarks.readme_table [--write]

(The module keeps its name from when the table lived in the README.)

Each row reads one results file: its header (device, date, commit) and its tables. Figures from a
file dated ``--session`` (default: the newest date among the files read) fill the "this session"
columns; figures from an older file go to the "earlier run" column with that file's date, never
beside this session's, and anchors (``docs/anchors.md``, not measured by these scripts) are named
as such. ``--write`` replaces the table between the markers in ``docs/results.md``; without it the
table is printed. A row whose file is missing is left out and reported.
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import re
from collections.abc import Callable

from benchmarks.harness import RESULTS

RESULTS_DOC = RESULTS.parent.parent / "docs" / "results.md"
BEGIN, END = "<!-- results table: python -m benchmarks.readme_table --write -->", "<!-- end results table -->"
# docs/anchors.md holds both sets of anchors: the MoE (and attention) ones and the kernel ones.
MOE_ANCHOR = KERNEL_ANCHOR = "anchor, docs/anchors.md, 2026-11-21"


@dataclasses.dataclass
class Result:
    """One results file: its two-column header and every other markdown table as dict rows."""

    name: str
    header: dict[str, str]
    rows: list[dict[str, str]]

    @property
    def date(self) -> str:
        return self.header.get("date", "")

    def find(self, **match: str) -> list[dict[str, str]]:
        """Rows whose fields equal ``match`` (``impl`` may carry a `` (best)`` mark)."""
        return [r for r in self.rows if all(_strip(r.get(k, "")) == v for k, v in match.items())]

    def one(self, **match: str) -> dict[str, str]:
        found = self.find(**match)
        if not found:
            raise KeyError(f"{self.name}: no row {match}")
        return found[0]


def _strip(value: str) -> str:
    return value.removesuffix(" (best)").strip()


def parse(name: str, text: str) -> Result:
    header: dict[str, str] = {}
    rows: list[dict[str, str]] = []
    columns: list[str] | None = None
    for line in text.splitlines():
        if not line.startswith("|"):
            columns = None
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if columns is None:
            columns = cells
        elif set(line) <= set("|-: "):
            continue
        elif columns == ["", ""]:
            header[cells[0]] = cells[1]
        else:
            rows.append(dict(zip(columns, cells)))
    return Result(name, header, rows)


def load(name: str, directory: pathlib.Path = RESULTS) -> Result:
    return parse(name, (directory / name).read_text(encoding="utf-8"))


def num(value: str) -> float:
    return float(value.replace(",", ""))


def _range(values: list[float], fmt: str = "{:.0f}") -> str:
    lo, hi = min(values), max(values)
    return fmt.format(lo) if fmt.format(lo) == fmt.format(hi) else f"{fmt.format(lo)}–{fmt.format(hi)}"


def _us(value: float) -> str:
    return f"{value / 1000:.2f} ms" if value >= 1000 else f"{value:.3g} µs"


# A row: label, file, and a function of the parsed file -> (ours, in-process peers, anchors).
Cells = tuple[str, str, str]


def _moe_t1(r: Result) -> Cells:
    row = r.one(T="1")
    peer = (
        f"torch `_grouped_mm` {_us(num(row['torch _grouped_mm us']))}"
        if row.get("torch _grouped_mm us")
        else ""
    )
    ragged = f"`ragged_dot` {_us(num(row['ragged_dot us']))}" if row.get("ragged_dot us") else ""
    peer = ", ".join(p for p in (peer, ragged) if p)
    anchor = f"torch `_grouped_mm` {_us(num(row['torch _grouped_mm us (anchor)']))} ({MOE_ANCHOR})"
    return f"{_us(num(row['pallas best us']))} (floor {_us(num(row['floor us']))})", peer, anchor


def _moe_stream(r: Result) -> Cells:
    column = "% stream" if "% stream" in r.rows[0] else "% of 3006"
    rows = [r.one(T=str(t)) for t in (8, 32, 128, 512)]
    base = "of the memory ceiling" if column == "% stream" else "of 3006 GB/s (the anchors' torch copy)"
    return f"{_range([num(x[column]) for x in rows])} % {base}", "", ""


def _moe_4096(r: Result) -> Cells:
    row = r.one(T="4096")
    peer = ""
    if row.get("torch _grouped_mm us"):  # same flops: scale our rate by the time ratio
        torch_tflops = num(row["TFLOP/s"]) * num(row["pallas best us"]) / num(row["torch _grouped_mm us"])
        peer = f"torch `_grouped_mm` {torch_tflops:.0f} TFLOP/s"
    anchor = f"torch `_grouped_mm` {_us(num(row['torch _grouped_mm us (anchor)']))} ({MOE_ANCHOR})"
    return f"{num(row['TFLOP/s']):.0f} TFLOP/s ({_us(num(row['pallas best us']))})", peer, anchor


def _sampler(r: Result) -> Cells:
    row = r.one(case="top_p 0.95", R="32")
    return _us(num(row["candidates us"])), "", f"full-row sort {_us(num(row['full sort us']))} (same run)"


def _indexer_prefill(r: Result) -> Cells:
    rows = [x for x in r.find(kind="prefill", impl="pallas:table")]
    anchors = [num(x["GFLOP"]) / num(x["anchor us"]) * 1e3 for x in rows if x.get("anchor us")]
    ours = f"{_range([num(x['TFLOP/s']) for x in rows])} TFLOP/s"
    return ours, "", f"vLLM Triton made bf16 {_range(anchors)} TFLOP/s ({KERNEL_ANCHOR})"


def _indexer_decode(r: Result) -> Cells:
    rows = [r.one(kind="decode", Hi=str(h), S="131072", impl="pallas:table") for h in (32, 64)]
    pct = _range([num(x["% stream"]) for x in rows])
    anchor = " / ".join(_us(num(x["anchor us"])) for x in rows)
    return (
        f"{pct} % of the memory ceiling (Hi = 32 / 64)",
        "",
        f"vLLM Triton made bf16 {anchor} ({KERNEL_ANCHOR})",
    )


def _topk(impl: str) -> Callable[[Result], Cells]:
    def cells(r: Result) -> Cells:
        shapes = [("4096", "32768"), ("4096", "131072")]
        ours = " / ".join(_us(num(r.one(T=t, S=s, impl=impl)["us"])) for t, s in shapes)
        torch = " / ".join(_us(num(r.one(T=t, S=s, impl="torch.topk")["us"])) for t, s in shapes)
        lax = " / ".join(_us(num(r.one(T=t, S=s, impl="jax lax.top_k")["us"])) for t, s in shapes)
        return ours, f"`torch.topk` {torch}, `lax.top_k` {lax}", ""

    return cells


def _mla(shape: str) -> Callable[[Result], Cells]:
    def cells(r: Result) -> Cells:
        row = r.one(shape=shape, impl="pallas:table")
        return (
            _us(num(row["us"])),
            "",
            f"vLLM Triton {_us(num(row['vLLM us (anchor)']))} ({KERNEL_ANCHOR})",
        )

    return cells


def _mla_batched(r: Result) -> Cells:
    parts = []
    for b in (32, 128):
        pct = " / ".join(
            f"{num(r.one(shape=f'decode H={h} B={b}', impl='pallas:table')['% stream']):.0f}"
            for h in (16, 64, 128)
        )
        parts.append(f"B = {b}: {pct} %")
    return "; ".join(parts) + " of the memory ceiling (H = 16 / 64 / 128)", "", ""


def _mla_prefill(r: Result) -> Cells:
    rows = [r.one(shape=f"prefill H={h} T=4096", impl="pallas:table") for h in (64, 128)]
    anchors = [num(x["vLLM us (anchor)"]) for x in rows]
    ours = f"{_range([num(x['TFLOP/s']) for x in rows])} TFLOP/s"
    vllm = " / ".join(_us(a) for a in anchors)
    return (
        ours,
        "",
        f"vLLM Triton {vllm} vs ours {' / '.join(_us(num(x['us'])) for x in rows)} ({KERNEL_ANCHOR})",
    )


def _serving(r: Result) -> Cells:
    one, many = r.one(concurrency="1"), r.one(concurrency="32")
    per, agg = num(one["per-stream decode tok/s"]), num(many["aggregate decode tok/s"])
    return (
        f"{per:.0f} / {agg:.0f} tok/s, {num(one['% of roofline']):.0f} % of the memory roofline at 1",
        "",
        "",
    )


ROWS: list[tuple[str, str, Callable[[Result], Cells]]] = [
    ("MoE experts (GLM-5, bf16), T = 1", "moe-h100.md", _moe_t1),
    ("MoE experts, T = 8 … 512", "moe-h100.md", _moe_stream),
    ("MoE experts, T = 4096", "moe-h100.md", _moe_4096),
    ("sampler, 32 rows of 154,880 logits, top-p", "sampler-h100-subset.md", _sampler),
    ("indexer prefill (4096 × 8k…128k)", "kernels_indexer-h100.md", _indexer_prefill),
    ("indexer decode (32 × 128k)", "kernels_indexer-h100.md", _indexer_decode),
    (  # the exact-count exit won this run and is now the kernel's only path
        "top-k 2048 of [4096, 32768] / [4096, 131072] (exact-exit rows)",
        "kernels_indexer-h100.md",
        _topk("pallas:exact_exit"),
    ),
    ("sparse MLA decode, H = 16, B = 1", "kernels_mla-h100.md", _mla("decode H=16 B=1")),
    ("sparse MLA decode, H = 64, B = 1", "kernels_mla-h100.md", _mla("decode H=64 B=1")),
    ("sparse MLA decode, H = 128, B = 1", "kernels_mla-h100.md", _mla("decode H=128 B=1")),
    ("sparse MLA decode, H = 64, B = 32", "kernels_mla-h100.md", _mla("decode H=64 B=32")),
    ("sparse MLA decode, B = 32 / 128", "kernels_mla-h100.md", _mla_batched),
    ("sparse MLA prefill (T = 4096, H = 64 / 128)", "kernels_mla-h100.md", _mla_prefill),
    ("serving, GLM-5 widths (5 layers), 1 / 32 streams", "serve-h100.md", _serving),
]


def build(directory: pathlib.Path = RESULTS, session: str | None = None) -> tuple[str, list[str]]:
    """The markdown table and the labels of rows left out (file missing)."""
    loaded: dict[str, Result] = {}
    missing = []
    for label, name, _ in ROWS:
        if name not in loaded and (directory / name).exists():
            loaded[name] = load(name, directory)
        if name not in loaded:
            missing.append(label)
    session = session or max((r.date for r in loaded.values()), default="")
    lines = [
        f"| | H100, this session ({session}) | same process, same inputs"
        " | earlier run or anchor (not this session) | file |",
        "|---|---|---|---|---|",
    ]
    for label, name, fn in ROWS:
        if name not in loaded:
            continue
        r = loaded[name]
        ours, peers, anchors = fn(r)
        if r.date != session:  # an older file: nothing of it is this session's
            earlier = f"{ours}; {peers}" if peers else ours
            ours, peers, anchors = (
                "not re-measured",
                "",
                f"{earlier} (earlier run, {r.date})" + (f"; {anchors}" if anchors else ""),
            )
        source = f"`{name}` ({r.date}, {r.header.get('commit', 'no commit')})"
        lines.append(f"| {label} | {ours} | {peers} | {anchors} | {source} |")
    return "\n".join(lines), missing


def write_table(table: str, path: pathlib.Path = RESULTS_DOC) -> None:
    """Replace what lies between the markers in ``path`` (``docs/results.md``) with ``table``."""
    text = path.read_text(encoding="utf-8")
    pattern = re.compile(re.escape(BEGIN) + r".*?" + re.escape(END), re.S)
    if not pattern.search(text):
        raise SystemExit(f"{path}: no {BEGIN} ... {END} markers")
    path.write_text(pattern.sub(lambda _: f"{BEGIN}\n{table}\n{END}", text), encoding="utf-8")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="replace the table in docs/results.md")
    parser.add_argument("--session", help="date of this session's files (default: the newest)")
    args = parser.parse_args()
    table, missing = build(session=args.session)
    for label in missing:
        print(f"left out (no results file): {label}")
    if args.write:
        write_table(table)
    else:
        print(table)


if __name__ == "__main__":
    main()
