"""MTP speculative decoding on a mesh: the drafting step under TP, EP and dp attention gives the
greedy output of the same mesh without drafts (the rollback path, prefix hits and preemptions
included; see tests/models/test_speculative.py for the single-device cases)."""

from __future__ import annotations

import pytest

import jaxdsa
from jaxdsa.checkpoints.tiny.make import make_tiny
from tests.models.test_speculative import MAX_LEN, PAGE, _requests, _same_output, _serve

pytestmark = pytest.mark.slow  # MTP on a mesh; one device: tests/models/test_speculative.py (slow too)

# tp = 2 inside each of 2 dp-attention groups that share 4 expert shards: 4 devices.
LAYOUT = dict(tp=2, ep=4, dp=2, dp_attention=True)


def _llm(path, num_spec: int | None) -> jaxdsa.LLM:
    config = {"method": "mtp", "num_speculative_tokens": num_spec} if num_spec else None
    return jaxdsa.LLM(
        path,
        dtype="float32",
        page_size=PAGE,
        progress=False,
        speculative_config=config,
        max_num_seqs=4,
        max_model_len=MAX_LEN,
        max_num_batched_tokens=16,
        num_pages=16,
        **LAYOUT,
    )


def test_greedy_output_on_a_mesh_is_the_main_models(tmp_path):
    path = make_tiny("glm_moe_dsa", str(tmp_path), seed=7, preset="glm5")
    base, spec = _llm(path, None), _llm(path, 2)
    every = _requests(base.config.vocab_size)  # a few of them: each step shape compiles on the mesh
    requests = {rid: every[rid] for rid in ("shared-a", "penalized", "shared-b", "to-max-len")}
    want, got = _serve(base, requests), _serve(spec, requests)
    _same_output(got, want)
    stats = spec.engine.stats()
    assert stats["spec_decode_num_draft_tokens"] > 20 and stats["prefix_cache_hits"] > 0
