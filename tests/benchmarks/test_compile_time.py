"""benchmarks/compile_time.py on the CPU at tiny shapes (Pallas interpreter): the rows it compiles,
the variants it applies and the results file it writes (no timing is checked)."""

from __future__ import annotations

import json

from benchmarks import compile_time
from pallas_kernels.moe.tuning import MoeConfig, Tile
from pallas_kernels.quant_matmul.tuning import QmmConfig


def test_variant_sets_config_tile_and_int4_decode_fields():
    variant = compile_time.Variant.parse("v:absorb_m=0+num_stages=2+int4_decode=bf16")
    assert (variant.name, variant.int4_decode) == ("v", "bf16")
    cfg = variant.apply(MoeConfig(16, Tile(128, 256, 8, 4), Tile(128, 256, 8, 3)))
    assert cfg.absorb_m == 0 and cfg.gate_up == Tile(128, 256, 8, 2) and cfg.down == Tile(128, 256, 8, 2)
    assert variant.apply_linear(QmmConfig(16, 64, 256, 1, 4, 4)) == QmmConfig(16, 64, 256, 1, 4, 2)
    assert compile_time.Variant.parse("default") == compile_time.DEFAULT


def test_small_run_writes_every_row(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXDSA_RESULTS", str(tmp_path))
    argv = [
        "--small",
        "--formats",
        "int4",
        "bf16",
        "--variants",
        "s2:num_stages=2",
        "odd:block_n=24",
        "--linears",
        "--attention",
        "--keys",
        "32",
        "--experts",
        "4",
        "--parallel",
    ]
    path = compile_time.main(argv)
    rows = json.loads(path.with_suffix(".json").read_text())["rows"]
    assert "E=4 " in path.read_text() and "32 keys per query" in path.read_text()
    firsts = [("int4", "default"), ("bf16", "default"), ("int4", "s2")]
    assert [(r["format"], r["variant"]) for r in rows[:3]] == firsts
    others = [(r["op"], r["variant"]) for r in rows if r["op"] != compile_time.MOE]
    assert others == [
        ("kv_a (576 rows)", "default"),
        ("kv_a (576 rows)", "s2"),
        ("kv_a (576 rows)", "odd"),
        (compile_time.ATTENTION, "default"),
    ]
    (failed,) = [r for r in rows if r["variant"] == "odd" and r["op"] == compile_time.MOE]
    assert "compile_s" not in failed and "ValueError" in failed["note"]  # 24 columns: the row keeps its error
    assert rows[2]["config"].count(" s2") == 2  # the variant's stages on both kernels' tiles
    assert all(r["config"] for r in rows if "config" in r)
    assert all(r["compile_s"] > 0 for r in rows if r is not failed)
    assert rows[-1]["T"] == "all" and "side by side" in rows[-1]["note"]
    assert sum(r["variant"] == "serial" for r in rows) == 3  # T = 1, 2, 4
