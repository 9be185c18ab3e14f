"""benchmarks/v4_kernels.py end to end on the CPU at toy widths (interpret mode): every V4 kernel
case is checked against its float32 reference and timed (both implementations), and the results
file is written."""

from __future__ import annotations

from benchmarks import v4_kernels


def test_tiny_run_checks_and_times_every_case(tmp_path, monkeypatch):
    monkeypatch.delenv("V4_BUDGET_S", raising=False)
    monkeypatch.delenv("V4_JSON", raising=False)
    text = v4_kernels.main(v4_kernels.TINY, out=tmp_path / "v4.md").read_text()
    assert "commit" in text and "FAILED" not in text and "Error" not in text
    rows = [line for line in text.split("## Every measurement")[1].splitlines() if line.startswith("| ")][1:]
    kernels = {line.split("|")[1].strip() for line in rows}
    assert kernels == {
        "hc_pre",
        "hc_post",
        "compress_pool",
        "indexer_logits",
        "topk_indices",
        "sparse_mla",
        "merge_states",
        "attention",
    }
    n_cases = len(v4_kernels.cases(v4_kernels.TINY))
    assert len(rows) == 2 * n_cases  # pallas and reference, each timed
    assert all(line.split("|")[4].strip() for line in rows)  # every row has a time
