"""--record-expert-stats: the MoE layers' routing counts, recorded inside the step, feed the
frequency placement of a later load."""

import json

import numpy as np

import jaxdsa
from jaxdsa.layers.mlp import Experts
from tests.conftest import FIXTURES


def test_recorded_counts_cover_every_real_token_and_feed_the_frequency_policy(tmp_path):
    """Each MoE layer counts top-k experts for every token the engine ran (prompt and fed-back
    tokens; not the padding of the step's token buckets); the file is what ``--expert-stats``
    reads: a load with ``frequency`` keeps each layer's most-counted experts on the device."""
    name, out = "glm5", tmp_path / "stats.json"
    llm = jaxdsa.LLM(FIXTURES / name, dtype="float32", page_size=8, progress=False, record_expert_stats=out)
    prompt = np.load(FIXTURES / name / "golden.npz")["prompt_long"].tolist()
    new = 5
    llm.generate([prompt], max_new_tokens=new)
    llm.expert_stats.write()
    layers = json.loads(out.read_text())["layers"]
    cfg = llm.config
    moe = [f"model.layers.{i}.mlp.experts" for i in range(cfg.first_k_dense_replace, cfg.num_hidden_layers)]
    assert sorted(layers) == moe  # the next-n layer did not run: no entry
    tokens = len(prompt) + new - 1
    for counts in layers.values():
        assert len(counts) == cfg.n_routed_experts and min(counts) >= 0
        assert sum(counts) == tokens * cfg.num_experts_per_tok

    gpu = 3
    split = jaxdsa.LLM(
        FIXTURES / name,
        dtype="float32",
        page_size=8,
        progress=False,
        num_gpu_experts=gpu,
        gpu_experts_policy="frequency",
        expert_stats=out,
        scan_layers=False,
    )
    tables = [np.asarray(node.slots.get_value()) for _, node in _experts(split)[: len(moe)]]
    for table, counts in zip(tables, layers.values()):
        kept = set(np.flatnonzero(table < gpu))
        least_kept = min(counts[e] for e in kept)
        assert all(counts[e] <= least_kept for e in set(range(len(counts))) - kept)


def _experts(llm):
    from flax import nnx

    return [(path, node) for path, node in nnx.iter_graph(llm.model) if isinstance(node, Experts)]
