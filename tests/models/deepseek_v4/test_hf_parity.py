"""DeepSeek-V4 parity with Hugging Face transformers 5.23 on the committed goldens (tests/fixtures/dsv4*).

Three checkpoints of the same architecture (HF-saved names in one file; release names over four
shards; release names with FP8 + FP4 weights) are loaded and run through the full-sequence forward
on the pure-JAX reference ops and on the Pallas kernels in interpret mode. Every prompt (and the
greedy buffer) is padded to one length, which changes no logit at the prompt's positions (every
V4 component is causal) and lets each backend compile the forward once.
"""

import numpy as np
import pytest

from checkpoints.v4_loader import load_v4
from jaxdsa import ops
from jaxdsa.models.deepseek_v4 import model
from tests.conftest import FIXTURES

FIXTURE_NAMES = ["dsv4", "dsv4_sharded", "dsv4_fp8"]
LENGTH = 64
TOLERANCE = 1e-4


def rel_l2(got, want):
    return np.linalg.norm(got - want, axis=-1) / np.linalg.norm(want, axis=-1)


def padded(ids):
    out = np.zeros(LENGTH, np.int32)
    out[: len(ids)] = ids
    return out


@pytest.fixture(scope="module")
def checkpoints():
    return {
        name: (*load_v4(FIXTURES / name), dict(np.load(FIXTURES / name / "golden.npz")))
        for name in FIXTURE_NAMES
    }


@pytest.fixture(scope="module", params=["reference", "interpret"])
def backend(request):
    previous = ops.get_kernels()
    ops.set_kernels(request.param)
    yield request.param
    ops.set_kernels(previous)


@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_prompt_logits_at_every_position(backend, checkpoints, name):
    cfg, params, golden = checkpoints[name]
    for prompt in ("short", "mid", "long"):  # shorter than the window, longer, many compression windows
        ids = golden[f"prompt_{prompt}"]
        logits = np.asarray(model.forward(params, padded(ids), cfg))[: len(ids)]
        assert rel_l2(logits, golden[f"logits_{prompt}"]).max() <= TOLERANCE, prompt


@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_greedy_continuation(backend, checkpoints, name):
    cfg, params, golden = checkpoints[name]
    tokens, logits = model.greedy(
        params, golden["greedy_prompt"], len(golden["greedy_tokens"]), cfg, length=LENGTH
    )
    assert tokens.tolist() == golden["greedy_tokens"].tolist()
    assert rel_l2(logits, golden["greedy_logits"]).max() <= TOLERANCE


@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_mtp_block(backend, checkpoints, name):
    """Against the torch oracle (HF's decoder layer and HC head wired as DeepSeek's MTPBlock)."""
    if backend == "interpret":
        pytest.skip("the MTP block runs the main layers' kernels, covered in interpret mode above")
    cfg, params, golden = checkpoints[name]
    ids = golden["prompt_long"]
    logits = np.asarray(model.mtp_logits(params, padded(ids), cfg))[: len(ids) - 1]
    assert rel_l2(logits, golden["mtp_logits"]).max() <= TOLERANCE
