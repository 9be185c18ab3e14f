"""GLM-5.3-Flash through the engine on a random tiny checkpoint (``make_tiny --family glm5_next``):
the cache's per-sequence state must make a chunked prefill and the decode steps after it equal one
forward over the whole sequence.

Budgets of 30 and 26 tokens end prefill chunks inside a key pool (m = 4), inside a KDA chunk (64) and
past the indexer's dense range (12 tokens), with several sequences in one step; a second round on the
same engine reuses the sequences' cache rows, whose states must start again from zeros. HF parity is
tests/models/glm5_next/test_hf_parity.py.
"""

import numpy as np
import pytest

import jaxdsa
from jaxdsa.checkpoints.tiny.make import make_tiny
from tests.models.conftest import rel_l2

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
