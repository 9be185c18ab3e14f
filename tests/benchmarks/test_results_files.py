"""Results-file writing, ceilings and docs/results.md's table built from results files (CPU, no timing)."""

from __future__ import annotations

import json
import pathlib

import numpy as np
import pytest

from benchmarks import harness, readme_table


def test_write_result_puts_header_and_rows_beside_the_markdown(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXDSA_RESULTS", str(tmp_path))
    monkeypatch.setenv("JAXDSA_COMMIT", "abc123def456")
    rows = [{"impl": "pallas:table", "us": np.float32(1.5)}, {"impl": "torch.topk", "note": "eager"}]
    path = harness.write_result("demo", "# demo\n", rows=rows)
    assert path.parent == tmp_path and path.read_text() == "# demo\n"
    payload = json.loads(path.with_suffix(".json").read_text())
    assert payload["rows"] == [{"impl": "pallas:table", "us": 1.5}, {"impl": "torch.topk", "note": "eager"}]
    header = payload["header"]
    assert header["commit"] == "abc123def456" and {"device", "jax", "date"} <= set(header)


def test_ceiling_is_the_fastest_stream_measured():
    """A read-only stream faster than the copy becomes the base (MoE once read 103-106 % of x + 1)."""
    c = harness.Ceilings(
        {"jax x+1 (copy, 1 GiB)": 2874.0, "torch sum (read, 1 GiB)": 3026.0, "torch copy_ (1 GiB)": 2427.0},
        {"jax bf16 8192^3": 776.0, "torch bf16 8192^3": 730.0},
    )
    assert c.stream_gbs == 3026.0 and c.matmul_tflops == 776.0
    rows = c.rows()
    assert rows["memory ceiling (% base)"].startswith("3026 GB/s")
    assert rows["stream: torch copy_ (1 GiB)"] == "2427 GB/s"


_NEW = """# Sparse MLA

| | |
|---|---|
| device | NVIDIA H100 80GB HBM3 |
| commit | abc123def456 |
| date | 2026-11-23 |

| shape | impl | us | vLLM us (anchor) | % stream | TFLOP/s |
|---|---|---|---|---|---|
| decode H=16 B=1 | pallas:table (best) | 18.8 | 18.2 | 4.2 | 3.8 |
"""

_OLD = """# Serving

| | |
|---|---|
| date | 2026-11-21 |

| concurrency | per-stream decode tok/s | aggregate decode tok/s | % of roofline |
|---|---|---|---|
| 1 | 233 | 233 | 53.9 |
| 32 | 81.3 | 2600 | 129 |
"""


def test_parse_reads_the_header_and_the_rows():
    r = readme_table.parse("x.md", _NEW)
    assert r.date == "2026-11-23" and r.header["commit"] == "abc123def456"
    assert r.one(shape="decode H=16 B=1", impl="pallas:table")["us"] == "18.8"
    with pytest.raises(KeyError):
        r.one(shape="decode H=64 B=1")


def test_table_keeps_this_sessions_figures_apart_from_earlier_runs(tmp_path, monkeypatch):
    (tmp_path / "kernels_mla-h100.md").write_text(_NEW)
    (tmp_path / "serve-h100.md").write_text(_OLD)
    rows = [
        r
        for r in readme_table.ROWS
        if r[0] in ("sparse MLA decode, H = 16, B = 1", "serving, GLM-5 widths (5 layers), 1 / 32 streams")
    ]
    monkeypatch.setattr(readme_table, "ROWS", rows + [("missing row", "moe-h100.md", readme_table._moe_t1)])
    table, missing = readme_table.build(tmp_path)
    assert missing == ["missing row"]
    mla, serve = table.splitlines()[2:]
    assert "this session (2026-11-23)" in table.splitlines()[0]
    assert "| 18.8 µs |" in mla and "anchor, docs/anchors.md" in mla and "abc123def456" in mla
    assert (
        "| not re-measured |" in serve and "233 / 2600 tok/s" in serve and "earlier run, 2026-11-21" in serve
    )


def test_write_table_replaces_only_the_marked_table(tmp_path):
    doc = tmp_path / "results.md"
    doc.write_text(f"intro\n{readme_table.BEGIN}\nold\n{readme_table.END}\noutro\n")
    readme_table.write_table("| new |", doc)
    assert doc.read_text() == f"intro\n{readme_table.BEGIN}\n| new |\n{readme_table.END}\noutro\n"


def test_docs_results_holds_the_table_the_files_build():
    """``--write`` targets docs/results.md; what is there now is what the results files build."""
    assert readme_table.RESULTS_DOC == pathlib.Path(__file__).resolve().parents[2] / "docs" / "results.md"
    text = readme_table.RESULTS_DOC.read_text(encoding="utf-8")
    assert text.count(readme_table.BEGIN) == 1 and text.count(readme_table.END) == 1
    table, missing = readme_table.build()
    assert not missing
    assert f"{readme_table.BEGIN}\n{table}\n{readme_table.END}" in text
    readme = readme_table.RESULTS_DOC.parents[1] / "README.md"
    assert readme_table.BEGIN not in readme.read_text(encoding="utf-8")
