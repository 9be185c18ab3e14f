"""MTP speculative decoding through the engine: greedy output token-identical to decoding without it.

One batch per family exercises what the engine must get right around the drafts: mixed prompt
lengths whose contexts cross ``index_topk`` while decoding, a shared prefix served from the prefix
cache, a cache small enough to force preemptions, chunked prefill, penalties, ``min_tokens`` with
stop tokens, logprobs, and a request that ends exactly at ``max_model_len``. The checkpoints' MTP
layers are random, so nearly every draft is rejected (the rollback path); a model whose MTP layer is
built to agree with it shows the other extreme: every draft accepted, N + 1 tokens per step.
"""

from __future__ import annotations

from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxdsa
from jaxdsa.checkpoints.tiny.make import make_tiny
from jaxdsa.engine import FinishReason, SamplingParams

pytestmark = pytest.mark.slow  # MTP through the engine per family; MTP handoff: tests/engine/test_handoff.py

PAGE, MAX_LEN = 8, 48
FIXTURES = Path(__file__).parent.parent / "fixtures"


def _llm(path, num_spec: int | None, **engine) -> jaxdsa.LLM:
    config = {"method": "mtp", "num_speculative_tokens": num_spec} if num_spec else None
    options = dict(max_num_seqs=3, max_model_len=MAX_LEN, max_num_batched_tokens=16, num_pages=8) | engine
    return jaxdsa.LLM(
        path, dtype="float32", page_size=PAGE, progress=False, speculative_config=config, **options
    )


