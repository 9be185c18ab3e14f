"""Runs packed steps on the device and reads their results back.

The runner holds what the steps carry from one to the next on the device (the cache, the next-n
layers' cache, the penalty rows, the last token each slot sampled) and the compiled step
variants. :meth:`ModelRunner.launch` packs a step (:mod:`jaxdsa.engine.batch`), seats the penalty
rows of newly seated requests and dispatches the jitted step (:mod:`jaxdsa.engine.step`) without
waiting for it: JAX dispatches asynchronously, and the step's sampled ids start their copy to the
host as soon as the step ends. :meth:`ModelRunner.fetch` waits for them. The engine launches step
N + 1 before it fetches step N (async scheduling), so the device runs while the host schedules,
packs and processes outputs.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx

from jaxdsa import sharding
from jaxdsa.cache import Cache, StepMeta, init_cache
from jaxdsa.engine.batch import BatchPacker, StepBatch
from jaxdsa.engine.buckets import bucket
from jaxdsa.engine.executables import ExecutableStore, compile_step, compiler_options
from jaxdsa.engine.penalties import PenaltyRows
from jaxdsa.engine.sampling import Scored
from jaxdsa.engine.scheduler import Segment
from jaxdsa.engine.step import InputLayout, ModelState, jit_fused_step, jit_sequence_logits, pack_inputs
from jaxdsa.models.family import ModelFamily


@dataclasses.dataclass
class StepResult:
    """What one step emitted, one row per sampling segment (in segment order): the first
    ``num_emitted[i]`` of ``ids[i]`` (one token without speculative decoding; with it the accepted
    drafts and one more), and the next step's ``drafts``.

    The logprob arrays are fetched from the device only when the step was asked for them.
    """

    ids: np.ndarray  # [n, K] int32
    num_emitted: np.ndarray  # [n] int32 in [1, K]
    drafts: np.ndarray  # [n, num_spec] int32
    logits: np.ndarray | None = None  # [n, K, V] float32
    logprobs: np.ndarray | None = None  # [n, K] float32: log p of each emitted token
    top_ids: np.ndarray | None = None  # [n, K, max_logprobs] int32, most likely first
    top_logprobs: np.ndarray | None = None  # [n, K, max_logprobs] float32
    scores: list[Scored | None] | None = None  # per segment: its tokens scored against the next token


@dataclasses.dataclass
class InFlight:
    """A launched step: its batch and its outputs on the device, not yet read."""

    batch: StepBatch
    sampled: jax.Array  # [rows, K + 1 + N] int32: emitted ids | how many | next drafts
    verified: Any  # the logprob fields are read only ``with_logprobs``
    logits: jax.Array | None
    scored: Scored | None
    with_logprobs: bool


class ModelRunner:
    def __init__(
        self,
        family: ModelFamily,
        cfg: Any,
        model: nnx.Module,
        cache: Cache,
        *,
        page_size: int,
        max_num_seqs: int,
        max_model_len: int,
        max_num_batched_tokens: int,
        groups: int = 1,
        max_logprobs: int = 0,
        mesh=None,
        precision=None,
        num_spec: int = 0,
        mtp_cache: Cache | None = None,
        kv_format: str = "model",
    ):
        """``num_spec`` > 0: speculative decoding with that many drafts per step from the model's
        next-n layers, whose cache is ``mtp_cache``; ``kv_format``: the cache's rows, ``'model'`` or
        ``'fp8'`` (:func:`jaxdsa.cache.kv_cache_format`)."""
        self.family, self.cfg, self.mesh, self.precision = family, cfg, mesh, precision
        self.state = ModelState(model)
        # Without a mesh, the device state the steps carry (cache, penalty rows, slot tokens) is
        # committed to the parameters' device, as the steps' outputs are: jit keys on commitment, so
        # a first step over uncommitted zeros would compile once more than the steps after it.
        self.home = None if mesh is not None else self.state.leaves[0].sharding
        self.max_logprobs = max_logprobs
        self.page_size = page_size
        self.groups = groups
        self.max_num_seqs = max_num_seqs
        self.packer = BatchPacker(
            family,
            cfg,
            page_size=page_size,
            max_num_seqs=max_num_seqs,
            max_model_len=max_model_len,
            max_num_batched_tokens=max_num_batched_tokens,
            groups=groups,
            num_spec=num_spec,
        )
        self.modes = family.modes(cfg, max_model_len)
        self.cache = cache
        self.kv_format = kv_format
        self.cache_axes = family.cache_spec(cfg, kv_format).axes()
        self.num_spec = num_spec
        self.mtp_cache = mtp_cache if num_spec else {}
        self.mtp_cache_axes = family.mtp_cache_spec(cfg, kv_format).axes() if num_spec else {}
        # the next-n layer drafting each of the num_spec tokens (the model's layers in turn, as vLLM)
        self.draft_layers = tuple(i % max(len(getattr(model, "mtp", ())), 1) for i in range(num_spec))
        self.reset_step_state()
        self._steps: dict[tuple, Any] = {}
        self._executables: dict[tuple, jax.stages.Compiled] = {}  # warmed steps, called as they are

    def _place(self, tree):
        """A step's host inputs as the step takes them: numpy straight into jit on one device (its
        dispatch transfers them), laid out over the dp groups on a mesh. Never via a device array
        first, which would cost a device-to-host copy per input before the mesh put."""
        if self.mesh is None:
            return tree
        return sharding.put(tree, self.mesh, sharding.batch_spec())

    def reset_step_state(self) -> None:
        """Zeroed penalty rows that no request owns (each penalized request refills its own before
        it samples again) and slot tokens: at start, and after a failed step, which may have
        counted tokens in them or consumed them."""
        self.penalty = PenaltyRows(
            self.max_num_seqs, self.cfg.vocab_size, self.groups, self.mesh, self._place, self.home
        )
        slots = np.zeros(self.max_num_seqs, np.int32)
        self.slot_tokens = self._place(slots) if self.mesh is not None else jax.device_put(slots, self.home)

    def _compiled(self, mode, with_logits: bool, layout: InputLayout):
        """The jitted step of one (mode, with_logits, input layout) variant: compiled once per bucket."""
        key = (mode, with_logits, layout)
        if key not in self._steps:
            self._steps[key] = jit_fused_step(
                self.family,
                self.state,
                self.mesh,
                cache_axes=self.cache_axes,
                mtp_cache_axes=self.mtp_cache_axes,
                mode=mode,
                with_logits=with_logits,
                num_logprobs=self.max_logprobs,
                layers=self.draft_layers,
                layout=layout,
            )
        return self._steps[key]

    def _precision(self):
        """The context the step is traced in (the model's matmul precision, if it sets one)."""
        return self.precision() if self.precision else contextlib.nullcontext()

    def _step(self, batch: StepBatch, with_logits: bool) -> tuple[Any, tuple]:
        """The compiled step for ``batch`` and its arguments: the parameters, the carried state and
        the batch's buffers packed into one array (one transfer per device)."""
        variant, args = self._variant(batch, with_logits)
        return self._executables.get(variant) or self._compiled(*variant), args

    def _variant(self, batch: StepBatch, with_logits: bool) -> tuple[tuple, tuple]:
        """``((mode, with_logits, input layout), arguments)``: which step ``batch`` runs, and what it
        takes (the parameters, the carried state, the batch's buffers packed into one array)."""
        packed, layout = pack_inputs(batch.inputs, self.groups)
        carried = (self.cache, self.mtp_cache, self.penalty.state, self.slot_tokens)
        return (batch.mode, with_logits, layout), (self.state.leaves, *carried, self._place(packed))

    def _dispatch(self, batch: StepBatch, with_logits: bool):
        """Run ``batch`` on the device (asynchronously); the carried state moves on to its outputs."""
        fn, args = self._step(batch, with_logits)
        with self._precision():
            sampled, verified, logits, scored, *carried = fn(*args)
        self.cache, self.mtp_cache, self.penalty.state, self.slot_tokens = carried
        return sampled, verified, logits, scored

    def launch(
        self,
        segments: list[Segment],
        seeds: dict[str, int],
        *,
        with_logits: bool = False,
        with_logprobs: bool = False,
        score: frozenset[str] = frozenset(),
        banned: dict[str, frozenset[int]] | None = None,
    ) -> InFlight:
        """Launch one step over ``segments``; ``with_logits`` / ``with_logprobs``: its results will
        carry those rows as well. The tokens of requests in ``score`` are scored against the token
        after each (prompt logprobs); requests in ``banned`` cannot emit the tokens listed for them
        while their output is shorter than their ``min_tokens``."""
        batch = self.packer.pack(segments, seeds, score=score, banned=banned or {})
        if batch.penalized:
            self.penalty.seat(batch.penalized, self.slot_tokens)
        sampled, verified, logits, scored = self._dispatch(batch, with_logits)
        sampled.copy_to_host_async()  # the copy starts when the step ends, not when it is fetched
        return InFlight(batch, sampled, verified, logits if with_logits else None, scored, with_logprobs)

    def fetch(self, flight: InFlight) -> StepResult:
        """Wait for a launched step and read what the engine needs of it."""
        batch, G, K = flight.batch, self.groups, self.num_spec + 1
        rows = lambda a, n: sharding.fetch(a).reshape(G, n, *a.shape[1:])  # noqa: E731
        sampled = rows(flight.sampled, batch.R)[batch.where]
        result = StepResult(sampled[:, :K], sampled[:, K], sampled[:, K + 1 :])
        if flight.logits is not None:
            result.logits = sharding.fetch(flight.logits).reshape(G, batch.R, K, -1)[batch.where]
        if flight.with_logprobs:
            v = flight.verified
            result.logprobs, result.top_ids, result.top_logprobs = (
                rows(a, batch.R)[batch.where] for a in (v.logprobs, v.top_ids, v.top_logprobs)
            )
        if batch.scoring:
            scored = Scored(*(rows(a, batch.T) for a in flight.scored))
            result.scores = [
                None if span is None else Scored(*(a[span[0], span[1] : span[1] + span[2]] for a in scored))
                for span in batch.spans
            ]
        return result

    def run(self, segments: list[Segment], seeds: dict[str, int], **kwargs) -> StepResult:
        """Launch one step and wait for its results (:meth:`launch`'s arguments)."""
        return self.fetch(self.launch(segments, seeds, **kwargs))

    @property
    def variants(self) -> list[tuple[int, Any]]:
        """Every ``(bucket, mode)`` step shape the scheduler can produce: what :meth:`warmup` compiles."""
        return [(b, mode) for mode in self.modes for b in self.packer.buckets(mode)]

    def static_description(self) -> str:
        """What the step functions are built from besides their arguments (the model config, the
        module graph, the mesh, the cache axes, the step options): part of a stored step's key
        (:mod:`jaxdsa.engine.executables`)."""
        return repr(
            (
                type(self.family).__name__,
                self.cfg,
                self.state.graphdef,
                self.mesh,
                sorted(self.cache_axes.items()),
                sorted(self.mtp_cache_axes.items()),
                self.max_logprobs,
                self.draft_layers,
                self.kv_format,
            )
        )

    def warmup(self, report: Callable[[str], None] | None = None) -> dict[tuple, float]:
        """Compile every step shape the scheduler can produce (:attr:`variants`), then run each once;
        returns each ``(bucket, mode)``'s compile seconds (side by side, so they overlap; 0 for a step
        loaded from the executable store). ``report`` is called with a variant's name as each one is
        ready.

        A step stored by an earlier start with the same key (:mod:`jaxdsa.engine.executables`) is
        loaded, not traced. The others are traced one by one (Python holds the GIL) and each goes to
        a compile thread as soon as it is lowered: XLA compiles without the GIL, so compiles overlap
        each other and the tracing of the next variants, and a cold start takes about the tracing
        plus its slowest compiles instead of their sum (on the CPU at the cheaper LLVM optimization
        of :func:`~jaxdsa.engine.executables.compiler_options`); each is then stored. The warmed
        steps are called as compiled from then on, so the runs that follow (all padding: slot -1
        writes are dropped, nothing reaches the cache) compile nothing."""
        variants = self.variants
        store = ExecutableStore.for_runner(self.static_description())
        options = compiler_options(next(iter(self.state.leaves[0].sharding.device_set)).platform)

        def compile_one(lowered) -> tuple[jax.stages.Compiled, bool, float]:
            start = time.perf_counter()
            return *compile_step(lowered, options), time.perf_counter() - start

        seconds = {}
        with concurrent.futures.ThreadPoolExecutor(min(len(variants), os.cpu_count() or 1)) as pool:
            jobs = {}
            for b, mode in variants:
                batch = self.packer.padding(b, mode)
                step, args = self._variant(batch, False)
                with self._precision():
                    key = store.key(step, args) if store else None
                    loaded = store.load(key) if store else None
                    if loaded is None:  # lowered from the jitted step (a second warm-up included)
                        jobs[pool.submit(compile_one, self._compiled(*step).lower(*args))] = (
                            b,
                            mode,
                            step,
                            key,
                        )
                        continue
                self._executables[step], seconds[b, mode] = loaded, 0.0
                if report:
                    report(f"{b} tokens, {mode} (stored)")
            for job in concurrent.futures.as_completed(jobs):
                b, mode, step, key = jobs[job]
                self._executables[step], compiled_here, seconds[b, mode] = job.result()
                if store and compiled_here:
                    store.save(key, self._executables[step])
                if report:
                    report(f"{b} tokens, {mode}")
        for b, mode in variants:
            outputs = self._dispatch(self.packer.padding(b, mode), False)
        jax.block_until_ready(outputs)
        return {variant: seconds[variant] for variant in variants}

    def score(self, model: nnx.Module, token_ids: Sequence[int], dtype) -> np.ndarray:
        """Logits [len(token_ids), vocab] (float32) of one forward of ``model`` (the module tree as it
        is now, not the one the steps were built from) over one sequence, in a cache of its own.
        On a data-parallel mesh the sequence runs in dp group 0; the other groups get padding."""
        ids = list(token_ids)
        if not ids:
            raise ValueError("token_ids is empty")
        G = self.groups
        T, pages = bucket(len(ids)), bucket(-(-len(ids) // self.page_size))
        group = lambda first, fill: np.asarray(  # noqa: E731
            list(first) + [fill] * (T - len(ids)) + [fill] * (T * (G - 1)), np.int32
        )
        spec = self.family.cache_spec(self.cfg, self.kv_format)
        placed = self.home
        if self.mesh is not None:
            placed = {
                k: jax.sharding.NamedSharding(self.mesh, sharding.spec(a)) for k, a in self.cache_axes.items()
            }
        cache = init_cache(spec, pages * G, self.page_size, dtype, num_seqs=G, sharding=placed)
        meta = StepMeta(
            seq_ids=group([0] * len(ids), -1),
            page_table=np.tile(np.arange(pages, dtype=np.int32), (G, 1)),
            logits_indices=np.tile(np.arange(T, dtype=np.int32), G),
        )
        state = ModelState(model)
        mode = self.family.step_mode(self.cfg, max_position=len(ids) - 1, single_sequence=True)
        fn = jit_sequence_logits(
            self.family,
            state.graphdef,
            state.treedef,
            state.axes,
            tuple(self.cache_axes.items()),
            mode,
            self.mesh,
        )
        with self._precision():
            logits, _ = fn(
                state.leaves, cache, *self._place((group(ids, 0), group(range(len(ids)), 0), meta))
            )
        return sharding.fetch(logits)[: len(ids)]
