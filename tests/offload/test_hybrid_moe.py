"""Routed experts split between the device and host RAM compute what the all-device model does.

The CPU backend plays both sides: the device stacks hold the placement's experts, the host stacks
(on JAX's CPU device, read from the same files by the same walker) the others, and the host side
runs through the step's callbacks. Every family and expert format of the fixtures, compared with
the same checkpoint loaded whole: identical greedy tokens, float32 logits within 1e-5 rel-L2.
"""

import json

import numpy as np
import pytest
from flax import nnx

import jaxdsa
from jaxdsa.layers.mlp import Experts
from jaxdsa.quantized_weight import QuantizedWeight
from tests.conftest import FIXTURES

# Left out of the default run (tests/conftest.py; pytest -m slow runs them): the other fixtures: the default
# run splits the INT4 GLM-5 fixture's experts (the host kernel meets every format's reference in
# test_cpu_moe).
SLOW_CASES = (
    "test_split_experts_match_the_whole_model[glm5_nvfp4]",
    "test_split_experts_match_the_whole_model[dsv32_fp8]",
    "test_split_experts_match_the_whole_model[glm52]",
    "test_split_experts_match_the_whole_model[dsv4_fp8]",
)

TOLERANCE = 1e-5

# (fixture, experts kept on the device, what the case covers)
CASES = [
    ("glm5_int4", 3, "INT4 experts (asymmetric group 32), dense layers beside MoE ones"),
    ("dsv32_fp8", 0, "FP8 experts, every routed expert on the host"),
    ("glm52", 5, "dense float32 experts, the shared-indexer layer groups and the next-n layer"),
    ("dsv4_fp8", 2, "DeepSeek-V4: FP4 experts, hash-routed layers, the next-n layer"),
    ("glm5_nvfp4", 2, "NVFP4 experts (gate and up under their own global scales), 64-row chunks"),
]


def rel_l2(got, want):
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def experts_of(llm):
    return [node for _, node in nnx.iter_graph(llm.model) if isinstance(node, Experts)]


def load(name, **kwargs):
    return jaxdsa.LLM(FIXTURES / name, dtype="float32", page_size=8, progress=False, **kwargs)


@pytest.mark.parametrize("name,gpu,what", CASES, ids=[c[0] for c in CASES])
def test_split_experts_match_the_whole_model(name, gpu, what):
    golden = np.load(FIXTURES / name / "golden.npz")
    whole, split = load(name), load(name, num_gpu_experts=gpu)
    total = whole.config.n_routed_experts
    for node in experts_of(split):
        assert node.host is not None and node.host.gpu == gpu and node.host.num == total - gpu
        assert node.down.get_value().shape[-3] == gpu  # the device stack holds only its experts
        quantized = isinstance(node.down.get_value(), QuantizedWeight)
        assert isinstance(node.host.experts["down"], QuantizedWeight) == quantized  # held as stored

    prompt = golden["prompt_long"].tolist()
    assert rel_l2(split.score(prompt), whole.score(prompt)) <= TOLERANCE
    n = 6
    want, want_logits = whole.generate([prompt], max_new_tokens=n, return_logits=True)
    got, got_logits = split.generate([prompt], max_new_tokens=n, return_logits=True)
    assert got == want
    assert rel_l2(got_logits[0], want_logits[0]) <= TOLERANCE


def test_frequency_policy_unrolled_layers(tmp_path):
    """Per-layer GPU experts from routing counts (each layer its own), layers not scanned; the
    next-n layer, absent from the stats, takes the uniform placement (experts 0, 2, 5 of 8)."""
    name = "glm5"
    whole = load(name, scan_layers=False)
    prefixes = [f"model.layers.{i}.mlp.experts" for i in (2, 3)]
    counts = {prefixes[0]: [5, 0, 0, 9, 1, 1, 7, 0], prefixes[1]: [0, 3, 3, 0, 0, 8, 0, 2]}
    stats = tmp_path / "stats.json"
    stats.write_text(json.dumps({"layers": counts}))
    split = load(
        name, scan_layers=False, num_gpu_experts=3, gpu_experts_policy="frequency", expert_stats=stats
    )
    tables = [np.asarray(node.slots.get_value()) for node in experts_of(split)]
    assert [sorted(np.flatnonzero(t < 3)) for t in tables] == [[0, 3, 6], [1, 2, 5], [0, 2, 5]]
    prompt = np.load(FIXTURES / name / "golden.npz")["prompt_long"].tolist()
    assert rel_l2(split.score(prompt), whole.score(prompt)) <= TOLERANCE
