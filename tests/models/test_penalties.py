"""Penalties and logit biases in the engine on the real model: each token is the argmax of vLLM's
penalized logits over the request's own prompt and output, across shared steps, preemption and
refilled rows."""

import numpy as np
import pytest

from jaxdsa.engine import Engine, EngineConfig, SamplingParams

# Negative frequency / presence penalties and repetition < 1 pull the output back to tokens it
# holds, so the counts decide tokens (a random tiny model rarely repeats a token by itself).
PENALIZED = {
    "rep": SamplingParams(max_tokens=14, repetition_penalty=0.5),
    "freq": SamplingParams(max_tokens=14, frequency_penalty=-2.0, presence_penalty=0.5),
    "all": SamplingParams(
        max_tokens=14,
        frequency_penalty=0.7,
        presence_penalty=-2.0,
        repetition_penalty=1.3,
        logit_bias=((104, -100.0), (7, 6.0), (200, 4.0)),
    ),
}


def penalized_logits(logits, prompt, output, sp):
    x = np.asarray(logits, np.float64).copy()
    for token, bias in sp.logit_bias:
        x[token] += bias
    counts = np.bincount(np.asarray(output, np.int64), minlength=len(x)).astype(np.float64)
    seen = counts > 0
    seen[list(set(prompt))] = True
    x[seen] = np.where(x[seen] > 0, x[seen] / sp.repetition_penalty, x[seen] * sp.repetition_penalty)
    return x - sp.frequency_penalty * counts - sp.presence_penalty * (counts > 0)


def _run(engine, prompts, params, *, forget_rows_every=None):
    requests, outputs = {}, {rid: [] for rid in prompts}
    for rid, prompt in prompts.items():
        engine.add_request(rid, prompt, params[rid], return_logits=True)
        requests[rid] = engine.requests[rid]
    steps = 0
    while engine.has_unfinished():
        for o in engine.step():
            outputs[o.request_id].append(o)
        steps += 1
        if forget_rows_every and steps % forget_rows_every == 0 and engine.runner.penalty is not None:
            engine.runner.penalty.owners = [None] * len(engine.runner.penalty.owners)  # every row refilled
    return requests, outputs


@pytest.mark.parametrize("num_pages,forget", [(None, 3), (9, None)], ids=["refilled-rows", "preempted"])
def test_penalized_greedy_tokens_follow_vllm(tiny_llms, num_pages, forget):
    llm = tiny_llms["glm5"]
    rng = np.random.default_rng(8)
    V = llm.config.vocab_size
    base = rng.integers(0, V, 6).tolist()
    prompts = {rid: (base * 4)[: 18 + i] for i, rid in enumerate([*PENALIZED, "plain"])}  # repetitive prompts
    params = PENALIZED | {"plain": SamplingParams(max_tokens=14)}
    config = EngineConfig(
        max_num_seqs=2, max_model_len=64, page_size=8, num_pages=num_pages, enable_prefix_caching=False
    )
    requests, outputs = _run(
        Engine(llm.family, llm.config, llm.model, dtype=llm.dtype, config=config),
        prompts,
        params,
        forget_rows_every=forget,
    )
    if num_pages:
        assert sum(r.num_preemptions for r in requests.values()) > 0
    changed = 0
    for rid, sp in PENALIZED.items():
        tokens = [o.new_token_ids[0] for o in outputs[rid]]
        assert len(tokens) == sp.max_tokens and len(set(tokens)) < len(tokens)  # repeats: counts matter
        for pos, o in enumerate(outputs[rid]):
            want = penalized_logits(o.logits, prompts[rid], tokens[:pos], sp)
            assert tokens[pos] == int(np.argmax(want)), (rid, pos)
            changed += tokens[pos] != int(np.argmax(o.logits))
    assert changed > 0  # the penalties decided some tokens

    solo = Engine(
        llm.family,
        llm.config,
        llm.model,
        dtype=llm.dtype,
        config=EngineConfig(max_num_seqs=1, max_model_len=64, page_size=8),
    )
    _, alone = _run(solo, {"plain": prompts["plain"]}, params)
    assert [o.new_token_ids for o in outputs["plain"]] == [o.new_token_ids for o in alone["plain"]]
