"""The shared tail of the mergeable benchmark scripts (benchmarks/quant.py, benchmarks/v4_kernels.py),
the timing loop, and benchmarks/'s import graph (CPU, no timing)."""

from __future__ import annotations

import ast
import json
import pathlib

import pytest

from benchmarks import harness, timing

BENCHMARKS = pathlib.Path(harness.__file__).resolve().parent


def _report(rows, headers):
    return harness.summary_report(
        "Demo", headers, ([{"n": len(rows)}], ("n",)), (rows, ("k", "us")), method=("Method: demo.",)
    )


def test_summary_report_joins_the_headers_that_differ():
    text = _report([{"k": "a", "us": 1.5}], [{"device": "X", "wall": "3 s"}, {"device": "X", "wall": "4 s"}])
    assert text.splitlines()[:7] == [
        "# Demo",
        "",
        "| | |",
        "|---|---|",
        "| device | X |",
        "| wall | 3 s / 4 s |",
        "",
    ]
    assert "Method: demo.\n\n## Summary\n\n| n |" in text
    assert text.endswith("## Every measurement\n\n| k | us |\n|---|---|\n| a | 1.5 |\n")


def test_finish_run_then_merge_runs(tmp_path, monkeypatch):
    """Each run writes its file and (with the JSON variable set) its dump; the dumps merge into one file."""
    for i, rows in enumerate(([{"k": "a", "us": 1.0}], [{"k": "b", "us": 2.0}])):
        monkeypatch.setenv("DEMO_JSON", str(tmp_path / f"{i}.json"))
        out = harness.finish_run("demo", _report, rows, {"run": str(i)}, "DEMO_JSON", tmp_path / f"{i}.md")
        assert out.read_text() == _report(rows, [{"run": str(i)}])
        assert json.loads((tmp_path / f"{i}.json").read_text()) == {"header": {"run": str(i)}, "rows": rows}
    parts = [tmp_path / "1.json", tmp_path / "0.json"]
    merged = harness.merge_runs(
        tmp_path / "m.md", parts, _report, lambda runs: [r for rs in runs for r in rs]
    )
    assert "| run | 1 / 0 |" in merged.read_text() and "| b | 2 |\n| a | 1 |" in merged.read_text()


def test_finish_run_without_out_writes_the_results_file(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXDSA_RESULTS", str(tmp_path))
    monkeypatch.delenv("DEMO_JSON", raising=False)
    path = harness.finish_run("demo", _report, [], {}, "DEMO_JSON", None)
    assert path.parent == tmp_path and path.name.startswith("demo-") and not list(tmp_path.glob("*.json"))


def test_main_or_merge(tmp_path, capsys):
    calls = []
    main = lambda: calls.append("main") or tmp_path / "run.md"
    merge = lambda out, parts: calls.append(("merge", out, parts)) or out
    harness.main_or_merge("Doc.", main, merge, [])
    harness.main_or_merge("Doc.", main, merge, ["merge", "o.md", "a.json", "b.json"])
    assert calls == [
        "main",
        ("merge", pathlib.Path("o.md"), [pathlib.Path("a.json"), pathlib.Path("b.json")]),
    ]
    with pytest.raises(SystemExit) as exit_:
        harness.main_or_merge("Doc.", main, merge, ["--help"])
    assert exit_.value.code == 0 and "Doc." in capsys.readouterr().out and len(calls) == 2


def test_median_seconds_sizes_the_calls_of_a_replay():
    waits = []
    sec = timing.median_seconds(lambda: 0, per_call=2, replays=3, wait=waits.append)
    assert sec >= 0 and len(waits) == 4  # the sizing run, then one wait per replay


def _imports(path: pathlib.Path) -> set[str]:
    """The benchmarks/ modules ``path`` imports, at module level or inside functions."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module == "benchmarks":
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("benchmarks."):
            names.add(node.module.split(".")[1])
        elif isinstance(node, ast.Import):
            names |= {a.name.split(".")[1] for a in node.names if a.name.startswith("benchmarks.")}
    return names


def test_benchmarks_import_no_circle():
    graph = {p.stem: _imports(p) for p in BENCHMARKS.glob("*.py")}
    done: set[str] = set()

    def visit(name: str, path: tuple[str, ...]) -> None:
        assert name not in path, f"import circle: {' -> '.join((*path, name))}"
        if name in done or name not in graph:
            return
        for other in sorted(graph[name]):
            visit(other, (*path, name))
        done.add(name)

    for name in sorted(graph):
        visit(name, ())
