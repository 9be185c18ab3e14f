"""The executable store (jaxdsa.engine.executables): a warm start loads the warmed steps instead of
tracing them and generates what a cold one does, a step JAX took from its compilation cache is not
stored, anything the trace reads is in the key, a file that does not load is a miss, and only CPU
compiles take the warm-up's compiler options."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxdsa.engine import executables
from jaxdsa.engine.executables import ExecutableStore, compile_step

# Left out of the default run (tests/conftest.py; pytest -m slow runs them): the tp 2 start: the default run
# loads a single device's steps.
SLOW_CASES = ("test_a_warm_start_loads_every_step_and_generates_the_same[2]",)

# One start in a fresh process: a tiny GLM-5 (at tp = argv[2]), warm-up, then greedy tokens. Prints
# what the warm-up loaded and lowered, and the tokens.
START = """
import json, sys, jax
import jaxdsa
from jaxdsa.checkpoints.tiny.make import make_tiny
from jaxdsa.engine import Engine, EngineConfig, SamplingParams
lowered = []
jax.monitoring.register_event_duration_secs_listener(
    lambda event, duration, **kw: lowered.append(1)
    if event == "/jax/core/compile/jaxpr_to_mlir_module_duration" and "fused_step" in str(kw.get("fun_name"))
    else None
)
path = make_tiny("glm_moe_dsa", sys.argv[1], seed=3)
llm = jaxdsa.LLM(path, dtype="float32", page_size=8, progress=False, tp=int(sys.argv[2]))
config = EngineConfig(max_num_seqs=2, max_model_len=64, page_size=8, max_num_batched_tokens=16)
engine = Engine(llm.family, llm.config, llm.model, dtype=llm.dtype, config=config, mesh=llm.mesh)
reported = []
seconds = engine.runner.warmup(reported.append)
engine.add_request("r", [5, 9, 2, 7, 11], SamplingParams(max_tokens=6, ignore_eos=True))
tokens = []
while engine.has_unfinished():
    tokens += [t for out in engine.step() for t in out.new_token_ids]
print(json.dumps({"lowered": len(lowered), "variants": len(seconds), "tokens": tokens,
                  "stored": sum(r.endswith("(stored)") for r in reported)}))
"""


def start(tmp_path, tp: int) -> dict:
    env = {
        **os.environ,
        "JAXDSA_CACHE_DIR": str(tmp_path / "xla"),
        "JAXDSA_EXECUTABLE_CACHE": "1",
        "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": f"--xla_force_host_platform_device_count={tp}",
    }
    run = subprocess.run(
        [sys.executable, "-c", START, str(tmp_path / "model"), str(tp)],
        env=env,
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("tp", [1, 2])
def test_a_warm_start_loads_every_step_and_generates_the_same(tmp_path, tp):
    """One device, and a tp = 2 mesh (each stored step loads onto the devices it was built for)."""
    steps = tmp_path / "xla" / "jaxdsa-steps"
    cold = start(tmp_path, tp)
    n = cold["variants"]
    assert n > 1 and cold["lowered"] == n and cold["stored"] == 0
    assert len(list(steps.glob("*.executable"))) == n
    warm = start(tmp_path, tp)
    assert warm["lowered"] == 0 and warm["stored"] == n and warm["tokens"] == cold["tokens"]
    for path in steps.iterdir():  # XLA's cache still has every step: taken from it, not stored
        path.unlink()
    again = start(tmp_path, tp)
    assert again["lowered"] == n and again["tokens"] == cold["tokens"]
    assert list(steps.glob("*.executable")) == []


def test_the_key_follows_what_the_trace_reads(monkeypatch):
    store = ExecutableStore("unused", static="model A")
    args = (jnp.zeros((4, 8), jnp.float32), np.zeros(3, np.int32))
    key = store.key("step", args)
    assert key == ExecutableStore("elsewhere", static="model A").key("step", args)
    assert key != ExecutableStore("unused", static="model B").key("step", args)
    assert key != store.key("another step", args)
    assert key != store.key("step", (jnp.zeros((4, 16), jnp.float32), args[1]))
    assert key != store.key("step", (args[0].astype(jnp.bfloat16), args[1]))
    monkeypatch.setenv("JAXDSA_KERNELS", "reference")
    assert key != store.key("step", args)
    monkeypatch.delenv("JAXDSA_KERNELS")
    with jax.default_matmul_precision("highest"):
        assert key != store.key("step", args)
    monkeypatch.setattr(executables, "source_digest", lambda: "edited source")
    assert key != store.key("step", args)


def test_stored_executables_load_and_a_broken_file_is_a_miss(tmp_path, caplog):
    """On its own device (the last of the process's, when there are several), not on all of them."""
    constant = float(np.random.default_rng().random())  # a function XLA has not compiled before
    x = jax.device_put(jnp.ones(4), jax.devices()[-1])
    compiled, here = compile_step(jax.jit(lambda x: x * constant + 1).lower(x))
    assert here
    store = ExecutableStore(tmp_path, static="")
    store.save("k", compiled)
    np.testing.assert_array_equal(store.load("k")(x), compiled(x))
    assert store.load("absent") is None
    (tmp_path / "k.executable").write_bytes(b"not an executable")
    with caplog.at_level(logging.WARNING, logger=executables.__name__):
        assert store.load("k") is None
    assert "did not load" in caplog.text


def test_the_store_follows_its_variable(monkeypatch, tmp_path):
    monkeypatch.setenv(executables.ENV, "0")
    assert ExecutableStore.for_runner("static") is None
    monkeypatch.setenv(executables.ENV, str(tmp_path))
    assert ExecutableStore.for_runner("static").directory == tmp_path


def test_only_cpu_compiles_take_options_and_xla_flags_can_set_the_level(monkeypatch):
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    assert executables.compiler_options("cpu") == {"xla_backend_optimization_level": 1}
    assert executables.compiler_options("cuda") is None and executables.compiler_options("rocm") is None
    monkeypatch.setenv("XLA_FLAGS", "--xla_backend_optimization_level=3")
    assert executables.compiler_options("cpu") is None
