"""Async scheduling: each step is launched before the last one's tokens reach the host, and every
request gets exactly the tokens of synchronous scheduling (float32, token for token, logprobs
included) through everything that touches a step's inputs: greedy and seeded sampling, stop
tokens, min_tokens, penalties and logit bias, logprobs and prompt logprobs, parallel samples of
one prompt, chunked prefill, prefix caching, preemption, requests that arrive mid-way or are
cancelled, and a request that ends at max_model_len. Meshes: tests/sharding/test_async_mesh.py."""

from __future__ import annotations

import numpy as np
import pytest

import jaxdsa
from jaxdsa.checkpoints.tiny.make import make_tiny
from jaxdsa.engine import Engine, FinishReason, SamplingParams
from jaxdsa.engine.request import Request, Status
from jaxdsa.engine.scheduler import Scheduler

MAX_LEN, PAGE = 48, 8


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = make_tiny("glm_moe_dsa", str(tmp_path_factory.mktemp("async")), seed=7, preset="glm5")
    return jaxdsa.LLM(path, dtype="float32", page_size=PAGE, progress=False)


def engine(llm, async_scheduling: bool, **overrides) -> Engine:
    config = (
        dict(max_num_seqs=4, max_model_len=MAX_LEN, page_size=PAGE, max_num_batched_tokens=16, num_pages=12)
        | overrides
    )
    return llm.new_engine(async_scheduling=async_scheduling, **config)


