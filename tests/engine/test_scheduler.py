"""The scheduler and page allocator, driven by a fake model (no JAX)."""

import collections
import itertools

import pytest

from jaxdsa.engine.allocator import PageAllocator
from jaxdsa.engine.request import FinishReason, Request, SamplingParams, Status
from jaxdsa.engine.scheduler import Scheduler

_ids = itertools.count()


def make(n_prompt, max_tokens, name=None):
    return Request(name or f"r{next(_ids)}", list(range(n_prompt)), SamplingParams(max_tokens=max_tokens))


def run_step(sched):
    """Schedule, 'run' the model, sample token 7 where due, finish at max_tokens. -> segments."""
    segments = sched.schedule()
    budget = sum(s.length for s in segments)
    assert budget <= sched.max_num_batched_tokens
    assert len({id(s.request) for s in segments}) == len(segments)
    sched.advance(segments)
    sampled = [s.request for s in segments if s.samples]
    for s in segments:
        assert len(s.request.pages) * sched.page_size >= s.request.num_computed  # its tokens have pages
    for r in sampled:
        r.output.append(7)
    sched.commit(segments)
    for r in sampled:
        if len(r.output) >= r.sampling.max_tokens:
            sched.finish(r, FinishReason.LENGTH)
    return segments


def drain(sched, limit=1000):
    steps = 0
    while sched.has_work():
        run_step(sched)
        steps += 1
        assert steps < limit, "scheduler made no progress"
    return steps


def test_allocator():
    a = PageAllocator(4)
    assert a.allocate(3) == [0, 1, 2] and a.num_free == 1
    assert a.allocate(2) is None and a.num_free == 1  # all or nothing
    a.free([1, 2])
    assert sorted(a.allocate(3)) == [1, 2, 3] and a.num_used == 4


def test_chunked_prefill_then_decode():
    sched = Scheduler(num_pages=16, page_size=4, max_num_seqs=4, max_num_batched_tokens=8)
    r = make(20, 3)
    sched.add(r)
    lengths = (
        [s.length for s in run_step(sched)]
        + [s.length for s in run_step(sched)]
        + [s.length for s in run_step(sched)]
    )
    assert lengths == [8, 8, 4]  # 20 prompt tokens in chunks under the 8-token budget
    assert r.output == [7]  # sampled after the last chunk only
    assert [s.length for s in run_step(sched)] == [1]  # then one token per decode step
    drain(sched)
    assert r.status is Status.FINISHED and r.output == [7, 7, 7]
    assert sched.allocator.num_used == 0


def test_decodes_and_prefill_chunks_share_a_step():
    sched = Scheduler(num_pages=32, page_size=4, max_num_seqs=4, max_num_batched_tokens=6)
    a, b = make(3, 5), make(10, 2)
    sched.add(a)
    run_step(sched)  # a prefilled and sampled
    sched.add(b)
    segs = run_step(sched)
    assert [(s.request, s.length) for s in segs] == [
        (a, 1),
        (b, 5),
    ]  # a's decode first, b's chunk fills the budget


def test_slots_limit_and_fcfs():
    sched = Scheduler(num_pages=64, page_size=4, max_num_seqs=2, max_num_batched_tokens=64)
    reqs = [make(5, 2) for _ in range(5)]
    for r in reqs:
        sched.add(r)
    segs = run_step(sched)
    assert [s.request for s in segs] == reqs[:2]
    assert list(sched.waiting) == reqs[2:]
    drain(sched)
    assert all(r.status is Status.FINISHED and len(r.output) == 2 for r in reqs)


def test_waiting_when_pages_run_out_then_admitted():
    sched = Scheduler(num_pages=4, page_size=4, max_num_seqs=4, max_num_batched_tokens=64)
    a, b = make(12, 2), make(8, 1)
    sched.add(a)
    sched.add(b)
    segs = run_step(sched)
    assert [s.request for s in segs] == [a] and b.status is Status.WAITING  # 3 + 2 pages > 4
    drain(sched)
    assert b.status is Status.FINISHED and b.output == [7]


def test_preemption_recomputes_and_loses_nothing():
    # 6 pages of 4 tokens: three requests that each grow to 12 tokens cannot all fit (9 pages).
    sched = Scheduler(num_pages=6, page_size=4, max_num_seqs=3, max_num_batched_tokens=64)
    reqs = [make(4, 8) for _ in range(3)]
    for r in reqs:
        sched.add(r)
    drain(sched)
    assert all(r.status is Status.FINISHED and len(r.output) == 8 for r in reqs)
    assert sum(r.num_preemptions for r in reqs) > 0
    assert reqs[0].num_preemptions == 0  # the oldest request is never the victim
    assert sched.allocator.num_used == 0 and sorted(sched._free_slots[0]) == [0, 1, 2]


