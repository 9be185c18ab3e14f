"""``gpu_memory_utilization``: JAX's allocator is set from it before the backend starts, the cache
gets what the budget leaves (exactly the pages it says), a model that does not fit is refused
before any weight is read with the numbers, and the planner counts the same budget. The CPU
reports no device memory, so the budget is given here as a device would report it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import jaxdsa
from jaxdsa.checkpoints import walker
from jaxdsa.engine import memory
from jaxdsa.engine.engine import CacheLayout
from tests.conftest import FIXTURES

GLM5 = str(FIXTURES / "glm5")
MiB = 1 << 20


def fake(monkeypatch, total: float, utilization: float, in_use: float = 0.0) -> None:
    """Devices of ``total`` bytes whose allocator manages ``utilization`` of them."""
    monkeypatch.setattr(
        memory,
        "device_memory",
        lambda u: memory.DeviceMemory(total=total, budget=min(u, utilization) * total, in_use=in_use),
    )


def test_claim_sets_the_allocator_share_before_the_backend_starts():
    code = (
        "import os; from jaxdsa.engine import memory; memory.claim(0.6); "
        "print(os.environ['XLA_PYTHON_CLIENT_MEM_FRACTION'])"
    )
    env = dict(os.environ, XLA_PYTHON_CLIENT_MEM_FRACTION="0.94")  # replaced by the flag, as vLLM's
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "0.6" and "replaced by gpu_memory_utilization" in out.stderr
    for bad in (0, 1.5, -0.1, "0.9"):
        with pytest.raises(ValueError, match="gpu_memory_utilization must be in"):
            memory.check_utilization(bad)


def test_workspace_is_a_tenth_of_the_budget_up_to_4_gib():
    assert memory.workspace_bytes(10 * memory.GiB) == memory.GiB
    assert memory.workspace_bytes(126 * memory.GiB) == 4 * memory.GiB


def test_the_cache_gets_what_the_budget_leaves(monkeypatch):
    llm = jaxdsa.LLM(GLM5, dtype="float32", page_size=8, progress=False, max_num_seqs=4, max_model_len=64)
    layout = CacheLayout.of(llm.family, llm.config, llm.engine_config, llm.dtype, mesh=None)
    total, utilization = 64 * MiB, 0.5
    budget = utilization * total
    # weights and whatever else is placed: what leaves room for 10.5 pages beside the engine's state
    in_use = budget - memory.workspace_bytes(budget) - layout.state_bytes - 10.5 * layout.page_bytes
    fake(monkeypatch, total, 0.9, in_use)
    engine = llm.new_engine(gpu_memory_utilization=utilization)
    assert engine.scheduler.pages_total == 10
    roomy = llm.new_engine(gpu_memory_utilization=0.9)  # capped at enough pages for every slot
    assert roomy.scheduler.pages_total == 4 * layout.pages_per_sequence == 32
    with pytest.raises(ValueError, match="one full-length sequence needs 8"):
        llm.new_engine(gpu_memory_utilization=utilization - 3 * layout.page_bytes / total)


def test_a_model_that_does_not_fit_is_refused_before_loading(monkeypatch):
    fake(monkeypatch, 2 * MiB, 0.9)

    def never(*args, **kwargs):
        raise AssertionError("weights were read")

    monkeypatch.setattr(walker, "load", never)
    monkeypatch.setattr(walker, "random", never)
    with pytest.raises(ValueError) as e:
        jaxdsa.LLM(GLM5, dtype="float32", page_size=8, progress=False, max_model_len=64)
    message = str(e.value)
    for part in (
        "does not fit",
        "weights",
        "GiB",
        "full-length sequence",
        "budget",
        "gpu-memory-utilization",
    ):
        assert part in message, message


def test_cache_pages_refuses_a_budget_below_one_sequence():
    tight = memory.DeviceMemory(total=10 * MiB, budget=9 * MiB, in_use=8 * MiB)
    with pytest.raises(ValueError, match="one full-length sequence needs 8"):
        memory.cache_pages(tight, page_bytes=MiB, state_bytes=0, per_sequence_pages=8, groups=1, enough=64)
    assert (
        memory.cache_pages(None, page_bytes=MiB, state_bytes=0, per_sequence_pages=8, groups=1, enough=64)
        == 64
    )


def test_the_planner_counts_the_same_budget(tmp_path, capsys):
    from benchmarks.serve_gpu import GLM52
    from jaxdsa import plan

    (tmp_path / "config.json").write_text(json.dumps({**GLM52, "num_hidden_layers": 78}))

    def run(*flags: str) -> dict[str, float]:
        args = ["--config", str(tmp_path), "--weights", "int4", "--hbm-gib", "140", "--tp", "4", *flags]
        assert plan.main(args) == 0
        rows = [line.split() for line in capsys.readouterr().out.splitlines()[1:]]
        return {r[0]: float(r[-1].replace(",", "")) for r in rows if len(r) == 2}

    default, half = run(), run("--gpu-memory-utilization", "0.8")
    assert default["budget_gib_per_device"] == pytest.approx(0.9 * 140)
    assert default["workspace_gib_per_device"] == pytest.approx(4.0)
    freed = (default["budget_gib_per_device"] - half["budget_gib_per_device"]) * memory.GiB
    tokens = default["cache_tokens_per_dp_group"] - half["cache_tokens_per_dp_group"]
    assert tokens == pytest.approx(freed / default["cache_bytes_per_token"], abs=2)
    assert plan.main(["--config", str(tmp_path), "--gpu-memory-utilization", "1.2"]) == 2
