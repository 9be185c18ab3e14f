"""The FP8 KV cache on meshes (8 fake CPU devices): pages of every fp8 entry split over the dp groups,
the logits and greedy tokens of its HF reference (tests/models/test_kv_fp8.py)."""

import pytest

from tests.models.test_kv_fp8 import assert_matches, fp8_llm, golden


@pytest.mark.parametrize("layout", [(2, 2, 1, False), (2, 4, 2, True)], ids=["tp2ep2", "tp2ep4dp2-dpattn"])
def test_the_fp8_cache_on_a_mesh(layout):
    tp, ep, dp, dp_attention = layout
    llm = fp8_llm(
        "glm52", tp=tp, ep=ep, dp=dp, dp_attention=dp_attention, max_num_seqs=2 * dp, max_model_len=64
    )
    for leaf in llm.engine.runner.cache.values():  # pages split over the dp groups, fp8 entries included
        assert leaf.sharding.shard_shape(leaf.shape)[1] == leaf.shape[1] // dp
    assert_matches(llm, golden("glm52"), prompts=("long",))
