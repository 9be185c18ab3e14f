"""benchmarks/spec_decode.py end to end on the CPU with the tiny GLM-5 checkpoint: both engines are
timed for every batch and draft count and the results file holds one row per (batch, drafts)."""

from __future__ import annotations

import json

from benchmarks import spec_decode

# Left out of the default run (tests/conftest.py; pytest -m slow runs them): the INT4 preset run: the
# default run checks a tiny run's rows and the acceptance arithmetic.
SLOW_CASES = ("test_preset_with_int4_weights_and_the_mtp_layer",)


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


SMALL_GLM52 = {  # GLM-5.2's layer kinds at widths a CPU runs in seconds (INT4 needs K in 256-row words)
    "vocab_size": 1024,
    "hidden_size": 256,
    "intermediate_size": 512,
    "moe_intermediate_size": 256,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "q_lora_rank": 256,
    "kv_lora_rank": 256,
    "qk_nope_head_dim": 64,
    "qk_rope_head_dim": 32,
    "v_head_dim": 64,
    "index_n_heads": 2,
    "index_head_dim": 64,
    "index_topk": 64,
    "n_routed_experts": 16,
    "num_experts_per_tok": 4,
    "max_position_embeddings": 4096,
}


def test_preset_with_int4_weights_and_the_mtp_layer(tmp_path, monkeypatch):
    """The path of a real-depth run (a preset's config, random weights kept INT4, the MTP layer), at
    small widths: both engines step and the results file names the model as run."""
    monkeypatch.setenv("JAXDSA_RESULTS", str(tmp_path))
    args = ["--preset", "glm52", "--layers", "4", "--quantization", "int4", "--context", "16"]
    args += ["--overrides", json.dumps(SMALL_GLM52), "--batches", "1", "--drafts", "1"]
    path = spec_decode.main([*args, "--steps", "2", "--rounds", "1", "--suffix=-small"])
    rows = json.loads(path.with_suffix(".json").read_text())["rows"]
    assert [(r["batch"], r["drafts"]) for r in rows] == [(1, 1)]
    assert "glm52 widths, 4 layers + MTP, INT4; -tp 1 -ep 1 -dp 1 (1 device(s))" in path.read_text()
