"""Engine logprobs on the real model: the log-softmax of the distribution each token came from."""

import numpy as np
import pytest

from jaxdsa.engine import Engine, EngineConfig, SamplingParams

# Left out of the default run (tests/conftest.py; pytest -m slow runs them): GLM-5.2's chunked prompt
# logprobs: the default run checks GLM-5's.
SLOW_CASES = ("test_prompt_logprobs_over_chunked_prefill_are_the_full_forward[glm52]",)


def log_softmax(x):
    x = np.asarray(x, np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


@pytest.mark.parametrize("family", ["glm5", "dsv32"])
def test_logprobs_are_the_full_forward_log_softmax(tiny_llms, family):
    llm = tiny_llms[family]
    prompt = np.random.default_rng(3).integers(0, llm.config.vocab_size, 20).tolist()
    engine = Engine(
        llm.family,
        llm.config,
        llm.model,
        dtype=llm.dtype,
        config=EngineConfig(max_num_seqs=2, max_model_len=64, page_size=8, max_logprobs=5),
    )
    with pytest.raises(ValueError, match="max_logprobs"):
        engine.add_request("too-many", prompt, SamplingParams(logprobs=6))
    # A sampled request with logprobs shares its steps with one without (whose rows are not fetched).
    engine.add_request(
        "a", prompt, SamplingParams(max_tokens=6, temperature=0.9, seed=3, logprobs=5), return_logits=True
    )
    engine.add_request("b", prompt[:7], SamplingParams(max_tokens=6))
    outputs = {"a": [], "b": []}
    while engine.has_unfinished():
        for o in engine.step():
            outputs[o.request_id].append(o)
    assert all(o.logprobs is None for o in outputs["b"])
    tokens = [o.new_token_ids[0] for o in outputs["a"]]
    full = log_softmax(llm.score(prompt + tokens)[len(prompt) - 1 : -1])  # one forward over everything
    for pos, o in enumerate(outputs["a"]):
        (entry,) = o.logprobs
        step = log_softmax(o.logits)
        assert entry.token_id == tokens[pos]
        np.testing.assert_allclose(entry.logprob, step[entry.token_id], atol=1e-5)
        np.testing.assert_allclose(entry.logprob, full[pos, entry.token_id], atol=1e-4)
        top_ids, top_lps = zip(*entry.top)
        assert list(top_ids) == np.argsort(-o.logits, kind="stable")[:5].tolist()
        np.testing.assert_allclose(top_lps, full[pos, list(top_ids)], atol=1e-4)


@pytest.mark.parametrize("family", ["glm5", "glm52"])
def test_prompt_logprobs_over_chunked_prefill_are_the_full_forward(tiny_llms, family):
    llm = tiny_llms[family]
    prompt = np.random.default_rng(4).integers(0, llm.config.vocab_size, 30).tolist()
    # A 12-token budget runs the prompt in chunks (crossing index_topk = 8) beside another request,
    # and all of it although an earlier request left its pages in the prefix cache.
    config = EngineConfig(
        max_num_seqs=2, max_model_len=64, max_num_batched_tokens=12, page_size=8, max_logprobs=4
    )
    engine = Engine(llm.family, llm.config, llm.model, dtype=llm.dtype, config=config)
    engine.add_request("earlier", prompt, SamplingParams(max_tokens=1))  # caches the prompt's pages
    while engine.has_unfinished():
        engine.step()
    engine.add_request(
        "scored", prompt, SamplingParams(max_tokens=1, prompt_logprobs=3)
    )  # ends at its first token
    engine.add_request("other", prompt[:9], SamplingParams(max_tokens=4))
    outputs = {"scored": [], "other": []}
    while engine.has_unfinished():
        for o in engine.step():
            outputs[o.request_id].append(o)
    (first,) = outputs["scored"]
    assert all(o.prompt_logprobs is None for o in outputs["other"])
    entries = first.prompt_logprobs
    assert len(entries) == len(prompt) and entries[0] is None
    full = log_softmax(llm.score(prompt))
    for p in range(1, len(prompt)):
        e = entries[p]
        assert e.token_id == prompt[p]
        np.testing.assert_allclose(e.logprob, full[p - 1, prompt[p]], atol=1e-4)
        top_ids, top_lps = zip(*e.top)
        assert list(top_ids) == np.argsort(-full[p - 1], kind="stable")[:3].tolist()
        np.testing.assert_allclose(top_lps, full[p - 1, list(top_ids)], atol=1e-4)


def test_min_tokens_holds_back_stop_tokens(tiny_llms):
    """A stop token that greedy decoding picks first cannot be sampled before min_tokens; after
    that it ends the request. Its logprobs stay the model's own (it is still the top token)."""
    llm = tiny_llms["glm5"]
    prompt = np.random.default_rng(5).integers(0, llm.config.vocab_size, 12).tolist()
    engine = Engine(
        llm.family,
        llm.config,
        llm.model,
        dtype=llm.dtype,
        config=EngineConfig(max_num_seqs=2, max_model_len=64, page_size=8, max_logprobs=2),
    )
    engine.add_request("free", prompt, SamplingParams(max_tokens=1))
    while engine.has_unfinished():
        for o in engine.step():
            stop = o.new_token_ids[0]  # the greedy first token
    with pytest.raises(ValueError, match="min_tokens"):
        engine.add_request("bad", prompt, SamplingParams(max_tokens=2, min_tokens=3))
    engine.add_request("stopped", prompt, SamplingParams(max_tokens=4, stop_token_ids=(stop,)))
    engine.add_request(
        "held", prompt, SamplingParams(max_tokens=4, min_tokens=2, stop_token_ids=(stop,), logprobs=1)
    )
    outputs = {"stopped": [], "held": []}
    while engine.has_unfinished():
        for o in engine.step():
            outputs[o.request_id].append(o)
    assert [o.new_token_ids[0] for o in outputs["stopped"]] == [stop]
    held = [o.new_token_ids[0] for o in outputs["held"]]
    assert stop not in held[:2] and len(held) >= 2
    assert outputs["held"][0].logprobs[0].top[0][0] == stop  # still the model's most likely token
    if stop in held:  # after min_tokens the stop token ends the request
        assert held[-1] == stop and outputs["held"][-1].finish_reason.value == "stop"
