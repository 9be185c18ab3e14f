"""Runs scheduled segments on the device: padded buffers, one jitted step + sampling per bucket.

Shapes come from a small set of buckets so every step compiles once: the token count (per
data-parallel group) is padded to a power of two up to max_num_batched_tokens, the sampled rows
to min(tokens, slots per group); the page table always has max_num_seqs rows, narrowed to what
the family's step mode addresses (:meth:`ModelFamily.page_columns`). With dp groups each group's
tokens form one block of the flat buffers and use group-local slot and page ids (the scheduler
keeps every sequence inside one group).

The model is split once (:class:`ModelState`): the jitted step is a pure function of the
parameter leaves, the cache, the penalty rows (:mod:`jaxdsa.engine.penalties`) and the step's
buffers; it merges the module tree only while tracing, so a step costs no graph traversal on the
host.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import functools
import os
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxdsa import sharding
from jaxdsa.cache import Cache, StepMeta
from jaxdsa.engine.buckets import bucket, buckets
from jaxdsa.engine.penalties import PenaltyRows
from jaxdsa.engine.request import MAX_BANNED_TOKENS
from jaxdsa.engine.sampling import Penalties, Scored, score
from jaxdsa.engine.scheduler import Segment
from jaxdsa.engine.speculative import Verified, verify
from jaxdsa.layers.params import axes_of
from jaxdsa.models.family import ModelFamily


class ModelState:
    """A model split once into its graph and a flat list of parameter leaves (with their logical
    axes), so that jit sees only arrays; :meth:`model` rebuilds the module inside a trace. The
    graph and tree definitions are hashable: equal models share compiled steps. A quantized
    weight is one parameter of several leaves (codes, scales, zero points), each with its axes."""

    def __init__(self, model: nnx.Module):
        self.graphdef, state = nnx.split(model)
        leaves, self.treedef = jax.tree.flatten(state)
        self.leaves = tuple(leaves)
        variables = jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, nnx.Variable))
        self.axes = tuple(axes_of(v) for v in variables for _ in jax.tree.leaves(v.get_value()))

    def model(self, leaves: tuple[jax.Array, ...]) -> nnx.Module:
        return nnx.merge(self.graphdef, jax.tree.unflatten(self.treedef, leaves))


def _fused_step(
    leaves,
    tokens,
    positions,
    cache,
    mtp_cache,
    penalty_state,
    meta,
    temperature,
    top_p,
    top_k,
    seeds,
    counters,
    banned,
    penalty_rows,
    proposed,
    drafting,
    scoring,
    *,
    family: ModelFamily,
    state: ModelState,
    mode,
    with_logits,
    num_logprobs,
    layers,
):
    """One step: the model, then sampling (which verifies the drafts under speculative decoding),
    then the next step's drafts, one per entry of ``layers`` (the next-n layer that drafts it; none:
    no speculation). ``meta.logits_indices`` holds K = len(layers) + 1 verify positions per
    sample row (its last token, then its drafts; ``proposed`` [R, K]: the draft each one tests, V
    for none). With ``scoring`` = (targets [T], verify rows [R * K]) the model returned logits for
    every token (meta.logits_indices covers them all): each token is scored against its target
    (the prompt's next token) and the verify rows are picked after. ``penalty_rows`` = (slot,
    presence, frequency, repetition, on) per row and ``penalty_state`` = (counts, in_prompt, bias)
    [slots, V]: the ``on`` rows sample under their penalties and add the tokens they emit to their
    slot's counts. ``drafting`` (with ``layers``): see :func:`_draft`."""
    model = state.model(leaves)
    R, K = proposed.shape
    hidden, cache = family.hidden(model, tokens, positions, cache, meta, mode)
    logits = family.logits(model, hidden[meta.logits_indices])  # the rows of family.step
    scored = None
    if scoring:
        targets, verify_rows = scoring
        scored = score(logits, targets, num_logprobs=num_logprobs)
        logits = logits[verify_rows]
    penalties = Penalties(*penalty_state, *penalty_rows)
    verified = verify(
        logits.reshape(R, K, -1),
        proposed,
        temperature,
        top_p,
        top_k,
        seeds,
        counters,
        banned.reshape(R, K, -1),
        penalties,
        num_logprobs=num_logprobs,
    )
    emitted = (jnp.arange(K) < verified.num_emitted[:, None]) & penalties.on[:, None]
    counts = penalties.counts.at[penalties.slot[:, None], verified.tokens].add(emitted.astype(jnp.int32))
    drafts = jnp.zeros((R, 0), jnp.int32)
    if layers:
        verify_at = (scoring[1] if scoring else meta.logits_indices).reshape(R, K)
        drafts, mtp_cache = _draft(
            family, model, hidden, positions, meta, mtp_cache, mode, verified, verify_at, *drafting, layers
        )
    logits = logits if with_logits else jnp.zeros((logits.shape[0], 0), jnp.float32)
    return verified, drafts, logits, scored, cache, mtp_cache, (counts, penalties.in_prompt, penalties.bias)


