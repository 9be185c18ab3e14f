"""The continuous-batching engine: requests in, tokens out, one model step at a time.

``Engine.step()`` asks the scheduler for a batch (decodes plus prefill chunks under a token
budget), launches it on the device, and processes the tokens of the step before it: they join
their requests' outputs, stop conditions apply, finished requests free their pages. It is
single-threaded; :class:`jaxdsa.engine.async_engine.AsyncEngine` drives it from a background
thread for the HTTP server.

**Async scheduling** (``EngineConfig.async_scheduling``, on by default as vLLM's
``--async-scheduling``): step N + 1 is scheduled, packed and launched while step N still runs, so
the device never waits for the host between steps. The tokens step N samples stay on the device
and feed step N + 1 there (:mod:`jaxdsa.engine.step`); the host learns them one call later, so
outputs, stop conditions and the end of a request lag one step, and a request that ended in step
N drops the token step N + 1 sampled for it. Every request's tokens are those of synchronous
scheduling: a step's inputs, positions, seeds and penalties do not depend on when the host
learns them. Steps run synchronously under speculative decoding (how many drafts a verify step
keeps decides the next step's positions) and while a failing request is being isolated.

One request never fails another: ``add_request`` rejects inputs the step cannot represent, and
a step that raises anyway commits nothing; the engine then finds the request(s) that break it
(:mod:`.isolation`) and fails only those, with a ``FinishReason.ERROR`` output. The step donates
the cache to the device, so a failure after the step started leaves every running request's
pages unknown: those requests are then recomputed from their tokens, as after a preemption (and
a step launched behind it is abandoned, its tokens sampled again).

Prefill-decode disaggregation (:mod:`.handoff`): a request added with ``export`` samples its one
token here and leaves with its cache's rows (``RequestOutput.cache_image``); one added with a
``source`` waits for pages, has its image moved in and goes on decoding from its first token, as
if its prompt had run here.

With speculative decoding (``EngineConfig.speculative``) a decode step also verifies the tokens the
model's next-n layers drafted in the step before and emits several tokens per request: they join
the output one at a time, each checked against the stop conditions, and the scheduler counts the
accepted drafts as computed (:mod:`jaxdsa.engine.speculative`, ``docs/serving.md``).
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import logging
import operator
import os
import time
from collections.abc import Callable, Iterable

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from jaxdsa import sharding
from jaxdsa.cache import CacheSpec, init_cache, kv_cache_format
from jaxdsa.engine import memory, penalties
from jaxdsa.engine.config import EngineConfig
from jaxdsa.engine.handoff import CacheImage, CacheMover, ImageSource, check_layout
from jaxdsa.engine.isolation import Quarantine
from jaxdsa.engine.request import (
    MAX_BANNED_TOKENS,
    FinishReason,
    Request,
    RequestOutput,
    SamplingParams,
    Status,
    TokenLogprobs,
)
from jaxdsa.engine.runner import InFlight, ModelRunner, StepResult
from jaxdsa.engine.sampling import Scored
from jaxdsa.engine.scheduler import Scheduler, Segment
from jaxdsa.progress import Progress

log = logging.getLogger(__name__)

SEED_MASK = 0x7FFFFFFF  # request seeds are reduced to the sampler's width: 31 bits, non-negative
# Each engine step is one range of this name in a jax.profiler trace (benchmarks.anatomy finds the
# kernels each step launched by it); outside a trace the annotation costs about a microsecond.
STEP_MARK = "jaxdsa.engine.step"


def enable_compilation_cache() -> None:
    """JAX's persistent compilation cache, on unless JAXDSA_COMPILATION_CACHE=0, so restarts are fast."""
    if os.environ.get("JAXDSA_COMPILATION_CACHE", "1") == "0" or jax.config.jax_compilation_cache_dir:
        return
    directory = os.environ.get(
        "JAXDSA_CACHE_DIR", os.path.join(os.path.expanduser("~"), ".cache", "jaxdsa", "xla")
    )
    os.makedirs(directory, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", directory)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)


@dataclasses.dataclass(frozen=True)
class CacheLayout:
    """What an engine's cache takes on one device: ``specs`` (the main cache, then the next-n
    layers' when drafting) at ``page_size`` tokens a page, each sequence up to ``max_model_len``,
    ``slots`` sequences per dp group with ``lookahead`` spare ring rows for drafts; ``shards``: how
    many pieces a logical axis is cut into on the mesh (:func:`jaxdsa.sharding.mesh_shards`: entries
    split over TP, GLM-5.3-Flash's KDA states, count their device's part)."""

    specs: tuple[CacheSpec, ...]
    kv_format: str  # 'model' or 'fp8'
    dtype: object
    page_size: int
    max_model_len: int
    slots: int
    lookahead: int
    vocab_size: int
    shards: Callable[[str], int] | None = None

    @classmethod
    def of(cls, family, cfg, config: EngineConfig, dtype, mesh: Mesh | None) -> CacheLayout:
        """The layout ``config`` gives on ``mesh`` (its page size and max_model_len resolved for the
        family)."""
        max_model_len = config.max_model_len or min(cfg.max_position_embeddings, 8192)
        if max_model_len > cfg.max_position_embeddings:
            raise ValueError(
                f"max_model_len {max_model_len} > max_position_embeddings {cfg.max_position_embeddings}"
            )
        num_spec = config.speculative.num_speculative_tokens if config.speculative else 0
        kv_format = kv_cache_format(config.kv_cache_dtype, dtype)
        specs = (family.cache_spec(cfg, kv_format),)
        if num_spec:
            specs += (family.mtp_cache_spec(cfg, kv_format),)
        return cls(
            specs,
            kv_format,
            dtype,
            family.page_size(cfg, config.page_size),
            max_model_len,
            config.max_num_seqs // sharding.dp_groups(mesh),
            num_spec,  # ring rows past a sequence's last verified position: its drafts (jaxdsa.cache)
            cfg.vocab_size,
            sharding.mesh_shards(mesh),
        )

    @property
    def page_bytes(self) -> int:
        return sum(s.page_bytes(self.dtype, self.page_size, self.shards) for s in self.specs)

    @property
    def pages_per_sequence(self) -> int:
        return -(-self.max_model_len // self.page_size)

    @property
    def state_bytes(self) -> int:
        """Per device, what the engine holds besides the pages: its slots' rings and penalty rows."""
        rings = sum(s.sequence_bytes(self.dtype, self.lookahead, self.shards) for s in self.specs)
        return self.slots * (rings + self.vocab_size * penalties.BYTES_PER_ENTRY)

    @property
    def minimum_bytes(self) -> int:
        """Per device, the cache of one full-length sequence and the engine's state."""
        return self.pages_per_sequence * self.page_bytes + self.state_bytes


@dataclasses.dataclass
class _Launched:
    """A step on the device whose tokens the host has not read."""

    segments: list[Segment]
    flight: InFlight
    running_before: set[Request]  # the running requests when it was scheduled (newest: the others)
    advanced: bool  # its segments already count as computed (async scheduling)


class Engine:
    """Serves requests on ``model`` (a module of ``family``, config ``cfg``)."""

    def __init__(
        self,
        family,
        cfg,
        model: nnx.Module,
        *,
        dtype=jnp.bfloat16,
        eos_token_ids=(),
        config: EngineConfig = EngineConfig(),
        mesh=None,
        precision=None,
    ):
        enable_compilation_cache()
        prefix_caching = config.enable_prefix_caching and family.prefix_caching(cfg)
        if config.enable_prefix_caching and not prefix_caching:
            log.warning(
                "prefix caching is off: this model's cache keeps per-sequence state its pages do not hold"
            )
        config = dataclasses.replace(
            config, page_size=family.page_size(cfg, config.page_size), enable_prefix_caching=prefix_caching
        )
        memory.check_utilization(config.gpu_memory_utilization)
        groups = sharding.dp_groups(mesh)
        layout = CacheLayout.of(family, cfg, config, dtype, mesh)
        self.cfg, self.config, self.max_model_len = cfg, config, layout.max_model_len
        self.eos_token_ids = frozenset(eos_token_ids)
        self.num_spec = layout.lookahead
        if self.num_spec and not len(getattr(model, "mtp", ())):
            raise ValueError(
                "speculative decoding with method 'mtp' drafts with the checkpoint's next-n (MTP) layers, "
                "and this model has none loaded (the checkpoint ships no MTP weights)"
            )
        num_pages = config.num_pages or memory.cache_pages(
            memory.device_memory(config.gpu_memory_utilization),
            page_bytes=layout.page_bytes,
            state_bytes=layout.state_bytes,
            per_sequence_pages=layout.pages_per_sequence,
            groups=groups,
            enough=layout.pages_per_sequence * config.max_num_seqs,
        )
        num_pages -= num_pages % groups
        if num_pages // groups * config.page_size < self.max_model_len:
            raise ValueError(
                f"{num_pages} pages of {config.page_size} in {groups} group(s) "
                f"cannot hold one {self.max_model_len}-token sequence"
            )
        self.scheduler = Scheduler(
            num_pages=num_pages,
            page_size=config.page_size,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            groups=groups,
            prefix_caching=config.enable_prefix_caching,
            lookahead=max(self.num_spec - 1, 0),
            max_len=self.max_model_len,
        )

        home = None if mesh is not None else jax.tree.leaves(nnx.state(model))[0].sharding  # see ModelRunner

        def new_caches() -> list:  # the main cache, then the next-n layers' (same pages)
            return [
                init_cache(
                    spec,
                    num_pages,
                    config.page_size,
                    dtype,
                    num_seqs=config.max_num_seqs,
                    lookahead=layout.lookahead,
                    sharding=home
                    if mesh is None
                    else {k: NamedSharding(mesh, sharding.spec(a)) for k, a in spec.axes().items()},
                )
                for spec in layout.specs
            ]

        self._new_caches = new_caches
        cache, *mtp_cache = new_caches()
        self.runner = ModelRunner(
            family,
            cfg,
            model,
            cache,
            page_size=config.page_size,
            max_num_seqs=config.max_num_seqs,
            max_model_len=self.max_model_len,
            max_num_batched_tokens=config.max_num_batched_tokens,
            groups=groups,
            max_logprobs=config.max_logprobs,
            mesh=mesh,
            precision=precision,
            num_spec=self.num_spec,
            mtp_cache=mtp_cache[0] if mtp_cache else None,
            kv_format=layout.kv_format,
        )
        self._mover = CacheMover(layout.specs, config.page_size)
        self._exports: set[str] = set()  # requests whose cache leaves with their first token
        self._arriving: collections.deque[tuple[Request, ImageSource]] = collections.deque()  # no pages yet
        self._receiving: dict[str, tuple[Request, ImageSource]] = {}  # pages held, image on its way
        self.requests: dict[str, Request] = {}
        self._seeds: dict[str, int] = {}
        self._want_logits: set[str] = set()
        self._prompt_logprobs: dict[str, list[TokenLogprobs | None]] = {}  # filled while the prompt runs
        self._quarantine = Quarantine()
        self._in_flight: _Launched | None = None  # the step launched last, not yet read (async)
        self.num_generated_tokens = 0
        self.num_failed_steps = 0
        self.num_drafts = 0  # verify steps that tested at least one draft
        self.num_draft_tokens = 0
        self.accepted_per_position = [0] * self.num_spec  # drafts accepted at each draft position

    # -- requests ------------------------------------------------------------------------------
    def check(self, prompt: list[int], sampling: SamplingParams) -> None:
        """Raise ValueError if the request can never run, or holds a number the step cannot
        represent (callers may check before queueing; ``add_request`` always does)."""
        if not prompt:
            raise ValueError("the prompt is empty")
        vocab = self.cfg.vocab_size
        _check_token_ids(prompt, vocab, "prompt token ids")
        _check_token_ids(sampling.stop_token_ids, vocab, "stop_token_ids")
        _check_token_ids((t for t, _ in sampling.logit_bias), vocab, "logit_bias token ids")
        for name in ("max_tokens", "min_tokens", "top_k"):
            _integer(getattr(sampling, name), name)
        if sampling.seed is not None:
            _integer(sampling.seed, "seed")
        for name in ("logprobs", "prompt_logprobs"):
            n = getattr(sampling, name)
            if n is not None and n > self.config.max_logprobs:
                raise ValueError(f"{name} {n} exceeds the server's max_logprobs {self.config.max_logprobs}")
        if sampling.min_tokens and len(sampling.stop_ids(self.eos_token_ids)) > MAX_BANNED_TOKENS:
            raise ValueError(f"min_tokens holds back at most {MAX_BANNED_TOKENS} EOS and stop token ids")
        if len(prompt) + sampling.max_tokens > self.max_model_len:
            raise ValueError(
                f"prompt ({len(prompt)} tokens) + max_tokens ({sampling.max_tokens}) "
                f"exceeds max_model_len {self.max_model_len}"
            )

    def add_request(
        self,
        request_id: str,
        prompt: list[int],
        sampling: SamplingParams,
        *,
        return_logits: bool = False,
        export: bool = False,
        source: ImageSource | None = None,
    ) -> None:
        """Queue a request; raises ValueError (and queues nothing) for one that cannot run.
        ``export``: it samples one token and its output carries its cache image; ``source``: its
        prompt was computed elsewhere and its image comes from there (:mod:`.handoff`)."""
        if request_id in self.requests:
            raise ValueError(f"duplicate request id {request_id!r}")
        self.check(prompt, sampling)
        if export and sampling.max_tokens != 1:
            raise ValueError("a request whose cache goes to a decode server samples one token (max_tokens 1)")
        if source is not None:
            if sampling.prompt_logprobs is not None:
                raise ValueError("prompt logprobs need the prompt computed on this server, not handed over")
            check_layout(self._mover.layout(self._caches(), len(prompt)), source.layout)
        if sampling.top_k >= self.cfg.vocab_size:  # keeps every token: off, as vLLM takes it
            sampling = dataclasses.replace(sampling, top_k=0)
        request = Request(request_id, [int(t) for t in prompt], sampling)
        seed = sampling.seed if sampling.seed is not None else self._derived_seed(request_id)
        self._seeds[request_id] = seed & SEED_MASK
        if return_logits:
            self._want_logits.add(request_id)
        if sampling.prompt_logprobs is not None:
            self._prompt_logprobs[request_id] = [None] * len(prompt)  # the first token has none
        self.requests[request_id] = request
        if export:
            self._exports.add(request_id)
        if source is None:
            self.scheduler.add(request)
        else:
            self._arriving.append((request, source))

    def _caches(self) -> list:
        """The caches a request's rows live in: the main one, then the next-n layers' when drafting."""
        return [self.runner.cache, self.runner.mtp_cache] if self.num_spec else [self.runner.cache]

    def _derived_seed(self, request_id: str) -> int:
        digest = hashlib.blake2b(f"{self.config.seed}:{request_id}".encode(), digest_size=4).digest()
        return int.from_bytes(digest, "little")

    def abort(self, request_id: str) -> None:
        """Cancel a request; its pages and slot are freed at once. Unknown ids are ignored."""
        request = self.requests.pop(request_id, None)
        if request is not None and self._stop_handoff(request):
            request.status, request.finish_reason = Status.FINISHED, FinishReason.ABORT
        elif request is not None and request.status is not Status.FINISHED:
            self.scheduler.finish(request, FinishReason.ABORT)
        self._forget(request_id)

    def _stop_handoff(self, request: Request) -> bool:
        """Drop a request still waiting for its image (its transfer cancelled, its pages given
        back); False if it is not one."""
        if request.request_id in self._receiving:
            _, source = self._receiving.pop(request.request_id)
            source.cancel()
            self.scheduler.unreserve(request)
            return True
        arriving = [entry for entry in self._arriving if entry[0] is request]
        for entry in arriving:
            self._arriving.remove(entry)
        return bool(arriving)

    def _forget(self, request_id: str) -> None:
        self._exports.discard(request_id)
        self.requests.pop(request_id, None)
        self._seeds.pop(request_id, None)
        self._want_logits.discard(request_id)
        self._prompt_logprobs.pop(request_id, None)

    def has_unfinished(self) -> bool:
        """Whether a request still runs or waits, or a launched step's tokens are still to come."""
        return (
            self.scheduler.has_work()
            or self._in_flight is not None
            or bool(self._arriving or self._receiving)
        )

    # -- stepping ------------------------------------------------------------------------------
    def _stop_reason(self, request: Request, n: int) -> FinishReason | None:
        """Why the request ends after its first ``n`` output tokens, if it does."""
        token, sp = request.output[n - 1], request.sampling
        stop = (
            token in self.eos_token_ids and not sp.ignore_eos
        ) or token in sp.stop_token_ids  # no set per token
        if stop and n >= sp.min_tokens:
            return FinishReason.STOP
        if n >= sp.max_tokens or len(request.prompt) + n >= self.max_model_len:
            return FinishReason.LENGTH
        return None

    def _banned(self, segments: list[Segment]) -> dict[str, frozenset[int]]:
        """Per sampling request still under its min_tokens: the stop tokens it must not emit (the
        runner bans them at the verify positions still under min_tokens)."""
        return {
            s.request.request_id: s.request.sampling.stop_ids(self.eos_token_ids)
            for s in segments
            if s.samples and s.request.num_output < s.request.sampling.min_tokens
        }

    def _draft_room(self, request: Request) -> int:
        """Drafts the next step may verify: each accepted one is an output token, and one more comes
        after them, so they stop short of max_tokens and max_model_len. Requests that return
        their logits emit one token per step (one logits row per output)."""
        if request.request_id in self._want_logits:
            return 0
        room = min(request.sampling.max_tokens - len(request.output), self.max_model_len - request.num_tokens)
        return max(0, min(self.num_spec, room - 1))

    def step(self) -> list[RequestOutput]:
        """Run one step. Returns an output per request whose tokens arrived, or that the engine
        failed: under async scheduling, those of the step the call before launched."""
        arrived = self._receive() if self._arriving or self._receiving else []
        with jax.profiler.TraceAnnotation(STEP_MARK):
            if self.config.async_scheduling and not self.num_spec and self._quarantine.under_test() is None:
                return arrived + self._step_async()
            return arrived + self._resolve() + self._step_sync()

    def _receive(self) -> list[RequestOutput]:
        """Handed-over requests: hold pages for the waiting ones as they fit (first come, first
        served) and start their transfers; seat those whose image has arrived, emitting their first
        token. A transfer that fails fails its request only. Waits a millisecond when nothing else
        would run, so an engine waiting only for transfers does not spin."""
        outputs = []
        while self._arriving and self.scheduler.reserve(
            self._arriving[0][0], len(self._arriving[0][0].prompt)
        ):
            request, source = self._arriving.popleft()
            self._receiving[request.request_id] = (request, source)
            try:
                source.start()
            except Exception as error:  # a transfer that cannot start fails its request only
                outputs.append(self._handoff_failed(request, error))
        for request, source in list(self._receiving.values()):
            try:
                image = source.poll()
                if image is not None:
                    self._seat_image(request, image)
                    outputs.append(self._first_output(request, image))
            except Exception as error:  # a failed transfer fails its request only
                outputs.append(self._handoff_failed(request, error))
        if not outputs and not self.scheduler.has_work() and self._in_flight is None:
            time.sleep(0.001)
        return outputs

    def _handoff_failed(self, request: Request, error: Exception) -> RequestOutput:
        log.warning("request %s: its cache did not arrive: %s", request.request_id, error)
        self._stop_handoff(request)
        request.status, request.finish_reason = Status.FINISHED, FinishReason.ERROR
        self._forget(request.request_id)
        return RequestOutput(
            request.request_id,
            [],
            True,
            FinishReason.ERROR,
            len(request.prompt),
            0,
            error=f"the prefill server's cache did not arrive: {error}",
        )

    def _seat_image(self, request: Request, image: CacheImage) -> None:
        """Write a request's arrived image into the pages and slot it holds and start decoding."""
        pages = self.scheduler.global_pages(request)
        caches = self._mover.load(self._caches(), image, pages, request.slot)
        self.runner.cache = caches[0]
        if self.num_spec:
            self.runner.mtp_cache = caches[1]
        del self._receiving[request.request_id]
        request.output = [image.first_token]
        self.scheduler.seat(request, len(request.prompt))

    def _first_output(self, request: Request, image: CacheImage) -> RequestOutput:
        """The output of a seated request's first token (sampled by the prefill side)."""
        reason = self._stop_reason(request, 1)
        if reason is not None:
            self.scheduler.finish(request, reason)
            self._forget(request.request_id)
        self.num_generated_tokens += 1
        wanted = request.sampling.logprobs is not None and image.first_logprobs is not None
        return RequestOutput(
            request.request_id,
            [image.first_token],
            reason is not None,
            reason,
            len(request.prompt),
            1,
            logprobs=[image.first_logprobs] if wanted else None,
        )

    def _step_sync(self) -> list[RequestOutput]:
        under_test = self._quarantine.under_test()
        running_before = set(self.scheduler.running)
        segments = self.scheduler.schedule(only=under_test)
        if not segments and under_test is not None:
            segments = self.scheduler.schedule()  # the suspects cannot run now: let the others
        if not segments:
            return []
        cache_before = self.runner.cache
        try:
            result = self.runner.fetch(self._launch(segments))
        except Exception as error:  # whatever raised, only the request(s) behind it fail
            return self._step_failed(segments, running_before, error, cache_before=cache_before)
        return self._finish_step(segments, result, advanced=False)

    def _step_async(self) -> list[RequestOutput]:
        """Launch the next step, then read the one before it: the device runs the new step while
        the host reads and processes the old one's tokens."""
        running_before = set(self.scheduler.running)
        segments = self.scheduler.schedule()
        launched, failure = None, None
        if segments:
            cache_before = self.runner.cache
            try:
                flight = self._launch(segments)
            except Exception as error:  # failed before its tokens were pending: handled once the
                failure = (segments, running_before, error, cache_before)  # step before is read
            else:
                self.scheduler.advance(segments)
                self.scheduler.commit(segments)  # pages it fills with known tokens: shareable at once
                for s in segments:
                    s.request.pending += s.samples
                launched = _Launched(segments, flight, running_before, advanced=True)
        outputs = self._resolve(next_step=launched)
        if failure is not None:
            segments, running_before, error, cache_before = failure
            outputs += self._step_failed(segments, running_before, error, cache_before=cache_before)
        return outputs

    def _launch(self, segments: list[Segment]) -> InFlight:
        sampling = [s for s in segments if s.samples]
        score = frozenset(
            s.request.request_id for s in segments if s.request.request_id in self._prompt_logprobs
        )
        return self.runner.launch(
            segments,
            self._seeds,
            with_logits=any(s.request.request_id in self._want_logits for s in sampling),
            with_logprobs=any(s.request.sampling.logprobs is not None for s in sampling),
            score=score,
            banned=self._banned(segments),
        )

    def _resolve(self, next_step: _Launched | None = None) -> list[RequestOutput]:
        """Read the step in flight, if any, and make ``next_step`` (launched after it) the one in
        flight. If reading fails, the device state both steps built on is lost: ``next_step`` is
        abandoned with it."""
        launched, self._in_flight = self._in_flight, next_step
        if launched is None:
            return []
        try:
            result = self.runner.fetch(launched.flight)
        except Exception as error:
            self._abandon_in_flight()
            return self._step_failed(launched.segments, launched.running_before, error, cache_before=None)
        return self._finish_step(launched.segments, result, advanced=launched.advanced)

    def _abandon_in_flight(self) -> None:
        """Forget the step in flight (its device work is waited out, its results never read): the
        pending tokens it and the step before were to sample are drawn again when their requests
        are recomputed."""
        launched, self._in_flight = self._in_flight, None
        if launched is not None:
            try:
                jax.block_until_ready(launched.flight.sampled)
            except Exception:  # the step failed too: its buffers are gone either way
                pass
        for request in self.requests.values():
            request.pending = 0

    def _finish_step(
        self, segments: list[Segment], result: StepResult, *, advanced: bool
    ) -> list[RequestOutput]:
        """A step's results are in: tokens join their requests (unless they ended meanwhile: a
        request that finished or was aborted while the step ran drops its token), pages filled
        join the prefix cache, stop conditions end requests."""
        for s, scored in zip(segments, result.scores or ()):
            if scored is not None and s.request.request_id in self._prompt_logprobs:
                self._record_prompt_logprobs(s, scored)
        sampling = [s for s in segments if s.samples]
        for i, s in enumerate(sampling):  # emitted tokens join the output before commit registers pages
            if advanced:
                s.request.pending -= 1
            if s.request.status is Status.FINISHED:
                continue
            n = int(result.num_emitted[i])
            s.accepted = n - 1
            s.request.output += result.ids[i, :n].tolist()
            self._count_drafts(s)
        if not advanced:
            self.scheduler.advance(segments)
        self.scheduler.commit(segments)
        outputs = []
        for i, s in enumerate(sampling):
            request, emitted = s.request, int(result.num_emitted[i])
            if request.status is Status.FINISHED:
                continue
            first = len(request.output) - emitted
            reason = None
            for n in range(first + 1, len(request.output) + 1):
                reason = self._stop_reason(request, n)
                if reason is not None:
                    del request.output[n:]  # accepted past the stop: dropped, as if never sampled
                    break
            new = len(request.output) - first
            self.num_generated_tokens += new
            wants_logits = request.request_id in self._want_logits
            prompt_logprobs = self._prompt_logprobs.pop(
                request.request_id, None
            )  # complete at the first sample
            logprobs = _token_logprobs(result, i, new, request.sampling.logprobs)
            image, error = None, None
            if reason is not None:
                if request.request_id in self._exports:
                    image, error = self._export(request, logprobs[0] if logprobs else None)
                    reason = FinishReason.ERROR if error else reason
                self.scheduler.finish(request, reason)
                self._forget(request.request_id)
            else:
                request.draft = result.drafts[i, : self._draft_room(request)].tolist()
            outputs.append(
                RequestOutput(
                    request.request_id,
                    request.output[first:],
                    reason is not None,
                    reason,
                    len(request.prompt),
                    len(request.output),
                    logits=result.logits[i, 0] if wants_logits else None,
                    logprobs=logprobs,
                    prompt_logprobs=prompt_logprobs,
                    error=error,
                    cache_image=image,
                )
            )
        return outputs

    def _export(self, request: Request, first_logprobs) -> tuple[CacheImage | None, str | None]:
        """An exported request's image as it ends, or why there is none (that request fails alone)."""
        try:
            pages = self.scheduler.global_pages(request)
            args = (request.slot, request.num_computed, request.output[0], first_logprobs)
            return self._mover.export(self._caches(), pages, *args), None
        except Exception as error:  # a gather that fails fails its request only
            log.exception("request %s: gathering its cache for the decode server failed", request.request_id)
            return None, f"gathering the request's cache for the decode server failed: {error}"

    def _count_drafts(self, s: Segment) -> None:
        if s.drafts:
            self.num_drafts += 1
            self.num_draft_tokens += len(s.drafts)
            for j in range(s.accepted):
                self.accepted_per_position[j] += 1

    def _step_failed(
        self, segments: list[Segment], running_before: set[Request], error: Exception, *, cache_before
    ) -> list[RequestOutput]:
        """A step raised and committed nothing: restore the device state, then fail the request it
        was narrowed down to, or test the step's requests in groups (:class:`.Quarantine`).
        ``cache_before``: the cache the step started from (None: lost whatever happened to it)."""
        self.num_failed_steps += 1
        requests = list(
            {id(s.request): s.request for s in segments if s.request.status is not Status.FINISHED}.values()
        )
        log.warning(
            "engine step over %d request(s) failed (%s: %s); isolating the cause",
            len(requests),
            type(error).__name__,
            error,
        )
        self._restore_device_state(cache_before)
        culprit = self._quarantine.step_failed(requests, [r for r in requests if r not in running_before])
        if culprit is None:
            return []
        log.error("request %s fails the engine step on its own; failing it", culprit.request_id)
        self.scheduler.finish(culprit, FinishReason.ERROR)
        self._forget(culprit.request_id)
        message = f"the engine step failed for this request ({type(error).__name__}: {error})"
        return [
            RequestOutput(
                culprit.request_id,
                [],
                True,
                FinishReason.ERROR,
                len(culprit.prompt),
                len(culprit.output),
                error=message,
            )
        ]

    def _restore_device_state(self, cache_before) -> None:
        """After a failed step: penalty rows and slot tokens are refilled (the step may have
        counted tokens in them or consumed them), and if the cache went to the device (donated, so
        its buffers are gone or hold a half-run step), a fresh one replaces it and every running
        request is recomputed from its tokens; cached prefixes go too, since their pages went with
        it."""
        self.runner.reset_step_state()
        cache = (self.runner.cache, self.runner.mtp_cache)
        if cache[0] is cache_before and not any(a.is_deleted() for a in jax.tree.leaves(cache)):
            return
        log.warning(
            "the failed step consumed the cache: recomputing %d request(s)", len(self.scheduler.running)
        )
        for a in jax.tree.leaves((cache_before, cache)):
            if not a.is_deleted():
                a.delete()  # free the device memory before the fresh cache takes it
        self.runner.cache, *mtp_cache = self._new_caches()
        self.runner.mtp_cache = mtp_cache[0] if mtp_cache else {}
        self.scheduler.recompute_all()

    def _record_prompt_logprobs(self, segment: Segment, scored: Scored) -> None:
        """Entry p of the prompt: log p(prompt[p] | prompt[:p]), from the token before it."""
        request = segment.request
        entries, n = self._prompt_logprobs[request.request_id], request.sampling.prompt_logprobs
        for k in range(segment.length):
            p = segment.start + k + 1
            if p < len(request.prompt):
                entries[p] = _entry(
                    request.prompt[p], scored.logprobs[k], scored.top_ids[k], scored.top_logprobs[k], n
                )

    def warmup(self, progress: bool = True, export: bool = False, load: bool = False) -> float:
        """Compile every step shape now (a progress bar on a terminal, a line per shape in a log), and
        the cache handoff's gathers (``export``: a prefill server's) and scatters (``load``: a decode
        server's) for every prompt length; returns seconds taken."""
        start = time.perf_counter()
        bar = Progress("compiling step shapes", len(self.runner.variants), enabled=progress)
        try:
            self.runner.warmup(bar.done)
        finally:
            bar.close()
        self.warm_handoff(export, load)
        return time.perf_counter() - start

    def warm_handoff(self, export: bool, load: bool) -> None:
        """Compile the cache handoff's gathers (``export``) and scatters (``load``) for every prompt
        length up to max_model_len, so that no handoff stalls the running streams on a compile."""
        self._mover.warmup(self._caches(), self.max_model_len, export, load)

    def stats(self) -> dict[str, float]:
        used, total = self.scheduler.pages_used, self.scheduler.pages_total
        return {
            "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting),
            "generated_tokens": self.num_generated_tokens,
            "cache_pages_used": used,
            "cache_pages_total": total,
            "cache_usage": used / total,
            "prefix_cache_queries": self.scheduler.prefix_queried,
            "prefix_cache_hits": self.scheduler.prefix_hit,
            "preemptions": self.scheduler.num_preemptions,
            "failed_steps": self.num_failed_steps,
            "spec_decode_num_drafts": self.num_drafts,
            "spec_decode_num_draft_tokens": self.num_draft_tokens,
            "spec_decode_num_accepted_tokens": sum(self.accepted_per_position),
            **{
                f"spec_decode_num_accepted_tokens_pos{j}": n for j, n in enumerate(self.accepted_per_position)
            },
        }


def _integer(value, name: str) -> int:
    try:
        return operator.index(value)
    except TypeError:
        raise ValueError(f"{name} must be an integer, got {value!r}") from None


def _check_token_ids(ids: Iterable, vocab_size: int, name: str) -> None:
    """Token ids must be integers in [0, vocab_size): the step holds them as int32."""
    for t in ids:
        if not 0 <= _integer(t, name) < vocab_size:
            raise ValueError(f"{name} must be in [0, {vocab_size}), got {t}")


def _token_logprobs(result: StepResult, row: int, n: int, k: int | None) -> list[TokenLogprobs] | None:
    """Entries of the first ``n`` tokens a row emitted, with ``k`` top tokens each (None: not asked)."""
    if k is None:
        return None
    return [
        _entry(
            int(result.ids[row, j]),
            result.logprobs[row, j],
            result.top_ids[row, j],
            result.top_logprobs[row, j],
            k,
        )
        for j in range(n)
    ]


def _entry(token_id: int, logprob, top_ids, top_logprobs, n: int) -> TokenLogprobs:
    """A token's entry from one row of the step's logprob arrays, with its ``n`` top tokens."""
    return TokenLogprobs(
        token_id, float(logprob), tuple(zip(top_ids[:n].tolist(), top_logprobs[:n].tolist()))
    )
