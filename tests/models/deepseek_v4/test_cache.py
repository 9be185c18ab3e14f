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
from jaxdsa.engine.runner import ModelState
from tests.conftest import FIXTURES

PAGE, STEP_TOKENS, TOLERANCE = 8, 8, 1e-4


def rel_l2(got, want):
    return np.linalg.norm(got - want, axis=-1) / np.linalg.norm(want, axis=-1)


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
    cache = init_cache(family.cache_spec(llm.config), 16, PAGE, jnp.float32)
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


def test_engine_chunks_decodes_and_prefix_pages(golden):
    """Through the engine: a 6-token budget splits prompts inside windows and mixes prefill chunks
    with decodes of another request; a repeated prompt then reuses the first one's cached pages."""
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
    hits = llm.engine.stats()["prefix_cache_hits"]
    again, logits = llm.generate([greedy], max_new_tokens=n, return_logits=True)
    assert llm.engine.stats()["prefix_cache_hits"] > hits
    assert again[0] == tokens[0] and rel_l2(logits[0], golden["greedy_logits"]).max() <= TOLERANCE
