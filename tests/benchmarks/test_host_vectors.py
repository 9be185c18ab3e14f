"""benchmarks/host_vectors.py end to end on this CPU: both vector widths measured in processes of their
own for every case, one row per case in the results file (no timing asserted)."""

from __future__ import annotations

import json

import pytest

from benchmarks import host_vectors

# Two processes a width compile the host kernels cold; left to pytest -m slow (tests/offload checks the
# kernels themselves).
pytestmark = pytest.mark.slow


def test_both_widths_measure_every_case(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXDSA_RESULTS", str(tmp_path))
    path = host_vectors.main(["--formats", "int4,fp4", "--tokens", "1", "--rounds", "1", "--calls", "2"])
    rows = json.loads(path.with_suffix(".json").read_text())["rows"]
    assert [(r["format"], r["tokens"]) for r in rows] == [("int4", 1), ("fp4", 1)]
    for r in rows:
        assert r["256-bit us"] > 0 and r["512-bit us"] > 0
        assert r["speed-up"] == r["256-bit us"] / r["512-bit us"]
