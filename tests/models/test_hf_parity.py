"""Parity with Hugging Face transformers 5.23 on the committed tiny golden fixtures.

The fixtures (tests/fixtures/*/, made by tests/reference/make_goldens.py with PyTorch) hold
HF-layout checkpoints and HF's float32 logits. Where HF and DeepSeek's official code differ
(latent-norm eps 1e-6, no FP8/Hadamard simulation in the indexer; docs/models.md §7, §8) we match HF.
Each fixture runs on the pure-JAX reference ops and on the Pallas kernels in interpret mode (the
quantized ones, with their weights kept quantized, in interpret mode once per format: the kernels'
own tests cover every layout against their references), the quantized ones with their weights
kept quantized.
"""

import numpy as np
import pytest
from flax import nnx

import jaxdsa
from jaxdsa import ops
from pallas_kernels.quant.layout import QuantizedWeight
from tests.conftest import FIXTURES
from tests.models.conftest import rel_l2

# Left out of the default run (tests/conftest.py; pytest -m slow runs them): the fixtures through the
# interpreted kernels but GLM-5's INT4 one and V3.2 (which take every kernel the others do: INT4 experts
# and linears, sparse MLA, the indexer); every fixture goes through the ops in the default run.
SLOW_CASES = (
    "test_greedy_decode_through_the_cache[glm5_nvfp4-interpret]",
    "test_greedy_decode_through_the_cache[dsv32_fp8-interpret]",
    "test_greedy_decode_through_the_cache[dsv32_yarn-interpret]",
    "test_greedy_decode_through_the_cache[glm52-interpret]",
    "test_prefill_logits[glm5_nvfp4-interpret-*]",
    "test_prefill_logits[dsv32_fp8-interpret-*]",
    "test_prefill_logits[dsv32_yarn-interpret-*]",
    "test_prefill_logits[glm52-interpret-*]",
    "test_greedy_decode_through_the_cache[glm5-interpret]",
    "test_prefill_logits[glm5-interpret-*]",
)

FIXTURE_NAMES = ["glm5", "dsv32", "glm52", "dsv32_yarn"]
# Quantized checkpoints (FP8 power-of-two scales in 32x32 blocks; FP8 float32 scales in 128x128
# blocks; INT4 packed by the compressed-tensors library, asymmetric group 32 with an ignore list and
# symmetric group 128 by targets; ModelOpt NVFP4 with exclusion wildcards and a global scale per
# matrix), loaded with their weights kept quantized (the default): every quantized linear runs
# quant_matmul and the experts the quantized MoE kernels, dequantizing to float32 in the kernel
# (exact), against goldens computed on the dequantized weights.
QUANTIZED_NAMES = ["glm5_fp8", "dsv32_fp8", "glm5_int4", "dsv32_int4", "glm5_nvfp4"]
# one FP8, one INT4 and the NVFP4 fixture (the slowest to interpret)
INTERPRETED = FIXTURE_NAMES + ["dsv32_fp8", "glm5_int4", "glm5_nvfp4"]
TOLERANCE = 1e-4


@pytest.fixture(
    scope="module",
    params=[(name, "reference") for name in FIXTURE_NAMES + QUANTIZED_NAMES]
    + [(name, "interpret") for name in INTERPRETED],
    ids=lambda p: f"{p[0]}-{p[1]}",
)
def case(request):
    name, backend = request.param
    previous = ops.get_kernels()
    ops.set_kernels(backend)
    llm = jaxdsa.LLM(FIXTURES / name, dtype="float32", page_size=8, progress=False)
    kept = [
        v
        for _, v in nnx.to_flat_state(nnx.state(llm.model, nnx.Param))
        if isinstance(v.get_value(), QuantizedWeight)
    ]
    assert bool(kept) == (name in QUANTIZED_NAMES)
    yield llm, dict(np.load(FIXTURES / name / "golden.npz"))
    ops.set_kernels(previous)


@pytest.mark.parametrize("prompt", ["short", "long"])
def test_prefill_logits(case, prompt):
    llm, golden = case
    ids = golden[f"prompt_{prompt}"].tolist()
    if prompt == "short":
        assert len(ids) <= llm.config.index_topk  # dense path
    else:
        assert len(ids) > llm.config.index_topk  # sparse path
    assert rel_l2(llm.score(ids), golden[f"logits_{prompt}"]).max() <= TOLERANCE


def test_greedy_decode_through_the_cache(case):
    llm, golden = case
    n = len(golden["greedy_tokens"])
    tokens, logits = llm.generate([golden["greedy_prompt"].tolist()], max_new_tokens=n, return_logits=True)
    assert tokens[0] == golden["greedy_tokens"].tolist()
    assert rel_l2(logits[0], golden["greedy_logits"]).max() <= TOLERANCE
