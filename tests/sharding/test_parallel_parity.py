"""Tensor / expert / data parallelism on 8 fake CPU devices reproduces the HF goldens.

Every parameter's per-device shard shape is checked against what the layout must be, so a
weight that silently ends up replicated fails.
"""

import numpy as np
import pytest
from flax import nnx

import jaxdsa
from jaxdsa.engine import SamplingParams
from tests.conftest import FIXTURES
from tests.engine.test_warmup import step_lowerings, variants
from tests.models.test_hf_parity import TOLERANCE, rel_l2
from tests.models.test_penalties import PENALIZED, penalized_logits

# Left out of the default run (tests/conftest.py; pytest -m slow runs them): HF parity on the other meshes:
# the default run checks each fixture on one dp-attention mesh and one without dp; and the warm-up on
# dp groups.
SLOW_CASES = (
    "test_logits_and_greedy_tokens_match_hf[dsv32-tp1ep8dp8-dpattn]",
    "test_logits_and_greedy_tokens_match_hf[dsv32-tp2ep4dp2-dpattn]",
    "test_logits_and_greedy_tokens_match_hf[dsv32-tp2ep2dp2]",
    "test_logits_and_greedy_tokens_match_hf[dsv32-tp2ep4dp1]",
    "test_logits_and_greedy_tokens_match_hf[dsv32-tp8ep8dp1]",
    "test_logits_and_greedy_tokens_match_hf[dsv32-tp4ep2dp1]",
    "test_logits_and_greedy_tokens_match_hf[glm52-tp4ep4dp2-dpattn]",
    "test_logits_and_greedy_tokens_match_hf[glm52-tp2ep2dp2]",
    "test_logits_and_greedy_tokens_match_hf[glm52-tp1ep8dp8-dpattn]",
    "test_logits_and_greedy_tokens_match_hf[glm52-tp4ep2dp1]",
    "test_logits_and_greedy_tokens_match_hf[glm52-tp2ep4dp1]",
    "test_logits_and_greedy_tokens_match_hf[glm52-tp2ep1dp1]",
    "test_warmup_on_dp_groups[*]",
)

# (tp, ep, dp, dp_attention); with dp_attention the dp groups share the experts (ep counts all shards).
LAYOUTS = [
    (2, 1, 1, False),
    (4, 2, 1, False),
    (2, 4, 1, False),
    (8, 8, 1, False),
    (2, 2, 2, False),
    (2, 4, 2, True),
    (4, 4, 2, True),
    (1, 8, 8, True),
]