def _draft(
    family, model, hidden, positions, meta, mtp_cache, mode, verified, verify_at, following, limits, layers
):
    """The next step's drafts [R, N] (the next-n layers' argmax) and their cache, N = ``len(layers)``.

    ``following`` [T]: the token after each token of the step where the host knows it (the prompt's
    next token, or the draft after a draft); ``limits`` [R]: positions below which a row may write
    (its pages), 0 for padding rows; ``layers``: the next-n layer drafting each token (vLLM reuses
    the model's one layer for all). The first pass runs over every token of the step, so each
    position's next-n cache row is written once its next token is known; rows of rejected drafts
    are rewritten before any query reaches them (attention reads positions up to its own). Each
    further draft runs the layer once more per row on its own output, one position on."""
    R, K = verify_at.shape
    rows = jnp.arange(R)
    last = verify_at[rows, verified.num_emitted - 1]  # each row's last position whose next token is known
    live = limits > 0
    following = following.at[jnp.where(live, last, following.shape[0])].set(
        verified.tokens[rows, verified.num_emitted - 1], mode="drop"
    )
    first = StepMeta(meta.seq_ids, meta.page_table, last)
    logits, h, mtp_cache = family.draft(
        model, hidden, following, positions, mtp_cache, first, mode, layers[0]
    )
    draft = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    drafts, position = [draft], positions[last]
    sequence = jnp.where(live, meta.seq_ids[last], -1)
    for layer in layers[1:]:
        position = position + 1
        step = StepMeta(jnp.where(position < limits, sequence, -1), meta.page_table, rows)
        logits, h, mtp_cache = family.draft(model, h, draft, position, mtp_cache, step, mode, layer)
        draft = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        drafts.append(draft)
    return jnp.stack(drafts, axis=1), mtp_cache


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
class _Group:
    """One dp group's share of a step, in group-local ids."""

    tokens: list = dataclasses.field(default_factory=list)
    positions: list = dataclasses.field(default_factory=list)
    seq_ids: list = dataclasses.field(default_factory=list)
    logits_at: list = dataclasses.field(default_factory=list)  # K per row: its verify positions
    rows: list = dataclasses.field(default_factory=list)  # (temperature, top_p, top_k, seed, counter)
    banned: list = dataclasses.field(default_factory=list)  # K per row: token ids it must not emit there
    penalties: list = dataclasses.field(
        default_factory=list
    )  # per row: (slot, presence, frequency, repetition, on)
    targets: list = dataclasses.field(default_factory=list)  # next token of each scored token, else -1
    proposed: list = dataclasses.field(default_factory=list)  # K per row: the draft tested there, else V
    following: list = dataclasses.field(default_factory=list)  # per token: the next token if known, else 0
    limits: list = dataclasses.field(default_factory=list)  # per row: positions it has pages for


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
    ):
        """``num_spec`` > 0: speculative decoding with that many drafts per step from the model's
        next-n layers, whose cache is ``mtp_cache``."""
        self.family, self.cfg, self.mesh, self.precision = family, cfg, mesh, precision
        self.state = ModelState(model)
        # Without a mesh, the device state the steps carry (cache, penalty rows) is committed to the
        # parameters' device, as the steps' outputs are: jit keys on commitment, so a first step
        # over uncommitted zeros would compile once more than the steps after it.
        self.home = None if mesh is not None else self.state.leaves[0].sharding
        self.max_logprobs = max_logprobs
        self.page_size = page_size
        self.groups = groups
        self.slots_per_group = max_num_seqs // groups
        self.max_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.buckets = buckets(max_num_batched_tokens)
        self.page_table = np.zeros((max_num_seqs, -(-max_model_len // self.page_size)), np.int32)
        self.modes = family.modes(cfg, max_model_len)
        self.cache = cache
        self.cache_axes = family.cache_spec(cfg).axes()
        self.num_spec = num_spec
        self.mtp_cache = mtp_cache if num_spec else {}
        self.mtp_cache_axes = family.mtp_cache_spec(cfg).axes() if num_spec else {}
        # the next-n layer drafting each of the num_spec tokens (the model's layers in turn, as vLLM)
        self.draft_layers = tuple(i % max(len(getattr(model, "mtp", ())), 1) for i in range(num_spec))
        self.max_num_seqs = max_num_seqs
        self.penalty = PenaltyRows(max_num_seqs, cfg.vocab_size, groups, mesh, self._place, self.home)
        self._steps: dict[tuple, Any] = {}

    def _place(self, tree):
        """A step's host inputs as the step takes them: numpy straight into jit on one device (its
        dispatch transfers them), laid out over the dp groups on a mesh. Never via a device array
        first, which would cost a device-to-host copy per input before the mesh put."""
        if self.mesh is None:
            return tree
        return sharding.put(tree, self.mesh, sharding.batch_spec())

    def reset_penalty_rows(self) -> None:
        """Zeroed rows that no request owns, so each penalized request refills its own before it
        samples again: after a failed step, which may have counted tokens in them or consumed them."""
        self.penalty = PenaltyRows(
            self.max_num_seqs, self.cfg.vocab_size, self.groups, self.mesh, self._place, self.home
        )

    def _compiled(self, mode, with_logits: bool):
        """The jitted step of one (mode, with_logits) variant: compiled once per bucket shape."""
        key = (mode, with_logits)
        if key not in self._steps:
            fn = functools.partial(
                _fused_step,
                family=self.family,
                state=self.state,
                mode=mode,
                with_logits=with_logits,
                num_logprobs=self.max_logprobs,
                layers=self.draft_layers,
            )
            self._steps[key] = sharding.jit_step(
                fn,
                self.mesh,
                donate_argnums=(3, 4, 5),
                in_axes=(self.state.axes, None, None, self.cache_axes, self.mtp_cache_axes),
                out_axes=(None, None, None, None, self.cache_axes, self.mtp_cache_axes, None),
            )
        return self._steps[key]

    def _precision(self):
        """The context the step is traced in (the model's matmul precision, if it sets one)."""
        return self.precision() if self.precision else contextlib.nullcontext()

    def _step_inputs(self, groups: list[_Group], *, mode, with_logits: bool, scoring: bool):
        """-> (the jitted step, its arguments, R, T) for one step over ``groups``: the buffers padded to
        the bucket of T tokens and R sampled rows, placed as the step takes them."""
        T = bucket(max(len(g.tokens) for g in groups), cap=self.max_tokens)
        R = min(T, self.slots_per_group)
        K = self.num_spec + 1
        V = self.cfg.vocab_size

        def flat(field, n, fill, dtype=np.int32):
            out = np.full((len(groups), n), fill, dtype)
            for i, g in enumerate(groups):
                values = getattr(g, field)
                out[i, : len(values)] = values
            return out.reshape(-1)

        def per_row(field, col, fill, dtype):  # column ``col`` of each group's per-row tuples
            out = np.full((len(groups), R), fill, dtype)
            for i, g in enumerate(groups):
                values = getattr(g, field)
                out[i, : len(values)] = [r[col] for r in values]
            return out.reshape(-1)

        banned = np.full((len(groups), R * K, MAX_BANNED_TOKENS), V, np.int32)  # out of range: none
        for i, g in enumerate(groups):
            for j, ids in enumerate(g.banned):
                banned[i, j, : len(ids)] = sorted(ids)

        table = self.page_table[
            :, : self.family.page_columns(self.cfg, mode, self.page_size, self.page_table.shape[1])
        ]
        verify_at = flat("logits_at", R * K, 0)
        logits_at = np.tile(np.arange(T, dtype=np.int32), len(groups)) if scoring else verify_at
        meta = StepMeta(flat("seq_ids", T, -1), np.array(table), logits_at)
        # (slot, presence, frequency, repetition, on); padding rows neutral: slot 0, 0, 0, 1, off
        neutral = ((0, np.int32), (0, np.float32), (0, np.float32), (1, np.float32), (False, bool))
        penalty_rows = tuple(per_row("penalties", c, fill, dt) for c, (fill, dt) in enumerate(neutral))
        drafting = (flat("following", T, 0), flat("limits", R, 0)) if self.num_spec else ()
        args = (
            flat("tokens", T, 0),
            flat("positions", T, 0),
            meta,
            per_row("rows", 0, 0, np.float32),
            per_row("rows", 1, 1, np.float32),
            per_row("rows", 2, 0, np.int32),
            per_row("rows", 3, 0, np.int32),
            per_row("rows", 4, 0, np.int32),
            banned.reshape(-1, MAX_BANNED_TOKENS),
            penalty_rows,
            flat("proposed", R * K, V).reshape(-1, K),
            drafting,
            (flat("targets", T, -1), verify_at) if scoring else (),
        )
        tokens, positions, meta, *rest = self._place(args)
        state = (self.state.leaves, tokens, positions, self.cache, self.mtp_cache, self.penalty.state)
        return self._compiled(mode, with_logits), (*state, meta, *rest), R, T

    def _call(
        self,
        groups: list[_Group],
        *,
        mode,
        with_logits: bool,
        with_logprobs: bool = False,
        scoring: bool = False,
    ):
        """-> (Verified [groups, R, K, ...], drafts [groups, R, N], logits [groups, R, K, V] or None,
        Scored [groups, T, ...] or None) on the host; the logprob fields of Verified are None unless
        asked for."""
        fn, args, R, T = self._step_inputs(groups, mode=mode, with_logits=with_logits, scoring=scoring)
        with self._precision():
            verified, drafts, logits, scored, self.cache, self.mtp_cache, self.penalty.state = fn(*args)
        rows = lambda a, *n: sharding.fetch(a).reshape(len(groups), *n, *a.shape[1:])  # noqa: E731
        head = (rows(verified.tokens, R), rows(verified.num_emitted, R))
        tail = map(lambda a: rows(a, R), verified[2:]) if with_logprobs else (None,) * 3
        fetched = Verified(*head, *tail)
        logits = (
            sharding.fetch(logits).reshape(len(groups), R, self.num_spec + 1, -1) if with_logits else None
        )
        scored = Scored(*(rows(a, T) for a in scored)) if scoring else None
        return fetched, rows(drafts, R), logits, scored

    def run(
        self,
        segments: list[Segment],
        seeds: dict[str, int],
        *,
        with_logits: bool = False,
        with_logprobs: bool = False,
        score: frozenset[str] = frozenset(),
        banned: dict[str, frozenset[int]] | None = None,
    ) -> StepResult:
        """Run one step; ``with_logits`` / ``with_logprobs`` fetch those rows as well. The tokens of
        requests in ``score`` are scored against the token after each (prompt logprobs); requests
        in ``banned`` cannot emit the tokens listed for them while their output is shorter than
        their ``min_tokens``."""
        banned = banned or {}
        K, V = self.num_spec + 1, self.cfg.vocab_size
        groups = [_Group() for _ in range(self.groups)]
        where = []  # (group, row) of each sampling segment
        spans = []  # (group, first token) of each segment
        for s in segments:
            r = s.request
            gi = r.slot // self.slots_per_group
            g = groups[gi]
            self.page_table[r.slot, : len(r.pages)] = r.pages
            spans.append((gi, len(g.tokens)))
            tokens = r.tokens + list(s.drafts)
            end = s.start + s.num_run
            if score:  # the next token of each scored one, else -1 (decode steps skip this)
                scored = r.request_id in score
                g.targets += [
                    tokens[p + 1] if scored and p + 1 < len(tokens) else -1 for p in range(s.start, end)
                ]
            g.tokens += tokens[s.start : end]
            g.positions += range(s.start, end)
            g.seq_ids += [r.slot - gi * self.slots_per_group] * s.num_run
            if self.num_spec:
                g.following += [tokens[p + 1] if p + 1 < len(tokens) else 0 for p in range(s.start, end)]
            if s.samples:
                n = len(s.drafts)
                last = len(g.tokens) - 1 - n  # the request's last token; its drafts follow
                g.logits_at += [last + min(j, n) for j in range(K)]
                g.proposed += list(s.drafts) + [V] * (K - n)
                sp = r.sampling
                g.rows.append((sp.temperature, sp.top_p, sp.top_k, seeds[r.request_id], len(r.output)))
                ids = banned.get(r.request_id, ())
                g.banned += [ids if len(r.output) + j < sp.min_tokens else () for j in range(K)]
                g.penalties.append(
                    (
                        r.slot - gi * self.slots_per_group,
                        sp.presence_penalty,
                        sp.frequency_penalty,
                        sp.repetition_penalty,
                        sp.penalized,
                    )
                )
                g.limits.append(min(len(r.pages) * self.page_size, self.max_model_len))
                where.append((gi, len(g.rows) - 1))
        # the drafts of this step reach num_spec - 1 positions past its last verified one
        furthest = max(p for g in groups for p in g.positions) + max(self.num_spec - 1, 0)
        mode = self.family.step_mode(self.cfg, max_position=furthest)
        scoring = any(s.request.request_id in score for s in segments)
        penalized = [s.request for s in segments if s.samples and s.request.sampling.penalized]
        if penalized:
            self.penalty.seat(penalized)
        verified, drafts, logits, scored = self._call(
            groups, mode=mode, with_logits=with_logits, with_logprobs=with_logprobs, scoring=scoring
        )
        at = tuple(np.asarray(where, np.intp).reshape(-1, 2).T)  # (group, row) of each sampled segment
        pick = lambda a: None if a is None else a[at]  # noqa: E731
        result = StepResult(
            pick(verified.tokens),
            pick(verified.num_emitted),
            pick(drafts),
            pick(logits),
            *map(pick, verified[2:]),
        )
        if scoring:
            result.scores = [
                Scored(*(a[gi, start : start + s.length] for a in scored))
                if s.request.request_id in score
                else None
                for s, (gi, start) in zip(segments, spans)
            ]
        return result

    def warmup(self, report: Callable[[int, int], None] | None = None) -> dict[tuple, float]:
        """Compile every bucket in every step mode the family can meet, then run each once; returns
        each ``(bucket, mode)``'s compile seconds (side by side, so they overlap).

        The variants are traced one by one (Python) and compiled side by side in threads: XLA
        compiles without the GIL, and the Pallas kernels' Triton compiles inside each are serial,
        so a cold start takes about its slowest variant instead of their sum. A jitted function
        reuses what ``lower(...).compile()`` built for the same arguments, so the runs that follow
        (all padding: slot -1 writes are dropped, nothing reaches the cache) compile nothing."""
        variants = [(b, mode) for mode in self.modes for b in self.buckets]
        padding = lambda b: [  # noqa: E731
            _Group(tokens=[0] * b, positions=[0] * b, seq_ids=[-1] * b) for _ in range(self.groups)
        ]
        lowered = []
        for b, mode in variants:
            fn, args, _, _ = self._step_inputs(padding(b), mode=mode, with_logits=False, scoring=False)
            with self._precision():
                lowered.append(fn.lower(*args))

        def compile_one(step) -> float:
            start = time.perf_counter()
            step.compile()
            return time.perf_counter() - start

        with concurrent.futures.ThreadPoolExecutor(min(len(lowered), os.cpu_count() or 1)) as pool:
            jobs = {pool.submit(compile_one, step): variant for step, variant in zip(lowered, variants)}
            seconds = {}
            for done, job in enumerate(concurrent.futures.as_completed(jobs), 1):
                seconds[jobs[job]] = job.result()
                if report:
                    report(done, len(variants))
        for b, mode in variants:
            self._call(padding(b), mode=mode, with_logits=False)
        return {variant: seconds[variant] for variant in variants}
