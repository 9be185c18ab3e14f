"""DeepSeek-V4 parity with Hugging Face transformers 5.23 on the committed goldens (tests/fixtures/dsv4*),
through the seam: ``jaxdsa.LLM(...).score`` (one step over the whole prompt) and ``.generate`` (the
engine: prefill, then decode through the paged cache).

Three checkpoints of one architecture (HF-saved names in one file; release names over four shards;
release names with FP8 linears and FP4 routed experts, kept so on the device) on the pure-JAX
reference ops, and the first and the last on the Pallas kernels in interpret mode. The model keeps
only the architecture in its graph, so the two dense ones share their compiled steps.
"""

import pytest

from tests.models.conftest import check_prompt_logits, golden_case, rel_l2

# Left out of the default run (tests/conftest.py; pytest -m slow runs them): the FP8-weight fixture through
# the interpreted kernels: the default run checks it through the ops and the bf16 fixture through the
# kernels.
SLOW_CASES = (
    "test_prompt_logits_at_every_position[dsv4_fp8-interpret]",
    "test_greedy_continuation_through_the_cache[dsv4_fp8]",
)

FIXTURE_NAMES = ["dsv4", "dsv4_sharded", "dsv4_fp8"]
TOLERANCE = 1e-4


@pytest.fixture(scope="module", params=FIXTURE_NAMES)
def case(request):
    yield from golden_case(request.param)


@pytest.fixture(scope="module", params=FIXTURE_NAMES + ["dsv4-interpret", "dsv4_fp8-interpret"])
def scored(request):
    """The prompt-logit cases: the reference ops on every fixture, and the Pallas kernels in
    interpret mode on ``dsv4`` and ``dsv4_fp8`` (``quant_matmul`` and the FP4 MoE kernel; one
    forward: the engine's step shapes are what make the interpreter slow, and the kernels' own
    tests cover the decode shapes)."""
    yield from golden_case(request.param)


def test_prompt_logits_at_every_position(scored):
    """Shorter than the window (one CSA entry, no HCA entry), longer, many compression windows."""
    check_prompt_logits(*scored, TOLERANCE)


def test_greedy_continuation_through_the_cache(case):
    llm, golden = case
    n = len(golden["greedy_tokens"])
    tokens, logits = llm.generate([golden["greedy_prompt"].tolist()], max_new_tokens=n, return_logits=True)
    assert tokens[0] == golden["greedy_tokens"].tolist()
    assert rel_l2(logits[0], golden["greedy_logits"]).max() <= TOLERANCE
