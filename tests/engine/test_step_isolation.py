"""One request never fails another in the engine: inputs a step cannot hold are refused when the
request is added, and a step that raises anyway fails only the request behind it while the
others finish exactly as they would have without it (the issue-13 reproductions included)."""

from __future__ import annotations

import jax
import numpy as np
import pytest

import jaxdsa
from jaxdsa.checkpoints.tiny.make import make_tiny
from jaxdsa.engine import Engine, EngineConfig, FinishReason, SamplingParams
from jaxdsa.engine.isolation import Quarantine
from jaxdsa.engine.request import Request, Status

MAX_STEPS = 2000  # every drain below ends far sooner; the bound turns a hang into a failure
GOOD = {
    "a": SamplingParams(max_tokens=12, ignore_eos=True),
    "b": SamplingParams(max_tokens=10, ignore_eos=True, temperature=1.0, seed=3),
    "c": SamplingParams(max_tokens=12, ignore_eos=True, repetition_penalty=0.5, logit_bias=((7, 5.0),)),
    "d": SamplingParams(max_tokens=9, ignore_eos=True, top_k=5, temperature=0.8, seed=11),
}
# The reproduction: a stop id past int32 that the step holds while min_tokens bans it.
POISON = SamplingParams(max_tokens=8, min_tokens=1, stop_token_ids=(2147483653,))
# A biased token id past int32: the step fails while it fills the penalty rows of the requests it
# seats, after it has marked them filled (so a good request seated beside it needs its refilled).
BIAS_POISON = SamplingParams(max_tokens=8, logit_bias=((2**40, 1.0),))


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = make_tiny("glm_moe_dsa", str(tmp_path_factory.mktemp("isolation")), seed=7)
    return jaxdsa.LLM(path, dtype="float32", page_size=8, progress=False)


@pytest.fixture(scope="module")
def prompts(llm):
    rng = np.random.default_rng(0)
    return {rid: rng.integers(0, llm.config.vocab_size, 5 + 4 * i).tolist() for i, rid in enumerate(GOOD)}


def make_engine(llm, **overrides) -> Engine:
    config = dict(max_num_seqs=4, max_model_len=64, page_size=8) | overrides
    return Engine(llm.family, llm.config, llm.model, dtype=llm.dtype, config=EngineConfig(**config))


def advance(engine: Engine, tokens: dict[str, list[int]], errors: dict[str, str], steps: int) -> None:
    """Run up to ``steps`` steps, collecting tokens and errors per request."""
    for _ in range(steps):
        if not engine.has_unfinished():
            return
        for out in engine.step():
            if out.finish_reason is FinishReason.ERROR:
                errors[out.request_id] = out.error
            else:
                tokens.setdefault(out.request_id, []).extend(out.new_token_ids)


def drain(engine: Engine, tokens: dict[str, list[int]], errors: dict[str, str]) -> None:
    advance(engine, tokens, errors, MAX_STEPS)
    assert not engine.has_unfinished(), f"the engine did not finish its requests in {MAX_STEPS} steps"


def serve(engine: Engine, requests: dict[str, tuple[list[int], SamplingParams]]):
    tokens, errors = {}, {}
    for rid, (prompt, sp) in requests.items():
        engine.add_request(rid, prompt, sp)
    drain(engine, tokens, errors)
    return tokens, errors


@pytest.fixture(scope="module")
def expected(llm, prompts):
    """The good requests' tokens, served together without a bad one."""
    tokens, errors = serve(make_engine(llm), {rid: (prompts[rid], sp) for rid, sp in GOOD.items()})
    assert not errors and all(len(tokens[rid]) == sp.max_tokens for rid, sp in GOOD.items())
    return tokens