def test_preempted_request_recomputes_prompt_and_output():
    sched = Scheduler(num_pages=5, page_size=4, max_num_seqs=2, max_num_batched_tokens=64)
    old, new = make(8, 6), make(7, 6)
    sched.add(old)
    sched.add(new)
    while new.num_preemptions == 0:
        run_step(sched)
    assert new.num_computed == 0 and new.pages == [] and new.status is Status.WAITING
    produced = len(new.output)
    drain(sched)
    assert new.output == [7] * 6 and produced >= 1


def test_abort_frees_pages_and_slot_at_once():
    sched = Scheduler(num_pages=8, page_size=4, max_num_seqs=2, max_num_batched_tokens=64)
    a, w = make(10, 50), make(3, 1)
    sched.add(a)
    run_step(sched)
    assert sched.allocator.num_used == 3
    sched.finish(a, FinishReason.ABORT)
    assert (
        sched.allocator.num_used == 0
        and a.status is Status.FINISHED
        and a.finish_reason is FinishReason.ABORT
    )
    sched.add(w)
    sched.finish(w, FinishReason.ABORT)  # still waiting: simply leaves the queue
    assert not sched.has_work()


@pytest.mark.parametrize("seed", range(5))
def test_random_load_completes(seed):
    import random

    rng = random.Random(seed)
    sched = Scheduler(num_pages=12, page_size=4, max_num_seqs=3, max_num_batched_tokens=10)
    reqs = []
    for _ in range(200):
        if rng.random() < 0.3 and len(reqs) < 25:
            reqs.append(make(rng.randint(1, 20), rng.randint(1, 12)))
            sched.add(reqs[-1])
        if sched.has_work():
            run_step(sched)
    drain(sched)
    assert all(r.status is Status.FINISHED and len(r.output) == r.sampling.max_tokens for r in reqs)
    assert sched.allocator.num_used == 0


# ---- prefix caching -------------------------------------------------------------------------------


def cached(n_pages=16, page_size=4, seqs=4, budget=64, groups=1):
    return Scheduler(
        num_pages=n_pages,
        page_size=page_size,
        max_num_seqs=seqs,
        max_num_batched_tokens=budget,
        groups=groups,
        prefix_caching=True,
    )


def request(tokens, max_tokens=1, name=None):
    return Request(name or f"r{next(_ids)}", list(tokens), SamplingParams(max_tokens=max_tokens))


def check_references(sched):
    """Each page's reference count is the number of running requests that hold it."""
    for g, a in enumerate(sched.allocators):
        held = collections.Counter(p for r in sched.running if sched.group_of(r) == g for p in r.pages)
        assert all(a._refs[p] == held[p] for p in range(a.num_pages))


def test_allocator_keeps_freed_full_pages_until_it_needs_them():
    a = PageAllocator(3)
    p0, p1 = a.allocate(2)
    b0 = a.register(-1, [1, 2], p0)
    b1 = a.register(b0, [3, 4], p1)
    assert a.register(-1, [1, 2], 2) == b0  # the same prefix again: the first page stays its home
    a.free([p0, p1])
    assert a.num_used == 0 and a.num_free == 3
    assert a.cached_prefix([1, 2, 3, 4, 5], 2, 2) == [(b0, p0), (b1, p1)]
    assert a.cached_prefix([1, 2, 9, 9], 2, 2) == [(b0, p0)]  # a key names the whole prefix
    assert a.cached_prefix([3, 4], 2, 1) == []  # [3, 4] after nothing is another key
    assert a.allocate(2) == [2, p1]  # the free page first, then a freed run's tail before its head
    assert a.cached_prefix([1, 2, 3, 4], 2, 2) == [(b0, p0)]


def test_a_shared_prefix_is_not_computed_again():
    sched = cached()
    a = request(range(10), max_tokens=3)
    sched.add(a)
    drain(sched)
    b = request([*range(9), 99, 5, 6], max_tokens=2)  # shares a's first two pages (8 tokens), then differs
    sched.add(b)
    (seg,) = run_step(sched)
    assert (seg.start, seg.length) == (8, 4) and b.pages[:2] == [0, 1]
    assert (sched.prefix_queried, sched.prefix_hit) == (10 + 12, 8)
    check_references(sched)
    drain(sched)
    assert sched.allocator.num_used == 0


