"""The V4 paged cache: chunked prefill and decode equal the full forward at every position.

Two sequences share each step (one packed buffer of 8 tokens, padding after them), each fed in
chunks that end inside compression windows (CSA m = 4, HCA m = 8) and then one token at a time,
their pages scattered and interleaved in the cache. Every token's logits are compared with HF's
full-sequence logits of its prompt. The MTP block runs on the main model's streams with its own cache
against the torch oracle (HF's decoder layer and HC head wired as DeepSeek's MTPBlock).
"""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxdsa
from jaxdsa.cache import StepMeta, init_cache
from jaxdsa.engine.speculative import SpeculativeConfig
from jaxdsa.engine.step import ModelState
from jaxdsa.models.registry import family_for
from tests.conftest import FIXTURES
from tests.models.conftest import rel_l2

PAGE, STEP_TOKENS, TOLERANCE = 8, 8, 1e-4
SPEC_2 = {"method": "mtp", "num_speculative_tokens": 2}


def _pad(values: list[int], fill: int) -> np.ndarray:
    return np.asarray(values + [fill] * (STEP_TOKENS - len(values)), np.int32)


@pytest.fixture(scope="module")
def llm():
    return jaxdsa.LLM(FIXTURES / "dsv4", dtype="float32", page_size=PAGE, progress=False)


@pytest.fixture(scope="module")
def golden():
    return dict(np.load(FIXTURES / "dsv4" / "golden.npz"))


def test_chunked_prefill_and_decode_equal_the_full_forward(llm, golden):
    prompts = [golden["prompt_long"], golden["prompt_mid"]]
    chunks = [itertools.cycle([3, 6, 1, 5, 2, 1, 1]), itertools.cycle([2, 1, 1])]
    pages = [[1, 3, 5, 7, 9, 11, 13, 15], [14, 0, 10]]  # 61 and 21 tokens: 8 and 3 pages
    table = np.full((2, 8), 0, np.int32)
    for s, p in enumerate(pages):
        table[s, : len(p)] = p
    family, state = llm.family, ModelState(llm.model)
    step = jax.jit(lambda leaves, *args: family.step(state.model(leaves), *args, None))
    cache = init_cache(family.cache_spec(llm.config), 16, PAGE, jnp.float32, num_seqs=2)
    done, got = [0, 0], [{}, {}]
    while done != [len(p) for p in prompts]:
        tokens, positions, seq_ids = [], [], []
        for s, prompt in enumerate(prompts):
            n = min(next(chunks[s]), len(prompt) - done[s], STEP_TOKENS - len(tokens))
            tokens += prompt[done[s] : done[s] + n].tolist()
            positions += range(done[s], done[s] + n)
            seq_ids += [s] * n
            done[s] += n
        meta = StepMeta(_pad(seq_ids, -1), table, np.arange(STEP_TOKENS, dtype=np.int32))
        logits, cache = step(state.leaves, _pad(tokens, 0), _pad(positions, 0), cache, meta)
        for i in range(len(tokens)):
            got[seq_ids[i]][positions[i]] = np.asarray(logits[i])
    for s, name in enumerate(["long", "mid"]):
        ours = np.stack([got[s][p] for p in range(len(prompts[s]))])
        assert rel_l2(ours, golden[f"logits_{name}"]).max() <= TOLERANCE, name