@pytest.mark.parametrize(
    "prompt, sampling, message",
    [
        ([5, 6], SamplingParams(stop_token_ids=(2147483653,), min_tokens=1), "stop_token_ids"),
        ([5, 6], SamplingParams(stop_token_ids=(-1,)), "stop_token_ids"),
        ([5, 2**63], SamplingParams(), "prompt token ids"),
        ([-1], SamplingParams(), "prompt token ids"),
        ([5, 6], SamplingParams(logit_bias=((2**40, 1.0),)), "logit_bias"),
        ([5, 6], SamplingParams(seed=1.5), "seed"),
        ([5, 6], SamplingParams(max_tokens=2.5), "max_tokens"),
    ],
)
def test_add_request_refuses_inputs_the_step_cannot_hold(llm, prompt, sampling, message):
    engine = make_engine(llm)
    with pytest.raises(ValueError, match=message):
        engine.add_request("bad", prompt, sampling)
    assert not engine.requests and not engine.has_unfinished()


def test_sampling_params_refuse_non_finite_numbers():
    for field in ("temperature", "top_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
        with pytest.raises(ValueError, match=field):
            SamplingParams(**{field: float("nan")})
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=float("inf"))


def test_top_k_past_the_vocabulary_is_off_and_seeds_reduce_to_31_bits(llm, prompts):
    """The issue's ``top_k: 1099511627776`` samples as top-k off; a seed past the sampler's width
    samples as that seed reduced to 31 bits."""
    prompt = prompts["a"]
    sampled = dict(max_tokens=8, ignore_eos=True, temperature=1.0)
    tokens, errors = serve(
        make_engine(llm),
        {
            "huge-k": (prompt, SamplingParams(top_k=1099511627776, seed=5, **sampled)),
            "k-off": (prompt, SamplingParams(top_k=0, seed=5, **sampled)),
            "huge-seed": (prompt, SamplingParams(seed=2**70 + 5, **sampled)),
        },
    )
    assert not errors and tokens["huge-k"] == tokens["k-off"] == tokens["huge-seed"]


def inject_unchecked(engine: Engine, monkeypatch, request_id: str, prompt, sampling) -> None:
    """Add a request past the checks, as an input no check foresees would get in."""
    with monkeypatch.context() as m:
        m.setattr(engine, "check", lambda prompt, sampling: None)
        engine.add_request(request_id, prompt, sampling)


def fail_after_donation(engine: Engine, monkeypatch, poisoned: str) -> None:
    """Steps holding ``poisoned`` fail as a device error would: the donated cache and penalty rows
    are gone."""
    launch = engine.runner.launch

    def launch_or_fail(segments, *args, **kwargs):
        if any(s.request.request_id == poisoned for s in segments):
            p = engine.runner.penalty
            for a in [*jax.tree.leaves(engine.runner.cache), p.counts, p.in_prompt, p.bias]:
                a.delete()
            raise RuntimeError("device fault")
        return launch(segments, *args, **kwargs)

    monkeypatch.setattr(engine.runner, "launch", launch_or_fail)


def fail_when_read(engine: Engine, monkeypatch, poisoned: str) -> None:
    """Steps holding ``poisoned`` fail when their results are read, as an error on the device
    surfaces: under async scheduling the step after it is running by then, on the cache it lost."""
    launch, fetch, bad = engine.runner.launch, engine.runner.fetch, set()

    def launch_and_note(segments, *args, **kwargs):
        flight = launch(segments, *args, **kwargs)
        if any(s.request.request_id == poisoned for s in segments):
            bad.add(id(flight))
        return flight

    def fetch_or_fail(flight):
        if id(flight) in bad:
            jax.block_until_ready(jax.tree.leaves(engine.runner.cache))
            for a in jax.tree.leaves(engine.runner.cache):
                a.delete()
            raise RuntimeError("device fault")
        return fetch(flight)

    monkeypatch.setattr(engine.runner, "launch", launch_and_note)
    monkeypatch.setattr(engine.runner, "fetch", fetch_or_fail)


