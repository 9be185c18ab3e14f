"""benchmarks/v4_kernels.py end to end on the CPU at toy widths (interpret mode): every V4 kernel
case is checked against its float32 reference and timed (both implementations), and the results
file is written."""

from __future__ import annotations

from benchmarks import v4_kernels

# Left out of the default run (tests/conftest.py; pytest -m slow runs them): the tiny run of every case: the
# default run checks the filter and the merge, and tests/kernels each V4 kernel against its reference.
SLOW_CASES = ("test_tiny_run_checks_and_times_every_case",)


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
    every = v4_kernels.cases(v4_kernels.TINY)
    assert len(rows) == sum(2 if c.time_reference else 1 for c in every)  # pallas (and reference) timed
    assert all(line.split("|")[4].strip() for line in rows)  # every row has a time


def test_kernel_filter_and_merge(tmp_path, monkeypatch):
    """Two runs of some kernels each (V4_KERNELS) merge into one file in case order; the later run's
    row of a case both measured wins."""
    monkeypatch.delenv("V4_BUDGET_S", raising=False)
    parts = []
    for i, kernels in enumerate(("merge_states,hc_post", "hc_post:T=")):
        monkeypatch.setenv("V4_KERNELS", kernels)
        monkeypatch.setenv("V4_JSON", str(tmp_path / f"{i}.json"))
        v4_kernels.main(v4_kernels.TINY, out=tmp_path / f"{i}.md")
        parts.append(tmp_path / f"{i}.json")
    text = v4_kernels.merge(tmp_path / "merged.md", parts, v4_kernels.TINY).read_text()
    rows = [line for line in text.split("## Every measurement")[1].splitlines() if line.startswith("| ")][1:]
    assert [line.split("|")[1].strip() for line in rows] == ["hc_post"] * 2 + ["merge_states"] * 2
