"""benchmarks/quant.py end to end on the CPU at tiny shapes (interpret mode): every format's rows are
checked against the float32 reference and timed, and the results file is written."""

from __future__ import annotations

from benchmarks import quant


def test_small_run_writes_a_report(tmp_path, monkeypatch):
    monkeypatch.delenv("QUANT_TOKENS", raising=False)
    monkeypatch.delenv("QUANT_FORMATS", raising=False)
    path = quant.main(quant.SMALL, out=tmp_path / "quant.md")
    text = path.read_text()
    assert "commit" in text and "read ceiling" in text and "FAILED" not in text
    rows = [
        line for line in text.splitlines() if line.startswith("| routed experts") or line.startswith("| kv_a")
    ]
    timed = [r for r in rows if "torch" not in r]
    assert len(timed) == 6  # int4, fp8 (software decode: the CPU default), bf16 x (experts, linear)
    assert all(r.split("|")[5].strip() for r in timed)  # every Pallas / XLA row has a time
