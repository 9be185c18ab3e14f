"""GLM-5.3-Flash parity with Hugging Face transformers 5.23 on the committed goldens (tests/fixtures/glm53*),
through the seam: ``jaxdsa.LLM(...).score`` (one step over the whole prompt: the expanded MLA form)
and ``.generate`` (the engine: prefill, then decode through the cache: the absorbed form, the KDA
states and rings, the pooled index keys).

Two checkpoints of one architecture (HF-saved names in one file; the release's config spellings over
four shards) on the pure-JAX reference ops, and the first on the Pallas kernels in interpret mode. The
prompts cover the dense range (8 tokens), the sparse one within one KDA chunk (~45) and many key pools
across two KDA chunk boundaries (~157); tests/fixtures/README_glm53.md says what each holds.
"""

import pytest

import jaxdsa
from tests.models.conftest import check_prompt_logits, golden_case, rel_l2

# Left out of the default run (tests/conftest.py; pytest -m slow runs them): GLM-5.3-Flash through the
# interpreted kernels (the KDA and MLA kernels meet their references in tests/kernels) and the 20-token
# chunks: the default run checks every position through the ops and the continuation in 512-token chunks.
SLOW_CASES = (
    "test_prompt_logits_at_every_position[glm53-interpret]",
    "test_greedy_continuation_through_the_cache[glm53-20]",
    "test_greedy_continuation_through_the_cache[glm53_sharded-20]",
)

FIXTURE_NAMES = ["glm53", "glm53_sharded"]
TOLERANCE = 1e-4


@pytest.fixture(scope="module", params=FIXTURE_NAMES)
def case(request):
    yield from golden_case(request.param)


@pytest.fixture(scope="module", params=FIXTURE_NAMES + ["glm53-interpret"])
def scored(request):
    yield from golden_case(request.param)


def test_prompt_logits_at_every_position(scored):
    check_prompt_logits(*scored, TOLERANCE)


@pytest.mark.parametrize("budget", [512, 20])
def test_greedy_continuation_through_the_cache(case, budget):
    """Prefill whole, or in chunks of 20 tokens (ending inside key pools) with a second copy of the
    request in the same steps; then 16 decode steps."""
    llm, golden = case
    if budget != 512:
        options = dict(page_size=8, max_num_seqs=2, max_num_batched_tokens=budget, progress=False)
        llm = jaxdsa.LLM(llm.path, dtype="float32", **options)
    n, prompt = len(golden["greedy_tokens"]), golden["greedy_prompt"].tolist()
    tokens, logits = llm.generate([prompt, prompt], max_new_tokens=n, return_logits=True)
    for got, got_logits in zip(tokens, logits):
        assert got == golden["greedy_tokens"].tolist()
        assert rel_l2(got_logits, golden["greedy_logits"]).max() <= TOLERANCE
