"""The FP8 KV cache on meshes (8 fake CPU devices): pages of every fp8 entry split over the dp groups,
the logits and greedy tokens of its HF reference (tests/models/test_kv_fp8.py)."""

import pytest

from tests.models.test_kv_fp8 import assert_matches, fp8_llm, golden

pytestmark = pytest.mark.slow  # FP8 cache on meshes; one device: tests/models/test_kv_fp8.py


@pytest.mark.parametrize(
    "name, layout",
    [("glm52", (2, 2, 1, False)), ("glm52", (2, 4, 2, True)), ("dsv4", (2, 2, 2, True))],
    ids=["glm52-tp2ep2", "glm52-tp2ep4dp2-dpattn", "dsv4-tp2ep2dp2-dpattn"],
)
def test_the_fp8_cache_on_a_mesh(name, layout):
    tp, ep, dp, dp_attention = layout
    llm = fp8_llm(name, tp=tp, ep=ep, dp=dp, dp_attention=dp_attention, max_num_seqs=2 * dp, max_model_len=64)
    for leaf in llm.engine.runner.cache.values():  # pages split over the dp groups, fp8 entries included
        assert leaf.sharding.shard_shape(leaf.shape)[1] == leaf.shape[1] // dp
    assert_matches(llm, golden(name), prompts=("long",))
