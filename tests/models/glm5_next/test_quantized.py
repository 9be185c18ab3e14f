"""GLM-5.3-Flash with INT4 weights through the Pallas kernels (interpret mode) against the reference
ops: its NoPE MLA takes the fused latent and absorbed-query kernels with no RoPE part, which the
other families' goldens never reach (their MLA always has one). Random weights (``load_format
dummy``), the same in both runs; a prompt past the dense range (sparse steps) and decode steps."""

from __future__ import annotations

import numpy as np
import pytest

import jaxdsa
from jaxdsa import ops
from tests.conftest import FIXTURES
from tests.models.conftest import rel_l2

pytestmark = pytest.mark.slow  # INT4 GLM-5.3 through the kernels; NoPE kernels: tests/kernels

KW = dict(dtype="float32", page_size=16, max_num_seqs=2, progress=False, max_model_len=256)


def test_int4_through_the_kernels_equals_the_reference_ops():
    previous = ops.get_kernels()
    prompts = [[5 + (7 * i) % 400 for i in range(70)], [3, 4, 5]]
    runs = []
    try:
        for backend in ("reference", "interpret"):
            ops.set_kernels(backend)
            llm = jaxdsa.LLM(FIXTURES / "glm53", load_format="dummy", quantization="int4", **KW)
            runs.append((llm.score(prompts[0]), *llm.generate(prompts, max_new_tokens=4, return_logits=True)))
    finally:
        ops.set_kernels(previous)
    (want_scores, want_tokens, want_logits), (scores, tokens, logits) = runs
    assert rel_l2(scores, want_scores).max() <= 1e-4
    assert tokens == want_tokens
    for got, want in zip(logits, want_logits):
        assert rel_l2(np.asarray(got), np.asarray(want)).max() <= 1e-4
