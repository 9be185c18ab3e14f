import pytest

import jaxdsa
from jaxdsa import ops
from jaxdsa.checkpoints.tiny.make import make_tiny

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
