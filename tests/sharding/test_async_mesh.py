"""Async scheduling on a mesh: with two dp-attention groups (each token taken from the slot
tokens of its own group) and tensor parallelism inside each, every request gets the tokens of
synchronous scheduling (single-device cases: tests/engine/test_async_scheduling.py)."""

from __future__ import annotations

import pytest

import jaxdsa
from jaxdsa.checkpoints.tiny.make import make_tiny
from tests.engine.test_async_scheduling import MAX_LEN, PAGE, requests, same, serve

pytestmark = pytest.mark.slow  # async scheduling on a mesh; one device: tests/engine

# tp = 2 inside each of 2 dp-attention groups that share 4 expert shards: 4 devices.
LAYOUT = dict(tp=2, ep=4, dp=2, dp_attention=True)


def test_async_output_on_a_mesh_is_the_synchronous_output(tmp_path):
    path = make_tiny("glm_moe_dsa", str(tmp_path), seed=7, preset="glm5")
    llm = jaxdsa.LLM(
        path,
        dtype="float32",
        page_size=PAGE,
        progress=False,
        max_num_seqs=4,
        max_model_len=MAX_LEN,
        max_num_batched_tokens=16,
        num_pages=16,
        **LAYOUT,
    )
    every = requests(llm.config.vocab_size, stop_at=1)
    batch = {rid: every[rid] for rid in ("greedy", "seeded", "penalized", "shared-a", "shared-b", "logprobs")}
    late = frozenset({"shared-b"})
    want = serve(llm.new_engine(async_scheduling=False), batch, late=late)
    engine = llm.new_engine(async_scheduling=True)
    got = serve(engine, batch, late=late)
    same(got, want, batch)
    assert engine.stats()["prefix_cache_hits"] > 0
