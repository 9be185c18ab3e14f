"""Warm-up compiles every step variant up front (side by side, in threads), the steps that follow
reuse what it built, and it leaves nothing behind: a warmed engine generates what a cold one does."""

from __future__ import annotations

import contextlib

import jax
import numpy as np
import pytest

import jaxdsa
from jaxdsa.checkpoints.tiny.make import make_tiny
from jaxdsa.engine import Engine, EngineConfig, SamplingParams

LOWERING = "/jax/core/compile/jaxpr_to_mlir_module_duration"  # jax._src.dispatch.JAXPR_TO_MLIR_MODULE_EVENT


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = make_tiny("glm_moe_dsa", str(tmp_path_factory.mktemp("warmup")), seed=3)
    return jaxdsa.LLM(path, dtype="float32", page_size=8, progress=False)


def make_engine(llm) -> Engine:
    config = EngineConfig(max_num_seqs=2, max_model_len=64, page_size=8, max_num_batched_tokens=32)
    return Engine(llm.family, llm.config, llm.model, dtype=llm.dtype, config=config)


def generate(engine: Engine, prompts: list[list[int]]) -> dict[str, list[int]]:
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=6, ignore_eos=True))
    tokens = {}
    for _ in range(200):
        if not engine.has_unfinished():
            break
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    assert not engine.has_unfinished()
    return tokens


@contextlib.contextmanager
def step_lowerings():
    """A list that collects the engine step's lowerings (a trace that goes on to compile, or to the
    persistent compilation cache) while the context is open."""
    lowered = []

    def listen(event: str, duration: float, **kwargs) -> None:
        if event == LOWERING and "fused_step" in str(kwargs.get("fun_name")):
            lowered.append(kwargs["fun_name"])

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        yield lowered
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)


def variants(engine: Engine) -> int:
    return len(engine.runner.variants)


def test_warmup_lowers_each_variant_once_and_the_steps_reuse_it(llm):
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, llm.config.vocab_size, n).tolist() for n in (3, 11, 20)]
    # two prompts of index_topk = 8 tokens: one dense step of 16 tokens, the most one can hold
    dense = [rng.integers(0, llm.config.vocab_size, llm.config.index_topk).tolist() for _ in range(2)]
    warm, reported = make_engine(llm), []
    n = variants(warm)
    with step_lowerings() as lowered:
        seconds = warm.runner.warmup(reported.append)
        assert n > 1 and len(lowered) == n
        dense_mode, sparse_mode = warm.runner.modes  # dense steps: 2 slots of at most 8 tokens
        want = [(b, dense_mode) for b in (1, 2, 4, 8, 16)] + [(b, sparse_mode) for b in (1, 2, 4, 8, 16, 32)]
        assert list(seconds) == want
        named = [f"{b} tokens, {mode}" for b, mode in seconds]
        assert sorted(reported) == sorted(named)  # each variant named once, as its compile ends
        warm_tokens = generate(warm, prompts)  # prefill chunks and decode steps: buckets warm-up met
        warm_dense = generate(warm, dense)
        assert len(lowered) == n, "a step after warm-up traced and compiled again"
    cold = make_engine(llm)  # its steps jitted as met, at XLA's default level (the CPU warm-up's: 1)
    assert warm_tokens == generate(cold, prompts) and warm_dense == generate(cold, dense)
    warm.runner.warmup()  # again: its steps are lowered from the jitted functions, not the executables