def _requests(vocab: int) -> dict[str, tuple[list[int], SamplingParams]]:
    rng = np.random.default_rng(5)
    ids = lambda n: rng.integers(2, vocab, n).tolist()  # noqa: E731
    shared = ids(2 * PAGE)
    stops = tuple(range(1, vocab, vocab // 24))[:30]
    return {
        "short": (ids(3), SamplingParams(max_tokens=20)),
        "to-max-len": (ids(20), SamplingParams(max_tokens=MAX_LEN - 20)),
        "shared-a": (shared + ids(3), SamplingParams(max_tokens=10)),
        "penalized": (ids(6), SamplingParams(max_tokens=12, frequency_penalty=1.0, presence_penalty=0.5)),
        "shared-b": (shared + ids(2), SamplingParams(max_tokens=10)),
        "min-tokens": (ids(5), SamplingParams(max_tokens=16, min_tokens=5, stop_token_ids=stops)),
        "logprobs": (ids(7), SamplingParams(max_tokens=8, logprobs=3)),
    }


def _serve(llm: jaxdsa.LLM, requests) -> dict:
    """Every request through the engine -> per id: tokens, finish reason, logprobs, tokens per output."""
    engine = llm.engine
    for rid, (prompt, sampling) in requests.items():
        engine.add_request(rid, prompt, sampling)
    got = {rid: {"tokens": [], "chunks": [], "logprobs": []} for rid in requests}
    while engine.has_unfinished():
        for out in engine.step():
            assert out.error is None, out.error
            seen = got[out.request_id]
            seen["tokens"] += out.new_token_ids
            seen["chunks"].append(len(out.new_token_ids))
            seen["logprobs"] += out.logprobs or []
            seen["reason"] = out.finish_reason
    return got


def _same_output(got: dict, want: dict) -> None:
    for rid in want:
        assert got[rid]["tokens"] == want[rid]["tokens"], rid
        assert got[rid]["reason"] == want[rid]["reason"], rid
        for a, b in zip(got[rid]["logprobs"], want[rid]["logprobs"], strict=True):
            assert a.token_id == b.token_id and abs(a.logprob - b.logprob) < 1e-4, rid
            assert [t for t, _ in a.top] == [t for t, _ in b.top], rid


# family preset -> (checkpoint, drafts per step, engine options). Nearly all of these tests' time is
# compiling the step's shapes, so the token budgets are small (V4's step compiles slowest).
CASES = {
    "glm5": (lambda tmp: make_tiny("glm_moe_dsa", str(tmp), seed=7, preset="glm5"), 3, {}),
    "dsv32": (lambda tmp: make_tiny("deepseek_v32", str(tmp), seed=7, preset="dsv32"), 1, {}),
    "dsv4": (lambda tmp: FIXTURES / "dsv4", 2, {"max_num_batched_tokens": 8}),
}


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    """Per case: (the LLM without speculation, the LLM with it) on one checkpoint, built on first use."""
    built = {}

    def pair(name: str) -> tuple[jaxdsa.LLM, jaxdsa.LLM]:
        if name not in built:
            make, num_spec, options = CASES[name]
            path = make(tmp_path_factory.mktemp(name))
            built[name] = _llm(path, None, **options), _llm(path, num_spec, **options)
        return built[name]

    return pair


@pytest.mark.parametrize("name", CASES)
def test_greedy_output_is_the_main_models(name, pairs):
    base, spec = pairs(name)
    requests = _requests(base.config.vocab_size)
    want, got = _serve(base, requests), _serve(spec, requests)
    _same_output(got, want)
    assert len(got["to-max-len"]["tokens"]) == MAX_LEN - 20
    assert got["to-max-len"]["reason"] is FinishReason.LENGTH
    assert len(got["logprobs"]["logprobs"]) == len(got["logprobs"]["tokens"])
    stats = spec.engine.stats()
    assert stats["preemptions"] > 0
    # V4's rings are not in the pages: no prefix caching there (the drafts then roll back in the rings)
    assert (stats["prefix_cache_hits"] > 0) == spec.engine.config.enable_prefix_caching
    drafted, accepted = stats["spec_decode_num_draft_tokens"], stats["spec_decode_num_accepted_tokens"]
    assert drafted > 50 and accepted / drafted < 0.25  # random MTP weights: drafts are guesses
    assert stats["generated_tokens"] == base.engine.stats()["generated_tokens"]


def _agreeing_mtp(llm: jaxdsa.LLM) -> None:
    """Make the model a bigram model (every attention and MLP output projection zero: the logits
    depend on the current token only) and its MTP layer the same bigram model one token on
    (eh_proj passes the embedding half, its layer adds nothing, its head norm is the model's), so
    the MTP layer drafts exactly what the model will predict."""
    model = llm.model
    zeroed = ("o", "down")
    for path, variable in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        if path[-2] in zeroed or path[-1] in zeroed:
            variable.set_value(jnp.zeros_like(variable.get_value()))
    mtp = model.mtp[0]
    D = llm.config.hidden_size
    mtp.eh_proj.weight.set_value(jnp.concatenate([jnp.eye(D), jnp.zeros((D, D))]).astype(jnp.float32))
    mtp.enorm.weight.set_value(jnp.ones(D, jnp.float32))
    mtp.shared_head_norm.weight.set_value(model.norm.weight.get_value())


def test_drafts_that_agree_are_all_accepted(tmp_path):
    """The glm5 case's engines on a model whose MTP layer agrees with it (the same shapes: the
    compiled steps come from the persistent compilation cache)."""
    make, num_spec, options = CASES["glm5"]
    path = make(tmp_path)
    base, spec = _llm(path, None, **options), _llm(path, num_spec, **options)
    for llm in (base, spec):
        _agreeing_mtp(llm)
    max_tokens = 1 + 3 * (num_spec + 1)
    requests = {f"r{i}": (list(range(2 + i, 8 + i)), SamplingParams(max_tokens=max_tokens)) for i in range(2)}
    want, got = _serve(base, requests), _serve(spec, requests)
    _same_output(got, want)
    stats = spec.engine.stats()
    assert stats["spec_decode_num_accepted_tokens"] == stats["spec_decode_num_draft_tokens"] > 0
    per_position = [stats[f"spec_decode_num_accepted_tokens_pos{j}"] for j in range(num_spec)]
    assert per_position == [stats["spec_decode_num_drafts"]] * num_spec
    for rid in requests:  # the first token comes from the prefill, then N + 1 per step
        assert got[rid]["chunks"] == [1] + [num_spec + 1] * 3


def test_sampling_is_seeded_and_starts_as_without_drafts(pairs):
    """Sampled requests: the same seed gives the same tokens; the first token (drawn in the prefill
    step, with no drafts) is the one the engine without speculation draws."""
    base, spec = pairs("glm5")
    sampling = SamplingParams(max_tokens=12, temperature=1.0, top_k=40, top_p=0.9, seed=11)
    requests = {f"r{i}": (list(range(3, 9 + i)), sampling) for i in range(3)}
    first = _serve(spec, requests)
    again = _serve(spec, {f"again-{rid}": r for rid, r in requests.items()})
    plain = _serve(base, requests)
    for rid in requests:
        assert first[rid]["tokens"] == again[f"again-{rid}"]["tokens"]
        assert first[rid]["tokens"][0] == plain[rid]["tokens"][0]


def test_a_model_without_mtp_layers_is_refused():
    with pytest.raises(ValueError, match="no MTP weights"):
        _ = _llm(FIXTURES / "dsv32_yarn", 2).engine
