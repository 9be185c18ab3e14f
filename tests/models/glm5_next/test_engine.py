"""GLM-5.3-Flash through the engine on a random tiny checkpoint (``make_tiny --family glm5_next``):
the cache's per-sequence state must make a chunked prefill and the decode steps after it equal one
forward over the whole sequence.

Budgets of 30 and 26 tokens end prefill chunks inside a key pool (m = 4), inside a KDA chunk (64) and
past the indexer's dense range (12 tokens), with several sequences in one step; a second round on the
same engine reuses the sequences' cache rows, whose states must start again from zeros. A cache too
small for the three sequences preempts one, which recomputes from a zero state. HF parity is
tests/models/glm5_next/test_hf_parity.py.
"""

import numpy as np
import pytest

import jaxdsa
from jaxdsa.checkpoints.tiny.make import make_tiny
from jaxdsa.engine import Engine, EngineConfig, SamplingParams
from tests.models.conftest import rel_l2

# Left out of the default run (tests/conftest.py; pytest -m slow runs them): the 30-token budget: the
# default run chunks at 26.
SLOW_CASES = ("test_chunked_prefill_and_decode_equal_one_forward[30]",)

TOLERANCE = 1e-4
PROMPT_LENGTHS = (150, 9, 67)
NEW = 8


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_tiny("glm5_next", str(tmp_path_factory.mktemp("glm53")), seed=5)


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.RandomState(3)
    return [rng.randint(2, 490, size=n).tolist() for n in PROMPT_LENGTHS]


@pytest.mark.parametrize("budget", [30, 26])
def test_chunked_prefill_and_decode_equal_one_forward(checkpoint, prompts, budget):
    options = dict(page_size=8, max_num_seqs=4, max_num_batched_tokens=budget, progress=False)
    llm = jaxdsa.LLM(checkpoint, dtype="float32", **options)
    for _ in range(2):  # the second round reuses cache rows that hold the first round's states
        tokens, logits = llm.generate(prompts, max_new_tokens=NEW, return_logits=True)
        for prompt, new, got in zip(prompts, tokens, logits):
            assert len(new) == NEW
            whole = llm.score(prompt + new[:-1])  # one single-sequence step: the naive MLA form
            assert rel_l2(got, whole[len(prompt) - 1 :]).max() <= TOLERANCE
            assert np.argmax(whole[len(prompt) - 1 :], axis=-1).tolist() == new


def test_preempted_sequence_recomputes_its_state(checkpoint, prompts):
    """23 pages of 8 tokens hold 184 of the 250 tokens the three requests grow to: the newest running
    one is preempted, its pages freed, and recomputed later from its tokens with fresh KDA / ring
    state rows; every request's greedy tokens and logits still equal one forward."""
    llm = jaxdsa.LLM(checkpoint, dtype="float32", page_size=8, progress=False)
    config = EngineConfig(
        max_num_seqs=3, max_model_len=176, page_size=8, num_pages=23, max_num_batched_tokens=32
    )
    engine = Engine(llm.family, llm.config, llm.model, dtype=llm.dtype, config=config)
    outputs = {f"r{i}": [] for i in range(len(prompts))}
    for i, prompt in enumerate(prompts):
        engine.add_request(
            f"r{i}", prompt, SamplingParams(max_tokens=NEW, ignore_eos=True), return_logits=True
        )
    requests = dict(engine.requests)
    while engine.has_unfinished():
        for out in engine.step():
            outputs[out.request_id].append(out)
    assert sum(r.num_preemptions for r in requests.values()) > 0
    for i, prompt in enumerate(prompts):
        new = [t for o in outputs[f"r{i}"] for t in o.new_token_ids]
        whole = llm.score(prompt + new[:-1])[len(prompt) - 1 :]
        assert np.argmax(whole, axis=-1).tolist() == new
        assert rel_l2(np.stack([o.logits for o in outputs[f"r{i}"]]), whole).max() <= TOLERANCE