def test_mtp_block(llm, golden):
    ids = golden["prompt_long"].astype(np.int32)
    T = len(ids)
    n, pages = T - 1, -(-T // PAGE)
    meta = StepMeta(
        jnp.zeros(T, jnp.int32), jnp.arange(pages, dtype=jnp.int32)[None], jnp.arange(T, dtype=jnp.int32)
    )
    model, family, cfg = llm.model, llm.family, llm.config
    positions = jnp.arange(T, dtype=jnp.int32)
    streams, _ = model(
        jnp.asarray(ids), positions, init_cache(family.cache_spec(cfg), pages, PAGE, jnp.float32), meta
    )
    meta_n = StepMeta(jnp.zeros(n, jnp.int32), meta.page_table, jnp.arange(n, dtype=jnp.int32))
    mtp_cache = init_cache(family.mtp_cache_spec(cfg), pages, PAGE, jnp.float32)
    logits, _, _ = model.draft(streams[:n], jnp.asarray(ids[1:]), positions[:n], mtp_cache, meta_n)
    assert rel_l2(np.asarray(logits), golden["mtp_logits"]).max() <= TOLERANCE


def test_engine_chunks_decodes_and_recomputes_a_repeated_prompt(golden):
    """Through the engine: a 6-token budget splits prompts inside windows and mixes prefill chunks
    with decodes of another request (whose slot's rings the first request's used before); a repeated
    prompt is computed again (no prefix caching: the rings are not in the pages) to the same result."""
    llm = jaxdsa.LLM(
        FIXTURES / "dsv4",
        dtype="float32",
        page_size=PAGE,
        max_num_seqs=2,
        max_num_batched_tokens=6,
        progress=False,
    )
    greedy, long = golden["greedy_prompt"].tolist(), golden["prompt_long"].tolist()
    n = len(golden["greedy_tokens"])
    tokens, logits = llm.generate([greedy, long], max_new_tokens=n, return_logits=True)
    assert tokens[0] == golden["greedy_tokens"].tolist()
    assert rel_l2(logits[0], golden["greedy_logits"]).max() <= TOLERANCE
    assert rel_l2(logits[1][:1], golden["logits_long"][-1:]).max() <= TOLERANCE
    again, logits = llm.generate([greedy], max_new_tokens=n, return_logits=True)
    assert llm.engine.stats()["prefix_cache_hits"] == 0 and not llm.engine.config.enable_prefix_caching
    assert again[0] == tokens[0] and rel_l2(logits[0], golden["greedy_logits"]).max() <= TOLERANCE


def test_compact_layout_at_released_sizes():
    """V4-Flash / V4-Pro: one row per m tokens of the compressed entries and index keys, rings of W,
    2m and m rows per sequence (docs/models.md §5.6, counted here from the config independently), and
    the page size a multiple of every ratio."""
    from jaxdsa.models.deepseek_v4.config import v4_config_from_dict
    from jaxdsa.models.deepseek_v4.presets import RELEASED

    family = family_for("deepseek_v4")
    for raw in RELEASED.values():
        cfg = v4_config_from_dict(raw)
        spec, ratios = family.cache_spec(cfg), raw["compress_ratios"][: raw["num_hidden_layers"]]
        csa, hca = ratios.count(4), ratios.count(128)
        assert csa + hca + ratios.count(0) == len(ratios) and csa and hca
        d, di, W = raw["head_dim"], raw["index_head_dim"], raw["sliding_window"]
        assert spec.bytes_per_token(jnp.bfloat16, 128) == csa * (d + di) * 2 / 4 + hca * d * 2 / 128
        rings = len(ratios) * W * d * 2 + csa * 8 * 4 * (d + di) * 4 + hca * 128 * 2 * d * 4
        assert spec.sequence_bytes(jnp.bfloat16) == rings
        assert spec.sequence_bytes(jnp.bfloat16, lookahead=2) > rings
        assert family.page_size(cfg, None) == 128 and family.page_size(cfg, 256) == 256
        with pytest.raises(ValueError, match="--block-size.* 64 is not a multiple"):
            family.page_size(cfg, 64)
    flash = v4_config_from_dict(RELEASED["v4-flash"])
    assert family.cache_spec(flash).bytes_per_token(jnp.bfloat16, 128) < 7 * 1024  # was 388 KB


def test_engine_rings_hold_every_slot_and_the_draft_lookahead(llm):
    """The engine's cache: rings [layers, max_num_seqs, rows + drafts, width], pages one row per m."""
    engine = llm.new_engine(max_num_seqs=4, num_pages=32)
    cache, cfg = engine.runner.cache, llm.config
    assert cache["window"].shape == (cfg.num_hidden_layers, 4, cfg.sliding_window, cfg.head_dim)
    assert cache["hca_state"].shape[1:3] == (4, 8) and cache["csa_state"].shape[1:3] == (4, 8)
    assert cache["csa_entries"].shape[1:3] == (32, PAGE // 4) and cache["hca_entries"].shape[1:3] == (32, 1)
    spec = llm.new_engine(max_num_seqs=4, num_pages=32, speculative=SpeculativeConfig.parse(SPEC_2))
    assert spec.runner.cache["window"].shape[2] == cfg.sliding_window + 2
    assert spec.runner.mtp_cache["window"].shape[1:3] == (4, cfg.sliding_window + 2)
    with pytest.raises(ValueError, match="not a multiple of the compression ratios"):
        jaxdsa.LLM(FIXTURES / "dsv4", dtype="float32", page_size=12, progress=False)
