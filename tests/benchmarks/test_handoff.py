"""benchmarks/handoff.py at small widths on the CPU: the three engines and the two NIXL connectors
run each length, the handed-over tokens equal the co-located ones, and the results file has its
rows (the timings themselves mean nothing here)."""

from __future__ import annotations

import json

from benchmarks import handoff
from tests.benchmarks.test_spec_decode import SMALL_GLM52


def test_handoff_benchmark_runs_and_checks_tokens(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXDSA_RESULTS", str(tmp_path))
    args = ["--preset", "glm52", "--layers", "3", "--quantization", "int4", "--lengths", "24,40"]
    path = handoff.main(
        [*args, "--overrides", json.dumps(SMALL_GLM52), "--page-size", "16", "--suffix=-small"]
    )
    rows = json.loads(path.with_suffix(".json").read_text())["rows"]
    assert [r["input_len"] for r in rows] == [24, 40]
    assert all(r["tokens_equal"] and r["image_mb"] > 0 for r in rows)
