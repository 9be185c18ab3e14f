"""Continuous-batching scheduler: admission, chunked prefill and decode under a token budget.

Plain Python and unit-testable without JAX. Each step:
1. running requests (oldest first) continue: a decode takes one token, an unfinished prefill the
   next chunk; a request whose next page cannot be allocated preempts the newest running request
   (its pages are freed and it is recomputed later), never crashing or dropping a request;
2. waiting requests are admitted first-come-first-served while a decode slot, budget and pages
   for their first chunk are free.

With data parallelism the slots and pages are split into ``groups``: a request lives in one
group (its slot and all its pages come from that group), so each dp replica of the model sees
only its own sequences and pages.

With ``prefix_caching`` a request is admitted with the longest run of full pages its tokens share
with cached ones (:mod:`.allocator`), in the group that has the longest such run, and starts
computing after them; at least its last token always runs, so it has logits to sample from.
Every page that fills up with computed tokens is registered for later requests.

With speculative decoding a decoding request's segment also carries the drafts proposed for it
(as many as the budget leaves room for), and every sampling segment gets pages ``lookahead``
positions past its end for the drafts of the next step.

A step can be restricted to some requests (``schedule(only=...)``): the engine does this while it
looks for the request that breaks its steps (:mod:`.isolation`); the others keep their state.

Under async scheduling the next step is scheduled while the last one still runs: a request that
sampled in it has a *pending* token (:attr:`Request.pending`) whose value the host learns later.
The scheduler counts it as a token (its position is known) and decodes it next; a request whose
pending token is its last by length is not scheduled again, and a preempted one waits until its
pending token has arrived. :meth:`advance` moves a request's computed tokens on when its step is
launched, :meth:`commit` registers its filled pages once the step's results are in.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Collection

from jaxdsa.engine.allocator import PageAllocator
from jaxdsa.engine.request import FinishReason, Request, Status


@dataclasses.dataclass
class Segment:
    """Run ``request.tokens[start:start+length]``; sample after it if it reaches the end. With
    speculative decoding a decode segment also runs the request's ``drafts`` after its last token;
    the engine sets ``accepted`` to how many of them the step kept before :meth:`Scheduler.advance`.
    ``epoch`` is the request's preemption count when it was scheduled: a segment of a request
    preempted since then no longer describes its cache."""

    request: Request
    start: int
    length: int
    drafts: tuple[int, ...] = ()
    accepted: int = 0
    epoch: int = 0
    samples: bool = dataclasses.field(init=False)  # whether it reaches the request's end (as scheduled)

    def __post_init__(self):
        self.samples = self.start + self.length == self.request.num_tokens

    @property
    def num_run(self) -> int:
        """Tokens the step runs for this segment (and takes from the budget)."""
        return self.length + len(self.drafts)

    @property
    def current(self) -> bool:
        """Whether the request still runs on the cache this segment wrote (not finished, not
        preempted since it was scheduled)."""
        return self.request.status is Status.RUNNING and self.request.num_preemptions == self.epoch


class Scheduler:
    def __init__(
        self,
        *,
        num_pages: int,
        page_size: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        groups: int = 1,
        prefix_caching: bool = False,
        lookahead: int = 0,
        max_len: int | None = None,
    ):
        if max_num_seqs % groups or num_pages % groups:
            raise ValueError(
                f"max_num_seqs ({max_num_seqs}) and num_pages ({num_pages}) must split into {groups} groups"
            )
        self.page_size = page_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.groups = groups
        self.prefix_caching = prefix_caching
        # speculative decoding drafts past a sampling segment's last position: keep pages for that
        # many more positions (never past max_len, the longest a sequence may grow)
        self.lookahead, self.max_len = lookahead, max_len
        self.prefix_queried = 0  # tokens of admitted requests looked up in the prefix cache
        self.prefix_hit = 0  # of those, tokens found there (not computed again)
        self.num_preemptions = 0  # running requests sent back to wait (their pages recomputed later)
        self.slots_per_group = max_num_seqs // groups
        self.allocators = [PageAllocator(num_pages // groups) for _ in range(groups)]
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []
        self._free_slots = [
            list(range((g + 1) * self.slots_per_group - 1, g * self.slots_per_group - 1, -1))
            for g in range(groups)
        ]

    @property
    def allocator(self) -> PageAllocator:
        """The page pool when there is one group (tests and single-replica callers)."""
        assert self.groups == 1
        return self.allocators[0]

    @property
    def pages_used(self) -> int:
        return sum(a.num_used for a in self.allocators)

    @property
    def pages_total(self) -> int:
        return sum(a.num_pages for a in self.allocators)

    def group_of(self, request: Request) -> int:
        return request.slot // self.slots_per_group

    def global_pages(self, request: Request) -> list[int]:
        """The request's pages as numbered in the whole cache (its group's pages come after the
        groups before it; page tables hold group-local numbers)."""
        offset = self.group_of(request) * self.allocators[0].num_pages
        return [offset + page for page in request.pages]

    # -- queue management -------------------------------------------------------------------
    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def finish(self, request: Request, reason: FinishReason) -> None:
        """Mark finished and release its pages and slot at once (also for aborted requests)."""
        if request.status is Status.RUNNING:
            self.running.remove(request)
            self._release(request)
        elif request.status is Status.WAITING:
            self.waiting.remove(request)
        request.status, request.finish_reason = Status.FINISHED, reason

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # -- internals --------------------------------------------------------------------------
    def _release(self, request: Request) -> None:
        group = self.group_of(request)
        self.allocators[group].free(request.pages)
        request.pages, request.block_ids = [], []
        self._free_slots[group].append(request.slot)
        request.slot = None

    def _span(self, request: Request, start: int, n: int) -> int:
        """Positions a segment of ``n`` tokens (drafts included) from ``start`` needs pages for."""
        end = start + n
        if end >= request.num_tokens and self.lookahead:
            end = min(end + self.lookahead, self.max_len or end + self.lookahead)
        return end

    def _ends_pending(self, request: Request) -> bool:
        """Whether the request's pending token is its last: it reaches max_tokens or max_len."""
        return bool(request.pending) and (
            request.num_output >= request.sampling.max_tokens
            or (self.max_len is not None and request.num_tokens >= self.max_len)
        )

    def _pages_needed(self, request: Request, upto: int) -> int:
        return max(0, -(-upto // self.page_size) - len(request.pages))

    def _grow(self, request: Request, upto: int, group: int) -> bool:
        pages = self.allocators[group].allocate(self._pages_needed(request, upto))
        if pages is None:
            return False
        request.pages.extend(pages)
        return True

    def _admission(self, request: Request, budget: int) -> tuple[int, list[tuple[int, int]], int] | None:
        """(group, cached (block id, page) prefix, first chunk length) for a waiting request: the
        group with a free slot, the longest cached prefix, then the most free pages; None if that
        group cannot take the first chunk."""
        open_groups = [g for g in range(self.groups) if self._free_slots[g]]
        if not open_groups:
            return None
        # Prompt logprobs need every prompt token computed, as in vLLM: no cache hits for those.
        lookup = self.prefix_caching and request.sampling.prompt_logprobs is None
        max_pages = (request.num_tokens - 1) // self.page_size if lookup else 0
        hits = {
            g: self.allocators[g].cached_prefix(request.tokens, self.page_size, max_pages)
            for g in open_groups
        }
        g = max(open_groups, key=lambda g: (len(hits[g]), self.allocators[g].num_free))
        start = len(hits[g]) * self.page_size
        n = min(request.num_tokens - start, budget)
        new_pages = -(-self._span(request, start, n) // self.page_size) - len(hits[g])
        if not self.allocators[g].can_take(new_pages, shared=[page for _, page in hits[g]]):
            return None
        return g, hits[g], n

    def reserve(self, request: Request, num_computed: int) -> bool:
        """Hold a slot and pages for a request whose first ``num_computed`` tokens arrive computed
        from elsewhere (:mod:`.handoff`): pages for them and its next token, in the group with a
        free slot and the most free pages. False (nothing held) when no group can take it now."""
        open_groups = [g for g in range(self.groups) if self._free_slots[g]]
        if not open_groups:
            return False
        group = max(open_groups, key=lambda g: self.allocators[g].num_free)
        pages = self.allocators[group].allocate(-(-self._span(request, num_computed, 1) // self.page_size))
        if pages is None:
            return False
        request.pages, request.slot = pages, self._free_slots[group].pop()
        return True

    def seat(self, request: Request, num_computed: int) -> None:
        """Start running a :meth:`reserve`-d request whose cache now holds ``num_computed`` tokens."""
        request.num_computed, request.status = num_computed, Status.RUNNING
        self.running.append(request)

    def unreserve(self, request: Request) -> None:
        """Give back what :meth:`reserve` held for a request that will not run."""
        if request.slot is not None:
            self._release(request)

    def _preempt(self, victim: Request) -> None:
        self.running.remove(victim)
        self._release(victim)
        victim.num_computed = 0
        victim.draft = []
        victim.status = Status.WAITING
        victim.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(victim)

    def recompute_all(self) -> None:
        """Send every running request back to wait, to be recomputed from its tokens, and forget the
        prefix cache: for when the cache contents are lost (a failed step consumed them). The
        oldest request stays first in line."""
        for request in reversed(self.running):
            self._preempt(request)
        self.allocators = [PageAllocator(a.num_pages) for a in self.allocators]

    # -- the step -------------------------------------------------------------------------------
    def schedule(self, only: Collection[Request] | None = None) -> list[Segment]:
        """The next step's segments; with ``only``, just those requests run (the others keep their
        place: running ones their pages unless preempted, waiting ones their turn)."""
        budget = self.max_num_batched_tokens
        segments: list[Segment] = []
        scheduled: set[int] = set()
        for request in list(self.running):
            if budget == 0:
                break
            if request.status is not Status.RUNNING or (only is not None and request not in only):
                continue  # preempted earlier in this loop, or held back
            if self._ends_pending(request):
                continue  # its pending token ends it: nothing left to run
            n = min(request.remaining, budget)
            drafts = tuple(request.draft[: budget - 1]) if request.remaining == 1 else ()
            span = self._span(request, request.num_computed, n + len(drafts))
            group = self.group_of(request)
            while not self._grow(request, span, group):
                victim = next(
                    (
                        r
                        for r in reversed(self.running)
                        if id(r) not in scheduled and self.group_of(r) == group
                    ),
                    None,
                )
                if victim is None:
                    break
                self._preempt(victim)
                if victim is request:
                    break
            if request.status is not Status.RUNNING or self._pages_needed(request, span):
                continue
            segments.append(Segment(request, request.num_computed, n, drafts, epoch=request.num_preemptions))
            scheduled.add(id(request))
            budget -= n + len(drafts)
        for request in [r for r in self.waiting if only is None or r in only]:
            if budget == 0 or request.pending:
                break  # a preempted request waits for its pending token (first come, first served)
            admission = self._admission(request, budget)
            if admission is None:
                break  # first come, first served: do not let later requests overtake
            group, hits, n = admission
            self.allocators[group].share([page for _, page in hits])
            request.block_ids, request.pages = [b for b, _ in hits], [page for _, page in hits]
            request.num_computed = len(hits) * self.page_size
            self.prefix_queried += request.num_tokens
            self.prefix_hit += request.num_computed
            self._grow(request, self._span(request, request.num_computed, n), group)
            self.waiting.remove(request)
            request.slot = self._free_slots[group].pop()
            request.status = Status.RUNNING
            self.running.append(request)
            segments.append(Segment(request, request.num_computed, n, epoch=request.num_preemptions))
            budget -= n
        return segments

    def advance(self, segments: list[Segment]) -> None:
        """A step holding these segments was launched: their tokens (and the drafts it accepted,
        which the engine has then appended to the output) count as computed from now on."""
        for s in segments:
            if s.current:
                s.request.num_computed = s.start + s.length + s.accepted

    def commit(self, segments: list[Segment]) -> None:
        """Pages the segments filled join the prefix cache once every token in them is known: at
        launch for prompt chunks (a later step that shares them runs after this one on the device),
        at the step's results for a page a pending token completes. Idempotent."""
        if self.prefix_caching:
            for s in segments:
                if s.current:
                    self._register_full_pages(s.request)

    def _register_full_pages(self, request: Request) -> None:
        size = self.page_size
        full = min(request.num_computed, len(request.prompt) + len(request.output)) // size
        if full <= len(request.block_ids):
            return  # no page filled up (most decode steps): skip building the token list
        allocator, tokens = self.allocators[self.group_of(request)], request.tokens
        for i in range(len(request.block_ids), full):
            parent = request.block_ids[-1] if request.block_ids else -1
            request.block_ids.append(
                allocator.register(parent, tokens[i * size : (i + 1) * size], request.pages[i])
            )
