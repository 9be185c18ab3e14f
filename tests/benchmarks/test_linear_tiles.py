"""benchmarks/linear_tiles.py on the CPU: the launches' shapes at a TP split, tile variants parsed and
applied, every variant's output checked in interpret mode, and the trace's kernels turned into times."""

from __future__ import annotations

import pytest

from benchmarks import linear_tiles, moe_tiles
from benchmarks.serve_gpu import PRESETS

TINY = {
    "hidden_size": 256,
    "num_attention_heads": 4,
    "q_lora_rank": 128,
    "kv_lora_rank": 64,
    "qk_rope_head_dim": 32,
    "qk_nope_head_dim": 32,
    "v_head_dim": 32,
    "index_n_heads": 4,
    "index_head_dim": 32,
    "moe_intermediate_size": 64,
    "n_shared_experts": 1,
    "intermediate_size": 128,
}


def test_glm52_launches_at_tp4():
    shapes = linear_tiles.decode_linears(PRESETS["glm52"], 4)
    assert shapes["q_a|kv_a|wk"] == ((6144, 2048), (6144, 576), (6144, 128))
    assert shapes["q_b|wq_b"] == ((2048, 16 * 256), (2048, 8 * 128))
    assert shapes["o_proj"] == ((16 * 256, 6144),)
    assert shapes["shared down"] == ((512, 6144),)
    assert shapes["dense gate|up"] == ((6144, 3072), (6144, 3072))


def test_variants_parse_and_apply():
    base, fill8, k2, bad = linear_tiles.parse_variants("base,f8:fill=8+num_warps=8,k2:block_k=2x,bad:x=1")
    assert base.fields == () and fill8.fields == (("fill", "8"), ("num_warps", "8"))
    cfg = linear_tiles.kernel.group_config(1, (linear_tiles._spec("int4", 2048, 4096),), "bfloat16")
    assert base.config(cfg, 1, 2048, lambda n: 4096 // n) == cfg
    doubled = k2.config(cfg, 1, 2048, lambda n: 4096 // n)
    assert doubled.block_k == 2 * cfg.block_k and (2048 // doubled.block_k) % doubled.splits == 0
    more = fill8.config(cfg, 1, 2048, lambda n: 4096 // n)
    assert more.num_warps == 8 and more.splits >= cfg.splits
    with pytest.raises(ValueError, match="unknown field"):
        bad.config(cfg, 1, 2048, lambda n: 4096 // n)
    with pytest.raises(ValueError, match="field=value"):
        linear_tiles.parse_variants("x:num_warps")


def test_every_variant_checked_in_interpret_mode():
    variants = linear_tiles.parse_variants("base,n32w8:block_n=32+num_warps=8,f4:fill=4")
    rows, _ = linear_tiles.run(
        TINY, tp=2, tokens=(1,), fmt="int4", variants=variants, only=("q_a|kv_a|wk", "o_proj"), interpret=True
    )
    assert len(rows) == 2 * (len(variants) + 2)  # launches x (variants + two XLA peers)
    assert all("note" not in r and r["rel_err"] <= linear_tiles.TOLERANCE for r in rows), rows
    with pytest.raises(SystemExit, match="unknown launches"):
        linear_tiles.run(
            TINY, tp=2, tokens=(1,), fmt="int4", variants=variants, only=("nope",), interpret=True
        )


def test_kernel_time_from_traced_kernels():
    group = [
        {"name": "quant_matmul", "dur": 10.0},
        {"name": "loop_reduce_fusion", "dur": 2.0},
        {"name": "quant_matmul", "dur": 12.0},
        {"name": "loop_reduce_fusion", "dur": 2.0},
        {"name": "MemcpyD2H", "dur": 5.0},
    ]
    t = linear_tiles.kernel_time(group, 2, "quant_matmul")
    assert t == {"kernel_us": 11.0, "other_us": 2.0, "total_us": 13.0, "kernels": 4}
    assert linear_tiles.kernel_time(group, 2, "")["kernel_us"] == 13.0


def test_moe_variants_checked_in_interpret_mode():
    """benchmarks/moe_tiles.py: every variant of the routed experts checked against the float32
    definition, and the traced kernels split into gate|up, down and the rest."""
    raw = TINY | {"n_routed_experts": 8, "num_experts_per_tok": 2}
    variants = linear_tiles.parse_variants("base,dn_n32:dn_block_n=32,w8:num_warps=8")
    rows, _ = moe_tiles.run(raw, tp=2, tokens=(1,), variants=variants, interpret=True)
    assert [r["impl"] for r in rows] == ["base", "dn_n32", "w8"]
    assert all("note" not in r and r["rel_err"] <= linear_tiles.TOLERANCE for r in rows), rows
    assert "dn n32" in rows[1]["config"] and "w8" in rows[2]["config"]
    group = [
        {"name": "moe_gate_up", "dur": 10.0},
        {"name": "moe_down", "dur": 6.0},
        {"name": "loop_add_fusion", "dur": 2.0},
        {"name": "Memset", "dur": 1.0},
    ]
    assert moe_tiles.kernel_times(group, 2) == {
        "moe_gate_up_us": 5.0,
        "moe_down_us": 3.0,
        "other_us": 1.0,
        "total_us": 9.0,
    }