def expected_shard_shapes(cfg, tp, ep, dp, dp_attention):
    """Independent statement of the layout: leaf name -> per-device shard shape."""
    H = -(-cfg.num_attention_heads // tp) * tp  # heads are zero-padded to a multiple of tp
    Hi = -(-cfg.index_n_heads // tp) * tp
    r, D, E, N = cfg.kv_lora_rank, cfg.hidden_size, cfg.n_routed_experts, cfg.moe_intermediate_size
    expert_shards = ep
    group_ep = ep // dp if dp_attention else ep
    expert_tp = tp // group_ep if group_ep < tp else 1
    joined = ep == 1  # unsplit experts hold the shared expert as one more (jaxdsa.shared_experts)
    shared = {} if joined else {("shared", "gate", "weight"): (D, N * cfg.n_shared_experts // tp)}
    return shared | {
        ("embed", "weight"): (cfg.vocab_size // tp, D),
        ("lm_head", "weight"): (D, cfg.vocab_size // tp),
        ("q_b", "weight"): (cfg.q_lora_rank, H // tp, cfg.qk_head_dim),
        ("w_uk", "weight"): (r, H // tp, cfg.qk_nope_head_dim),
        ("w_uv", "weight"): (r, H // tp, cfg.v_head_dim),
        ("o", "weight"): (H // tp, cfg.v_head_dim, D),
        ("kv_a", "weight"): (D, cfg.latent_dim),  # the latent projection is shared by all heads: replicated
        ("wq_b", "weight"): (cfg.q_lora_rank, Hi // tp, cfg.index_head_dim),
        ("weights_proj", "weight"): (D, Hi // tp),
        ("mlp", "gate", "weight"): (D, cfg.intermediate_size // tp),
        ("mlp", "down", "weight"): (cfg.intermediate_size // tp, D),
        ("experts", "gate_up"): (E // expert_shards + joined, D, 2 * N // expert_tp),
        ("experts", "down"): (E // expert_shards + joined, N // expert_tp, D),
        ("router", "weight"): (E, D),
    }


def check_layout(llm, layout):
    """Every parameter (stacked layers: each layer's slice) has the per-device shape the layout needs."""
    want = expected_shard_shapes(llm.config, *layout)
    seen = set()
    for path, variable in nnx.to_flat_state(nnx.state(llm.model, nnx.Param)):
        leaf = variable.get_value()
        for suffix, shape in want.items():
            if tuple(path[-len(suffix) :]) == suffix:
                got = leaf.sharding.shard_shape(leaf.shape)
                assert got[len(got) - len(shape) :] == shape, (path, leaf.sharding.spec)
                seen.add(suffix)
    assert seen == set(want)


def mesh_case(name: str, layout: tuple) -> tuple:
    """(the fixture's LLM on the (tp, ep, dp, dp_attention) layout, the layout, its goldens)."""
    tp, ep, dp, dp_attention = layout
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
        max_model_len=64,
    )
    return llm, layout, dict(np.load(FIXTURES / name / "golden.npz"))


def assert_cache_pages_split_over_dp(llm, dp: int) -> None:
    for leaf in llm.engine.runner.cache.values():  # [layers, pages, page, width]: pages split over dp
        assert leaf.sharding.shard_shape(leaf.shape)[1] == leaf.shape[1] // dp


def assert_long_prompt_and_greedy_match(llm, golden) -> None:
    """The long prompt's logits, then prefill + the greedy tokens through the paged cache."""
    assert rel_l2(llm.score(golden["prompt_long"].tolist()), golden["logits_long"]).max() <= TOLERANCE
    tokens, logits = llm.generate(
        [golden["greedy_prompt"].tolist()], max_new_tokens=len(golden["greedy_tokens"]), return_logits=True
    )
    assert tokens[0] == golden["greedy_tokens"].tolist()
    assert rel_l2(logits[0], golden["greedy_logits"]).max() <= TOLERANCE


@pytest.fixture(
    scope="module",
    params=[(f, layout) for f in ("glm52", "dsv32") for layout in LAYOUTS],
    ids=lambda p: f"{p[0]}-tp{p[1][0]}ep{p[1][1]}dp{p[1][2]}" + ("-dpattn" if p[1][3] else ""),
)
def case(request):
    return mesh_case(*request.param)


def test_every_parameter_is_sharded_as_declared(case):
    llm, layout, _ = case
    check_layout(llm, layout)
    assert_cache_pages_split_over_dp(llm, layout[2])


def test_logits_and_greedy_tokens_match_hf(case):
    llm, _, golden = case
    assert_long_prompt_and_greedy_match(llm, golden)


def test_prompt_logprobs_on_dp_groups_match_hf(case):
    """Scoring picks each segment's tokens out of its own dp group (dp = 8: one layout per family)."""
    llm, (_, _, dp, _), golden = case
    if dp < 8:
        pytest.skip("one dp layout is enough")
    engine, prompt = llm.engine, golden["prompt_long"].tolist()
    for i in range(3):  # admitted to the groups with the most free pages: spread over the groups
        engine.add_request(
            f"r{i}", prompt[: 10 + i], SamplingParams(max_tokens=1, prompt_logprobs=2 if i == 1 else None)
        )
    engine.add_request("scored", prompt, SamplingParams(max_tokens=1, prompt_logprobs=2))
    entries = {}
    while engine.has_unfinished():
        entries |= {o.request_id: o.prompt_logprobs for o in engine.step()}
    logits = golden["logits_long"].astype(np.float64)
    hf = (
        logits
        - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True))
        - logits.max(-1, keepdims=True)
    )
    for name, n in (("r1", 11), ("scored", len(prompt))):
        got = entries[name]
        assert got[0] is None and len(got) == n
        np.testing.assert_allclose([e.logprob for e in got[1:]], hf[np.arange(n - 1), prompt[1:n]], atol=1e-4)
    assert entries["r0"] is None and entries["r2"] is None


def test_penalties_on_dp_groups(case):
    """Penalty rows live with their dp group's slots: each group's requests follow vLLM's
    penalties over their own tokens (dp = 8: one layout per family)."""
    llm, (_, _, dp, _), golden = case
    if dp < 8:
        pytest.skip("one dp layout is enough")
    engine, prompt = llm.engine, golden["prompt_long"].tolist()
    params = {f"p{i}": sp for i, sp in enumerate(PENALIZED.values())} | {
        "plain": SamplingParams(max_tokens=14)
    }
    for i, (rid, sp) in enumerate(params.items()):
        engine.add_request(rid, prompt[: 12 + i], sp, return_logits=True)
    outputs = {rid: [] for rid in params}
    while engine.has_unfinished():
        for o in engine.step():
            outputs[o.request_id].append(o)
    for i, (rid, sp) in enumerate(params.items()):
        tokens = [o.new_token_ids[0] for o in outputs[rid]]
        for pos, o in enumerate(outputs[rid]):
            assert tokens[pos] == int(
                np.argmax(penalized_logits(o.logits, prompt[: 12 + i], tokens[:pos], sp))
            ), (rid, pos)


def test_warmup_on_dp_groups(case):
    """Warm-up lowers each step variant once on the mesh and the greedy steps after it reuse them
    (dp = 8, GLM: one layout)."""
    llm, (_, _, dp, _), golden = case
    if dp < 8 or llm.config.model_type != "glm_moe_dsa":
        pytest.skip("one dp layout is enough")
    engine, n = llm.engine, variants(llm.engine)
    with step_lowerings() as lowered:
        engine.warmup(progress=False)
        assert len(lowered) == n
        want = golden["greedy_tokens"].tolist()
        engine.add_request("greedy", golden["greedy_prompt"].tolist(), SamplingParams(max_tokens=len(want)))
        tokens = []
        while engine.has_unfinished():
            tokens += [t for o in engine.step() for t in o.new_token_ids]
        assert tokens == want and len(lowered) == n