@pytest.mark.parametrize("where", ["host", "device", "read"])
def test_a_failing_request_in_a_running_batch_fails_alone(llm, prompts, expected, monkeypatch, where):
    """Four requests decode together; a bad one joins mid-way. It fails with a clear error; the four
    finish with the tokens they have without it, whether the step failed before reaching the
    device (the cache intact), after donating the cache, or when its results were read, with the
    next step already launched (every running request recomputed in both)."""
    engine = make_engine(llm, max_num_seqs=8)
    tokens, errors = {}, {}
    for rid, sp in GOOD.items():
        engine.add_request(rid, prompts[rid], sp)
    advance(engine, tokens, errors, steps=3)
    assert all(len(tokens[rid]) >= 1 for rid in GOOD)  # decoding when the bad one arrives
    if where == "host":
        inject_unchecked(engine, monkeypatch, "bad", prompts["b"], POISON)
    else:
        engine.add_request("bad", prompts["b"], SamplingParams(max_tokens=8))
        (fail_after_donation if where == "device" else fail_when_read)(engine, monkeypatch, "bad")
    drain(engine, tokens, errors)
    assert list(errors) == ["bad"] and "engine step failed for this request" in errors["bad"]
    assert ("OverflowError" if where == "host" else "device fault") in errors["bad"]
    assert {rid: tokens[rid] for rid in GOOD} == expected and "bad" not in tokens
    assert engine.num_failed_steps >= 1 and not engine.requests
    if where != "host":
        assert engine.scheduler.num_preemptions >= len(GOOD)  # recomputed after the cache was lost
    assert engine.scheduler.pages_used == 0


def test_bad_requests_among_many_are_found_by_bisection(llm, prompts, expected, monkeypatch):
    """Two bad requests admitted in the same step as good ones: both fail, the good ones (the
    penalized one seated in the same step included) finish as without them, and it takes a bounded
    number of failed steps."""
    engine = make_engine(llm, max_num_seqs=8)
    for rid, sp in list(GOOD.items())[:2]:
        engine.add_request(rid, prompts[rid], sp)
    inject_unchecked(engine, monkeypatch, "bad1", prompts["a"], POISON)
    for rid, sp in list(GOOD.items())[2:]:
        engine.add_request(rid, prompts[rid], sp)
    inject_unchecked(engine, monkeypatch, "bad2", prompts["c"], BIAS_POISON)
    tokens, errors = {}, {}
    drain(engine, tokens, errors)
    assert sorted(errors) == ["bad1", "bad2"]
    assert {rid: tokens[rid] for rid in GOOD} == expected
    assert engine.num_failed_steps <= 1 + 2 * 3  # the step, then about log2(6) halvings per bad one


def test_a_step_that_always_fails_fails_each_request_and_the_engine_serves_on(llm, prompts, monkeypatch):
    engine = make_engine(llm)
    with monkeypatch.context() as m:
        m.setattr(engine.runner, "launch", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("device lost")))
        tokens, errors = serve(engine, {rid: (prompts[rid], sp) for rid, sp in GOOD.items()})
    assert sorted(errors) == sorted(GOOD) and not tokens
    assert all("device lost" in e for e in errors.values())
    tokens, errors = serve(engine, {"after": (prompts["a"], GOOD["a"])})
    assert not errors and len(tokens["after"]) == GOOD["a"].max_tokens


def test_quarantine_bisects_to_the_bad_requests():
    """The isolation logic alone: 16 requests, two break every step they are in. A simulated engine
    runs the requests under test (else all); a step gives each a token unless it holds a bad one."""
    requests = [Request(f"r{i}", [1], SamplingParams(max_tokens=3)) for i in range(16)]
    bad = {requests[5], requests[12]}
    quarantine, failed, failed_steps = Quarantine(), [], 0
    for _ in range(200):
        live = [r for r in requests if r.status is not Status.FINISHED]
        if not live:
            break
        under_test = quarantine.under_test()
        step = [r for r in live if under_test is None or r in under_test]
        if bad & set(step):
            failed_steps += 1
            culprit = quarantine.step_failed(step, newest=[])
            if culprit is not None:
                culprit.status = Status.FINISHED
                failed.append(culprit)
            continue
        for r in step:
            r.output.append(0)
            if len(r.output) == r.sampling.max_tokens:
                r.status = Status.FINISHED
    assert set(failed) == bad and all(len(r.output) == 3 for r in requests if r not in bad)
    assert failed_steps <= 2 * 4 + 1  # log2(16) halvings per bad request, plus the first failure
