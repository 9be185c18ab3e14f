"""Disaggregated serving between a single-device prefill server and a decode server with two
dp-attention groups of tp 2 (4 of the 8 CPU devices): the streamed text of one server
(tests/serve/test_disagg.py has the single-device cases)."""

from __future__ import annotations

from tests.serve.conftest import glm_dir  # noqa: F401  (the session fixture)
from tests.serve.test_disagg import streamed_handover


def test_decode_server_of_other_parallelism(glm_dir):  # noqa: F811
    streamed_handover(glm_dir, ["-tp", "2", "-dp", "2", "--enable-dp-attention", "--enable-expert-parallel"])
