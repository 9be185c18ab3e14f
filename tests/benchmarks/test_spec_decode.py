"""benchmarks/spec_decode.py end to end on the CPU with the tiny GLM-5 checkpoint: both engines are
timed for every batch and draft count and the results file holds one row per (batch, drafts)."""

from __future__ import annotations

import json

from benchmarks import spec_decode


def test_tiny_run_writes_every_row(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXDSA_RESULTS", str(tmp_path))
    path = spec_decode.main(
        ["--tiny", "--context", "12", "--batches", "2", "--drafts", "2", "--steps", "2", "--rounds", "2"]
    )
    rows = json.loads(path.with_suffix(".json").read_text())["rows"]
    assert [(r["batch"], r["drafts"]) for r in rows] == [(2, 2)]
    assert rows[0]["verify step ms"] > 0 and rows[0]["plain step ms"] > 0
    assert rows[0]["added ms"] == rows[0]["verify step ms"] - rows[0]["plain step ms"]
    assert "commit" in path.read_text()


def test_tokens_per_step_follow_the_acceptance_rate():
    assert spec_decode.tokens_per_step(3, 0.0) == 1
    assert spec_decode.tokens_per_step(3, 1.0) == 4
    assert abs(spec_decode.tokens_per_step(2, 0.5) - 1.75) < 1e-12
