"""Prefill-decode handoff between engines of different parallelism: an image gathered from one
device and loaded into two dp-attention groups with tp = 2 inside each (and the other way round)
decodes the tokens one single-device engine gives (GLM-5, DeepSeek-V4, and GLM-5.3-Flash, whose KDA
states and conv rings are split over tp with the heads on the mesh side; single-device cases:
tests/engine/test_handoff.py)."""

from __future__ import annotations

import pytest

import jaxdsa
from jaxdsa.checkpoints.tiny.make import make_tiny
from jaxdsa.engine.handoff import ImageAtHand
from tests.engine.test_handoff import CONFIG, GREEDY, PAGE, alone, drain, prefill, prompts, tokens

pytestmark = pytest.mark.slow  # handoff between meshes; one device: tests/engine/test_handoff.py

MESH = dict(tp=2, ep=4, dp=2, dp_attention=True)


@pytest.mark.parametrize("family", ["glm_moe_dsa", "deepseek_v4", "glm5_next"])
def test_handoff_across_parallelism(tmp_path, family):
    path = make_tiny(family, str(tmp_path), seed=5)
    one = jaxdsa.LLM(path, dtype="float32", page_size=PAGE, progress=False)
    mesh = jaxdsa.LLM(path, dtype="float32", page_size=PAGE, progress=False, **MESH)
    batch = prompts(one.config.vocab_size)
    expected = alone(one, batch)
    for source, target in ((one, mesh), (mesh, one)):
        images = prefill(source, batch, warm=True)
        decode = target.new_engine(**CONFIG)
        decode.warm_handoff(export=False, load=True)  # the scatters compiled for the mesh ahead
        for rid, prompt in batch.items():
            decode.add_request(rid, prompt, GREEDY, source=ImageAtHand(images[rid]))
        got = drain(decode)
        assert {rid: tokens(outs) for rid, outs in got.items()} == expected