def requests(vocab: int, stop_at: int) -> dict[str, tuple[list[int], SamplingParams]]:
    """A mixed batch; ``stop_at``: a token the greedy request emits, so a stop id ends one early."""
    rng = np.random.default_rng(3)
    ids = lambda n: rng.integers(2, vocab, n).tolist()  # noqa: E731
    shared = ids(2 * PAGE)
    sampled = dict(temperature=0.9, top_k=20, top_p=0.9)
    first = ids(5)
    return {
        "greedy": (first, SamplingParams(max_tokens=14, ignore_eos=True)),
        "stops": (first, SamplingParams(max_tokens=14, stop_token_ids=(stop_at,))),
        "seeded": (ids(6), SamplingParams(max_tokens=12, seed=11, **sampled)),
        "long-prompt": (ids(30), SamplingParams(max_tokens=6, ignore_eos=True)),  # chunks of 16
        "penalized": (
            ids(4),
            SamplingParams(
                max_tokens=12,
                repetition_penalty=1.3,
                frequency_penalty=0.5,
                presence_penalty=0.3,
                logit_bias=((9, 4.0),),
                seed=2,
                temperature=0.7,
            ),
        ),
        "min-tokens": (
            ids(5),
            SamplingParams(
                max_tokens=10, min_tokens=6, stop_token_ids=tuple(range(2, vocab, vocab // 24))[:30]
            ),
        ),
        "logprobs": (ids(7), SamplingParams(max_tokens=8, logprobs=3, prompt_logprobs=2)),
        "shared-a": (shared + ids(3), SamplingParams(max_tokens=8)),
        "shared-b": (shared + ids(2), SamplingParams(max_tokens=8, seed=4, temperature=1.0)),
        "n-0": (shared[:6], SamplingParams(max_tokens=6, seed=100, temperature=1.0)),  # n=2, as the
        "n-1": (shared[:6], SamplingParams(max_tokens=6, seed=101, temperature=1.0)),  # server sends them
        "to-max-len": (ids(MAX_LEN - 9), SamplingParams(max_tokens=9, ignore_eos=True)),
    }


def serve(engine: Engine, batch: dict, *, late: frozenset = frozenset(), cancel: dict | None = None) -> dict:
    """Serve ``batch``: ``late`` requests are added after three steps, each of ``cancel``
    (id -> tokens) is aborted once it has that many. -> per id: tokens, reason, logprobs, prompt
    logprobs."""
    cancel = cancel or {}
    got = {rid: {"tokens": [], "reason": None, "logprobs": [], "prompt": None} for rid in batch}
    for rid in [rid for rid in batch if rid not in late]:  # in the batch's order: a set's would vary
        engine.add_request(rid, *batch[rid])
    steps = 0
    while engine.has_unfinished() or steps < 3:
        steps += 1
        assert steps < 500
        if steps == 3:
            for rid in [rid for rid in batch if rid in late]:
                engine.add_request(rid, *batch[rid])
        for out in engine.step():
            assert out.error is None, out.error
            seen = got[out.request_id]
            seen["tokens"] += out.new_token_ids
            seen["logprobs"] += [(t.token_id, t.logprob, t.top) for t in out.logprobs or []]
            seen["prompt"] = seen["prompt"] or out.prompt_logprobs
            seen["reason"] = out.finish_reason
            if out.request_id in cancel and len(seen["tokens"]) >= cancel[out.request_id]:
                engine.abort(out.request_id)
    assert not engine.requests and engine.scheduler.pages_used == 0
    return got


def same(got: dict, want: dict, ids) -> None:
    for rid in ids:
        assert got[rid]["tokens"] == want[rid]["tokens"], rid
        assert got[rid]["reason"] == want[rid]["reason"], rid
        for (t, lp, top), (t2, lp2, top2) in zip(got[rid]["logprobs"], want[rid]["logprobs"], strict=True):
            assert t == t2 and abs(lp - lp2) < 1e-5 and [i for i, _ in top] == [i for i, _ in top2], rid
        prompt, prompt2 = got[rid]["prompt"], want[rid]["prompt"]
        assert (prompt is None) == (prompt2 is None), rid
        for a, b in zip(prompt or (), prompt2 or (), strict=True):
            assert (a is None and b is None) or (
                a.token_id == b.token_id and abs(a.logprob - b.logprob) < 1e-5
            )


@pytest.fixture(scope="module")
def batch(llm):
    probe = serve(engine(llm, False), {"greedy": requests(llm.config.vocab_size, 0)["greedy"]})
    tokens = probe["greedy"]["tokens"]
    return requests(llm.config.vocab_size, stop_at=tokens[4]), tokens.index(tokens[4]) + 1


def test_async_output_is_the_synchronous_output(llm, batch):
    batch, stop_length = batch
    late = frozenset({"seeded", "shared-b", "n-1"})
    sync_engine, async_engine = engine(llm, False), engine(llm, True)
    want, got = serve(sync_engine, batch, late=late), serve(async_engine, batch, late=late)
    same(got, want, batch)
    assert got["stops"]["reason"] is FinishReason.STOP and len(got["stops"]["tokens"]) == stop_length
    assert len(got["to-max-len"]["tokens"]) == 9 and got["to-max-len"]["reason"] is FinishReason.LENGTH
    assert len(got["min-tokens"]["tokens"]) >= 6
    assert got["logprobs"]["prompt"] is not None and len(got["logprobs"]["logprobs"]) == 8
    for stats in (sync_engine.stats(), async_engine.stats()):  # the paths the batch is meant to take
        assert stats["preemptions"] > 0 and stats["prefix_cache_hits"] > 0
    assert async_engine.stats()["generated_tokens"] == sync_engine.stats()["generated_tokens"]


def test_a_cancelled_request_frees_everything_and_the_others_go_on(llm, batch):
    """Cancelled after 4 tokens: what it got is the start of its synchronous output (a step later
    under async scheduling, so it may hold one token more); the others are untouched."""
    keep = ["greedy", "seeded", "penalized", "logprobs"]
    sub = {rid: batch[0][rid] for rid in keep}
    cancel = {"greedy": 4, "penalized": 2}
    full = serve(engine(llm, False), sub)
    for async_scheduling in (False, True):
        got = serve(engine(llm, async_scheduling), sub, cancel=cancel)
        same(got, full, ["seeded", "logprobs"])
        for rid, n in cancel.items():
            assert got[rid]["tokens"] == full[rid]["tokens"][: len(got[rid]["tokens"])]
            assert n <= len(got[rid]["tokens"]) < len(full[rid]["tokens"])


def test_tokens_reach_the_host_one_step_later(llm, batch):
    """The first call only launches; every later call returns the step before's tokens while the
    next step runs; a request ended by a stop token drops the token sampled after it."""
    batch, stop_length = batch
    e = engine(llm, True)
    e.add_request("stops", *batch["stops"])
    assert e.step() == [] and e._in_flight is not None
    request = e.requests["stops"]
    assert request.pending == 1 and request.output == []
    outputs = e.step()
    assert [o.new_token_ids for o in outputs] == [request.output] and request.pending == 1
    while e.has_unfinished():
        e.step()
    assert request.status is Status.FINISHED and request.pending == 0
    assert request.finish_reason is FinishReason.STOP and len(request.output) == stop_length


def test_scheduler_runs_a_pending_token_and_stops_at_the_last_one():
    """Plain Python: a pending token is decoded next; a request whose pending token reaches
    max_tokens is not scheduled again; a preempted request waits for its pending token."""
    sched = Scheduler(num_pages=4, page_size=4, max_num_seqs=2, max_num_batched_tokens=16, max_len=32)
    a = Request("a", [1, 2, 3], SamplingParams(max_tokens=2))
    sched.add(a)
    (seg,) = sched.schedule()
    sched.advance([seg])
    a.pending += 1  # launched: its first token is on the device
    (seg,) = sched.schedule()
    assert (seg.start, seg.length, seg.samples) == (3, 1, True)
    sched.advance([seg])
    a.pending += 1  # its second and last token is pending too: nothing left to run
    assert sched.schedule() == []
    b = Request("b", list(range(9)), SamplingParams(max_tokens=4))
    b.pending, b.status = 1, Status.WAITING  # preempted while its token was on the device
    sched.waiting.append(b)
    assert sched.schedule() == [] and b.status is Status.WAITING
    b.pending, b.output = 0, [5]
    (seg,) = sched.schedule()
    assert seg.request is b and seg.length == 10
