"""The shared expert held as one more routed expert (jaxdsa/shared_experts.py).

The golden parity tests run the default (joined where it can be); these check that it was joined
where it should be, what the joined stacks hold, that the separate path still matches HF, and where
it must stay apart.
"""

import numpy as np
import pytest
from flax import nnx

import jaxdsa
from jaxdsa.checkpoints.spec import ExpertDown, ExpertGateUp
from jaxdsa.layers.mlp import MLP, Experts
from pallas_kernels.quant.layout import QuantizedWeight
from tests.conftest import FIXTURES
from tests.models.test_hf_parity import TOLERANCE, rel_l2


def _moe_modules(llm) -> list:
    return [
        node for _, node in nnx.iter_graph(llm.model) if isinstance(getattr(node, "experts", None), Experts)
    ]


def _load(name: str, **kwargs):
    return jaxdsa.LLM(FIXTURES / name, dtype="float32", page_size=8, progress=False, **kwargs)


@pytest.mark.parametrize("name", ["glm5_int4", "dsv4"])
def test_joined_shared_expert_matches_hf_and_the_separate_one(name):
    """INT4 experts and shared expert (GLM-5) and DeepSeek-V4's clamped SwiGLU with hash routing:
    the stacks hold E + 1 experts, the separate MLP is gone, logits match HF and the model that
    keeps the shared expert apart."""
    golden = dict(np.load(FIXTURES / name / "golden.npz"))
    prompt = golden["prompt_long"].tolist()
    joined, apart = _load(name), _load(name, fuse_shared_experts=False)
    moes = [m for m in _moe_modules(joined) if m.experts.shared_slot is not None]
    assert moes  # the scanned layers' (an MTP layer stored in another format keeps its own)
    for moe in moes:
        assert moe.shared is None
        for weight in (moe.experts.gate_up.get_value(), moe.experts.down.get_value()):
            assert weight.shape[-3] == moe.experts.shared_slot + 1
            assert isinstance(weight, QuantizedWeight) == (name == "glm5_int4")
    assert all(m.experts.shared_slot is None and isinstance(m.shared, MLP) for m in _moe_modules(apart))
    got, separate = np.asarray(joined.score(prompt)), np.asarray(apart.score(prompt))
    assert rel_l2(got, golden["logits_long"]).max() <= TOLERANCE
    assert rel_l2(separate, golden["logits_long"]).max() <= TOLERANCE
    assert rel_l2(got, separate).max() <= 1e-5


def test_shared_expert_in_another_format_stays_apart():
    """DeepSeek-V4 FP8 keeps its experts FP4 and the shared expert FP8: joining would repack it."""
    llm = _load("dsv4_fp8")
    assert all(m.experts.shared_slot is None and isinstance(m.shared, MLP) for m in _moe_modules(llm))


def test_spec_names_the_shared_expert_last():
    names = ("m.shared_experts.gate_proj", "m.shared_experts.up_proj", "m.shared_experts.down_proj")
    gate_up = ExpertGateUp("m.experts", 4, 8, 16, shared=names)
    down = ExpertDown("m.experts", 4, 8, 16, ids=(1, 3), shared=names)
    assert gate_up.positions == 5 and down.positions == 3
    assert [gate_up.module("up", e) for e in (0, 3, 4)] == [
        "m.experts.0.up_proj",
        "m.experts.3.up_proj",
        "m.shared_experts.up_proj",
    ]
    assert [down.module("down", e) for e in range(3)] == [
        "m.experts.1.down_proj",
        "m.experts.3.down_proj",
        "m.shared_experts.down_proj",
    ]
    assert not gate_up.is_shared(3) and gate_up.is_shared(4)
