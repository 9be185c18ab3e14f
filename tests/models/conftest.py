"""Shared pieces of the model tests: tiny LLMs, the interpreter switch, golden-fixture LLMs, rel-L2."""

import numpy as np
import pytest

import jaxdsa
from jaxdsa import ops
from jaxdsa.checkpoints.tiny.make import make_tiny
from tests.conftest import FIXTURES

FAMILIES = {
    "glm5": ("glm_moe_dsa", "glm5"),
    "dsv32": ("deepseek_v32", "dsv32"),
    "glm52": ("glm_moe_dsa", "glm52"),
}


@pytest.fixture(scope="session")
def tiny_llms(tmp_path_factory):
    """Float32 LLMs over random tiny checkpoints written by jaxdsa.checkpoints.make_tiny (one per preset)."""
    llms = {}
    for name, (family, preset) in FAMILIES.items():
        path = make_tiny(family, str(tmp_path_factory.mktemp(name)), seed=7, preset=preset)
        llms[name] = jaxdsa.LLM(path, dtype="float32", page_size=8, progress=False)
    return llms


@pytest.fixture
def interpret():
    """The Pallas kernels in the interpreter for one test, the previous backend restored after."""
    previous = ops.get_kernels()
    ops.set_kernels("interpret")
    yield
    ops.set_kernels(previous)


def rel_l2(got, want):
    """Relative L2 error of each row (last axis) of ``got`` against ``want``."""
    return np.linalg.norm(got - want, axis=-1) / np.linalg.norm(want, axis=-1)


def golden_case(param: str):
    """For a module fixture to yield from: a float32 LLM over a golden fixture and its ``golden.npz``.
    ``param``: the fixture's name, with ``-interpret`` (or another kernel backend) appended to run on
    those kernels instead of the reference ops (the previous backend restored after)."""
    name, _, backend = param.partition("-")
    previous = ops.get_kernels()
    ops.set_kernels(backend or "reference")
    llm = jaxdsa.LLM(FIXTURES / name, dtype="float32", page_size=8, max_num_seqs=2, progress=False)
    yield llm, dict(np.load(FIXTURES / name / "golden.npz"))
    ops.set_kernels(previous)


def check_prompt_logits(llm: jaxdsa.LLM, golden: dict, tolerance: float) -> None:
    """The logits at every position of the golden's short, mid and long prompts, each scored in one
    step, within ``tolerance`` (rel-L2) of the golden's."""
    for prompt in ("short", "mid", "long"):
        ids = golden[f"prompt_{prompt}"].tolist()
        assert rel_l2(llm.score(ids), golden[f"logits_{prompt}"]).max() <= tolerance, prompt
