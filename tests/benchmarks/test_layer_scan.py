"""benchmarks/layer_scan.py end to end on the CPU at tiny widths: both settings are timed at every batch
size through the public LLM API and the results file compares them."""

from __future__ import annotations

import json

from benchmarks import layer_scan

# Left out of the default run (tests/conftest.py; pytest -m slow runs them): its one end-to-end run: the
# scanned layers meet the unrolled ones in tests/models.
SLOW_CASES = ("test_tiny_run_times_both_settings",)


def test_tiny_run_times_both_settings(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXDSA_RESULTS", str(tmp_path))
    path = layer_scan.main(["--layers", "2", "--batch", "1", "2", "--steps", "2", "--repeats", "1"])
    rows = json.loads(path.with_suffix(".json").read_text())
    assert [(r["scan_layers"], r["batch"]) for r in rows] == [(False, 1), (False, 2), (True, 1), (True, 2)]
    assert all(r["decode_ms"] > 0 for r in rows)
    assert [r["vs_unrolled"] for r in rows[:2]] == [1.0, 1.0]
    assert "commit" in path.read_text() and "vs_unrolled" in path.read_text()