def test_an_identical_prompt_recomputes_its_last_page_only():
    sched = cached()
    first, second = request(range(12)), request(range(12), max_tokens=2)
    sched.add(first)
    drain(sched)
    sched.add(second)
    (seg,) = run_step(sched)
    assert (seg.start, seg.length) == (8, 4)  # 12 tokens = 3 full pages; the last one runs to sample
    assert second.pages[:2] == first_pages_of(sched, range(8))


def first_pages_of(sched, tokens):
    return [
        page
        for _, page in sched.allocator.cached_prefix(
            list(tokens), sched.page_size, len(tokens) // sched.page_size
        )
    ]


def test_requests_running_together_share_pages_once_computed():
    sched = cached(budget=8)
    a = request(range(16), max_tokens=4)
    b = request([*range(16), 42], max_tokens=4)
    sched.add(a)
    run_step(sched)  # a's first 8 tokens: 2 pages registered
    sched.add(b)
    segs = run_step(sched)
    assert [(s.request, s.start) for s in segs] == [(a, 8)]  # a takes the whole budget
    segs = run_step(sched)  # a sampled; b admitted with a's 4 registered pages, runs its last token
    assert [(s.request, s.start, s.length) for s in segs] == [(a, 16, 1), (b, 16, 1)]
    assert b.pages[:4] == a.pages[:4]
    check_references(sched)
    assert sched.allocator.num_used == len(set(a.pages) | set(b.pages))
    drain(sched)
    assert sched.allocator.num_used == 0


def test_dp_admission_prefers_the_group_with_the_prefix():
    sched = cached(n_pages=16, seqs=4, groups=2)
    warm = request(range(12), max_tokens=2)
    sched.add(warm)
    run_step(sched)
    g = sched.group_of(warm)
    drain(sched)
    other = request(range(100, 112))  # nothing cached: would go to the emptier group
    again = request([*range(12), 7], max_tokens=2)
    sched.add(other)
    sched.add(again)
    run_step(sched)
    assert sched.group_of(again) == g and again.num_computed >= 12


@pytest.mark.parametrize("seed", range(5))
def test_random_load_with_shared_prefixes_completes(seed):
    import random

    rng = random.Random(seed)
    sched = cached(n_pages=12, seqs=3, budget=10)
    prefixes = [[rng.randrange(50) for _ in range(rng.randint(1, 12))] for _ in range(3)]
    reqs = []
    for _ in range(300):
        if rng.random() < 0.3 and len(reqs) < 30:
            tokens = rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randint(1, 8))]
            reqs.append(request(tokens, rng.randint(1, 12)))
            sched.add(reqs[-1])
        if sched.has_work():
            run_step(sched)
            check_references(sched)
    drain(sched)
    assert all(r.status is Status.FINISHED and len(r.output) == r.sampling.max_tokens for r in reqs)
    assert sched.allocator.num_used == 0 and sched.prefix_hit > 0


def test_a_restricted_step_holds_the_others_back_in_place():
    """``schedule(only=...)`` runs just those requests: running ones outside keep their pages,
    waiting ones their place in line, and an unrestricted step takes them all up again."""
    sched = Scheduler(num_pages=16, page_size=4, max_num_seqs=2, max_num_batched_tokens=32)
    a, b, c, d = (make(6, 4, name) for name in "abcd")
    for r in (a, b, c, d):
        sched.add(r)
    run_step(sched)  # a and b run; c and d wait
    pages = list(a.pages)
    assert [s.request for s in sched.schedule(only={b})] == [b]
    assert a.pages == pages and a.status is Status.RUNNING and list(sched.waiting) == [c, d]
    sched.finish(b, FinishReason.ABORT)
    assert [s.request for s in sched.schedule(only={d})] == [d]  # past c, which is held back
    assert list(sched.waiting) == [c]
    sched.finish(d, FinishReason.ABORT)
    assert [s.request for s in sched.schedule()] == [a, c]


def test_recompute_all_frees_every_page_and_forgets_cached_prefixes():
    sched = Scheduler(
        num_pages=16, page_size=4, max_num_seqs=3, max_num_batched_tokens=32, prefix_caching=True
    )
    first, second = make(9, 3, "first"), make(9, 3, "second")
    for r in (first, second):
        sched.add(r)
    run_step(sched)
    assert first.block_ids and sched.pages_used > 0
    sched.recompute_all()
    assert sched.pages_used == 0 and not sched.running and list(sched.waiting) == [first, second]
    assert first.num_computed == 0 and first.output == [7] and sched.num_preemptions == 2
    again = make(9, 3, "again")  # the same tokens: its first two pages would come from the cache
    sched.waiting.clear()
    sched.add(again)
    run_step(sched)
    assert sched.prefix_hit == 0 and again.num_computed == 9
