"""GLM-5.3-Flash on meshes of 8 fake CPU devices reproduces the HF goldens (tests/fixtures/glm53).

MLA and index heads, the experts, the shared expert, the dense MLP and the vocabulary split as for
GLM-5; the KDA layers and the hyper-connections run whole on every device (``linear_heads`` is not
split yet), and under dp attention each dp group keeps its own sequences' states and rings.
"""

import numpy as np
import pytest

import jaxdsa
from tests.conftest import FIXTURES
from tests.sharding.test_parallel_parity import (
    assert_cache_pages_split_over_dp,
    assert_long_prompt_and_greedy_match,
)

# (tp, ep, dp, dp_attention)
LAYOUTS = [(2, 1, 1, False), (2, 4, 1, False), (2, 4, 2, True)]


@pytest.fixture(
    scope="module",
    params=LAYOUTS,
    ids=lambda p: f"tp{p[0]}ep{p[1]}dp{p[2]}" + ("-dpattn" if p[3] else ""),
)
def case(request):
    tp, ep, dp, dp_attention = request.param
    llm = jaxdsa.LLM(
        FIXTURES / "glm53",
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
    return llm, request.param, dict(np.load(FIXTURES / "glm53" / "golden.npz"))


def test_logits_and_greedy_tokens_match_hf(case):
    """The long prompt (two KDA chunk boundaries, many pools) in one step, then prefill + 16 decode steps."""
    llm, layout, golden = case
    assert_long_prompt_and_greedy_match(llm, golden)
    assert_cache_pages_split_over_dp(llm, layout[2])
