"""GLM-5.3-Flash on meshes of 8 fake CPU devices reproduces the HF goldens (tests/fixtures/glm53*).

MLA and index heads, the experts, the shared expert, the dense MLP and the vocabulary split as for
GLM-5; the KDA heads split over TP like attention heads (their projections, conv channels, per-head
gates, the per-sequence state and conv ring; ``linear_heads``), the hyper-connections run whole on
every device, and under dp attention each dp group keeps its own sequences' states and rings.
"""

import numpy as np
import pytest
from flax import nnx

import jaxdsa
from jaxdsa.engine import penalties
from jaxdsa.engine.engine import CacheLayout
from tests.conftest import FIXTURES
from tests.sharding.test_parallel_parity import (
    assert_cache_pages_split_over_dp,
    assert_long_prompt_and_greedy_match,
)

pytestmark = pytest.mark.slow  # GLM-5.3-Flash on meshes; one device: tests/models/glm5_next

# (fixture, (tp, ep, dp, dp_attention)): the tiny model's 4 KDA heads split 2 and 4 ways, over tpi
# alone (ep 1), over tpe and tpi (tp 4, ep 2), replicated over rep (ep > tp), inside dp-attention groups
CASES = [
    ("glm53", (2, 1, 1, False)),
    ("glm53", (4, 1, 1, False)),
    ("glm53_sharded", (4, 2, 1, False)),
    ("glm53", (2, 4, 1, False)),
    ("glm53", (2, 4, 2, True)),
]


@pytest.fixture(
    scope="module",
    params=CASES,
    ids=lambda p: f"{p[0]}-tp{p[1][0]}ep{p[1][1]}dp{p[1][2]}" + ("-dpattn" if p[1][3] else ""),
)
def case(request):
    name, (tp, ep, dp, dp_attention) = request.param
    llm = jaxdsa.LLM(
        FIXTURES / name,
        dtype="float32",
        page_size=8,
        progress=False,
        tp=tp,
        ep=ep,
        dp=dp,
        dp_attention=dp_attention,
        max_num_seqs=2 * dp,
        max_model_len=256,
    )
    return llm, request.param[1], dict(np.load(FIXTURES / name / "golden.npz"))


def test_logits_and_greedy_tokens_match_hf(case):
    """The long prompt (two KDA chunk boundaries, many pools) in one step, then prefill + 16 decode steps."""
    llm, layout, golden = case
    assert_long_prompt_and_greedy_match(llm, golden)
    assert_cache_pages_split_over_dp(llm, layout[2])


def kda_shard_shapes(cfg, tp: int) -> dict[tuple, tuple]:
    """Independent statement of the KDA layout: parameter name -> per-device shape (a stacked layer's
    slice). Heads are split; the gates' rank-K down projections and o_norm are replicated."""
    D, H, K, W = cfg.hidden_size, cfg.linear_num_heads, cfg.linear_head_dim, cfg.linear_conv_kernel_dim
    Hl = H // tp
    return {
        **{(f"{x}_proj", "weight"): (D, Hl, K) for x in "qkv"},
        **{(f"{x}_conv",): (Hl, K, W) for x in "qkv"},
        ("f_a", "weight"): (D, K),
        ("f_b", "weight"): (K, Hl, K),
        ("g_a", "weight"): (D, K),
        ("g_b", "weight"): (K, Hl, K),
        ("dt_bias",): (Hl, K),
        ("a_log",): (Hl,),
        ("b_proj", "weight"): (D, Hl),
        ("o_norm",): (K,),
        ("o_proj", "weight"): (Hl, K, D),
    }


def test_kda_heads_and_state_are_split_over_tp(case):
    """Each device holds 1/tp of every KDA layer's heads: parameters, recurrent state and conv ring."""
    llm, (tp, _, dp, _), _ = case
    want, seen = kda_shard_shapes(llm.config, tp), set()
    for path, variable in nnx.to_flat_state(nnx.state(llm.model, nnx.Param)):
        suffix = next((s for s in want if tuple(path[-len(s) - 1 :]) == ("attn", *s)), None)
        if suffix is not None:
            leaf = variable.get_value()
            got = leaf.sharding.shard_shape(leaf.shape)
            assert got[len(got) - len(want[suffix]) :] == want[suffix], (path, leaf.sharding.spec)
            seen.add(suffix)
    assert seen == set(want)
    cache, kda_layers = llm.engine.runner.cache, len(llm.config.kda_layers)
    for name in ("kda_state", "kda_conv"):  # [KDA layers, sequences, ring, width]
        leaf = cache[name]
        L, seqs, ring, width = leaf.shape
        assert L == kda_layers
        assert leaf.sharding.shard_shape(leaf.shape) == (L, seqs // dp, ring, width // tp), name


def test_the_engine_sets_aside_what_each_device_holds_of_the_states(case):
    """The engine's per-device reservation for its slots' rings (memory accounting) is what one device
    holds of them: the KDA states and conv rings a tp-th, the open index pools whole."""
    llm, _, _ = case
    layout = CacheLayout.of(llm.family, llm.config, llm.engine_config, llm.dtype, llm.mesh)
    rings = [llm.engine.runner.cache[name] for name in ("kda_state", "kda_conv", "index_ring")]
    held = sum(leaf.addressable_shards[0].data.nbytes for leaf in rings)
    penalty_rows = layout.slots * llm.config.vocab_size * penalties.BYTES_PER_ENTRY
    assert layout.state_bytes - penalty_rows == held


def test_kda_heads_that_tp_does_not_divide_are_refused_naming_the_field():
    """The tiny model's 4 KDA heads over 8 shards (MLA and index heads would be zero-padded)."""
    with pytest.raises(ValueError, match="linear_num_heads = 4 does not split evenly into 8"):
        jaxdsa.LLM(FIXTURES / "glm53", dtype="float32", progress=False, tp=8, max_model_len=64)
