"""Routed experts split between the devices and host RAM on a mesh: the device experts split over
the expert shards as the whole stack would, the first device of the experts' partial sums runs the
host side (the others add zeros), and the sum joins the routed experts' own all-reduce."""

import numpy as np
import pytest

import jaxdsa
from tests.conftest import FIXTURES

pytestmark = pytest.mark.slow  # host experts on meshes; one device: tests/offload/test_hybrid_moe.py


def rel_l2(got, want):
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def load(name, **kwargs):
    return jaxdsa.LLM(FIXTURES / name, dtype="float32", page_size=8, progress=False, **kwargs)


@pytest.mark.parametrize(
    "name,mesh",
    [("glm52", {"tp": 2}), ("glm52", {"tp": 2, "ep": 2}), ("dsv4_fp8", {"ep": 2})],
    ids=["glm52-tp2", "glm52-tp2-ep2", "dsv4_fp8-ep2"],
)
def test_split_experts_on_a_mesh_match_one_device(name, mesh):
    prompt = np.load(FIXTURES / name / "golden.npz")["prompt_long"].tolist()
    want = load(name).score(prompt)
    assert rel_l2(load(name, num_gpu_experts=4, **mesh).score(prompt), want) <= 1e-5


def test_device_experts_must_split_over_the_expert_shards():
    with pytest.raises(ValueError, match="num_gpu_experts 3: the mesh splits routed experts over 2 devices"):
        load("glm52", tp=2, ep=2, num_gpu_experts=3)


@pytest.mark.parametrize("mesh", [{"tp": 2, "ep": 2}, {"dp": 2}], ids=["tp2-ep2", "dp2"])
def test_recorded_routing_counts_on_a_mesh_are_one_devices(tmp_path, mesh):
    """--record-expert-stats on a mesh: one device records each token once (the counts equal the
    single device's, not a multiple of them), with two sequences to spread over dp groups."""
    import json

    golden = np.load(FIXTURES / "glm5" / "golden.npz")
    prompts = [golden["prompt_long"].tolist(), golden["prompt_long"].tolist()[:9]]
    counts = []
    for i, kwargs in enumerate(({}, mesh)):
        out = tmp_path / f"stats{i}.json"
        llm = jaxdsa.LLM(
            FIXTURES / "glm5", dtype="float32", page_size=8, progress=False, record_expert_stats=out, **kwargs
        )
        llm.generate(prompts, max_new_tokens=3)
        counts.append(json.loads(llm.expert_stats.write().read_text())["layers"])
    assert counts[0] and counts[1] == counts[0]
