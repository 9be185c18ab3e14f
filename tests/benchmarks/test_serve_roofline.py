"""Serving roofline accounting (benchmarks/serve_gpu.py through jaxdsa.plan) on a tiny GLM-5 config."""

from __future__ import annotations

import pytest

from benchmarks.serve_gpu import (
    GLM5,
    GLM52,
    _parallel_flags,
    main,
    moe_tokens,
    planned_weight_bytes,
    step_bytes,
    write_model_dir,
)
from jaxdsa.models.deepseek_v4.config import CSA, HCA, SWA
from jaxdsa.models.registry import config_from_dict
from jaxdsa.plan import expected_experts
from jaxdsa.sharding import Parallelism

TINY = {
    **GLM5,
    "vocab_size": 1024,
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 3,
    "first_k_dense_replace": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "q_lora_rank": 32,
    "kv_lora_rank": 32,  # INT4 packs K in 32-row chunks: kv_b (K = kv_lora_rank) stays packed
    "qk_nope_head_dim": 8,
    "qk_rope_head_dim": 8,
    "v_head_dim": 8,
    "index_n_heads": 2,
    "index_head_dim": 16,
    "index_topk": 32,
    "n_routed_experts": 16,
    "num_experts_per_tok": 4,
    "indexer_types": ["full"] * 3,
}


def test_expected_experts_under_uniform_routing():
    assert expected_experts(256, 8, 1) == pytest.approx(8.0)
    assert expected_experts(256, 8, 32) == pytest.approx(163.3, abs=0.1)  # the old count said 256
    for batch in (1, 2, 4, 8, 32, 256):
        assert expected_experts(256, 8, batch) <= min(256, 8 * batch) + 1e-9
    # exact for two tokens: 16 picks minus the expected overlap 8 * 8 / 256
    assert expected_experts(256, 8, 2) == pytest.approx(16 - 64 / 256)


def test_step_bytes_count_the_expected_experts_and_every_sequences_cache():
    expert = 3 * TINY["hidden_size"] * TINY["moe_intermediate_size"] * 2
    moe_layers = TINY["num_hidden_layers"] - TINY["first_k_dense_replace"]
    b1, b2 = step_bytes(TINY, "bf16", 16, 1), step_bytes(TINY, "bf16", 16, 2)
    routed = (expected_experts(16, 4, 2) - expected_experts(16, 4, 1)) * expert * moe_layers
    kv_row = (TINY["kv_lora_rank"] + TINY["qk_rope_head_dim"]) * 2
    embedding_row = TINY["hidden_size"] * 2  # the second sequence's token looked up
    assert b2 - b1 == pytest.approx(routed + TINY["num_hidden_layers"] * 16 * kv_row + embedding_row)


def test_quantized_steps_read_fewer_bytes():
    bf16, fp8, int4 = (step_bytes(TINY, w, 16, 1) for w in ("bf16", "fp8", "int4"))
    assert int4 < fp8 < bf16


def test_split_models_count_one_gpus_share():
    """With the server's parallelism flags the roofline and the planned weights are one GPU's: tp = 2
    holds about half of every split weight; ep = 2 without tp half of the experts, the rest whole."""
    one, tp2 = planned_weight_bytes(TINY, "bf16"), planned_weight_bytes(TINY, "bf16", Parallelism(tp=2))
    assert one / 2 < tp2 < one
    assert tp2 < planned_weight_bytes(TINY, "bf16", Parallelism(ep=2)) < one
    assert step_bytes(TINY, "bf16", 16, 4, Parallelism(tp=2)) < step_bytes(TINY, "bf16", 16, 4)
    assert _parallel_flags(Parallelism()) == ""
    assert _parallel_flags(Parallelism(ep=8, dp=8, dp_attention=True)) == (
        " -tp 1 -ep 8 -dp 8 --enable-dp-attention (8 GPUs)"
    )


def test_glm52_preset_has_shared_indexer_layers(tmp_path):
    raw = write_model_dir(str(tmp_path), 10, preset="glm52")
    cfg = config_from_dict(raw)
    assert raw["rope_parameters"] == GLM52["rope_parameters"]
    assert [layer for layer in range(10) if cfg.has_indexer(layer)] == [0, 1, 2, 6]


def test_v4flash_preset_is_the_release_schedule_cut_to_its_layers(tmp_path):
    raw = write_model_dir(str(tmp_path), 4, preset="v4flash")
    cfg = config_from_dict(raw)
    assert cfg.layer_types == (SWA, SWA, CSA, HCA) and cfg.hidden_size == 4096
    assert (tmp_path / "tokenizer.json").exists()
    assert 0 < step_bytes(raw, "bf16", 544, 1) < step_bytes(raw, "bf16", 544, 8)


def test_fewer_prompts_than_streams_is_refused(capsys):
    """A level sending fewer requests than its concurrency would report streams that never ran."""
    with pytest.raises(SystemExit):
        main(["--concurrency", "1,32", "--num-prompts", "16"])
    assert "--num-prompts 16 is below the highest --concurrency (32)" in capsys.readouterr().err


def test_experts_column_counts_the_tokens_that_meet_at_the_experts():
    """Plain dp replicas route their own sequences; with dp attention every group's tokens meet at
    the experts; TP / EP see the whole batch."""
    assert moe_tokens(8, Parallelism(dp=2)) == 4
    assert moe_tokens(8, Parallelism(ep=2, dp=2, dp_attention=True)) == 8
    assert moe_tokens(8, Parallelism(tp=2)) == 8
    assert moe_tokens(7, Parallelism(dp=2)) == 4
