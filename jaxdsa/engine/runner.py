"""Runs scheduled segments on the device: padded buffers, one jitted step + sampling per bucket.

Shapes come from a small set of buckets so every step compiles once: the token count (per
data-parallel group) is padded to a power of two up to max_num_batched_tokens, the sampled rows
to min(tokens, slots per group); the page table always has max_num_seqs rows. Steps whose
contexts all fit in index_topk run the dense path over a page table narrowed to index_topk tokens.
With dp groups each group's tokens form one block of the flat buffers and use group-local slot
and page ids (the scheduler keeps every sequence inside one group).

Penalties and logit biases need per-request rows over the vocabulary, which live on the device,
one per slot (:class:`PenaltyState`): every step samples its rows from the penalized logits
(neutral for rows without penalties) and adds the tokens its penalized rows sample to their
counts, so requests with and without penalties share one compiled step (no compile
mid-serving). A request taking a slot fills its rows from its prompt, output and bias first.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxdsa import sharding
from jaxdsa.cache import KVCache, StepMeta
from jaxdsa.config import ModelConfig
from jaxdsa.engine.request import MAX_BANNED_TOKENS, Request
from jaxdsa.engine.sampling import Penalties, Sampled, Scored, sample, score
from jaxdsa.engine.scheduler import Segment
from jaxdsa.models.dsa import step


def token_buckets(max_tokens: int) -> list[int]:
    sizes, n = [], 1
    while n < max_tokens:
        sizes.append(n)
        n *= 2
    return sizes + [max_tokens]


def _fused_step(
    params,
    tokens,
    positions,
    cache,
    penalty_state,
    meta,
    temperature,
    top_p,
    top_k,
    seeds,
    counters,
    banned,
    penalty_rows,
    scoring,
    *,
    cfg,
    sparse,
    with_logits,
    num_logprobs,
):
    """One step: the model, then sampling. With ``scoring`` = (targets [T], sample rows [R]) the
    model returned logits for every token (meta.logits_indices covers them all): each token is
    scored against its target (the prompt's next token) and the sample rows are picked after.
    ``penalty_rows`` = (slot, presence, frequency, repetition, on) per row and ``penalty_state``
    = (counts, in_prompt, bias) [slots, V]: the ``on`` rows sample under their penalties and add
    the token to their slot's counts."""
    logits, cache = step(params, tokens, positions, cache, meta, cfg=cfg, sparse=sparse, absorbed=True)
    scored = None
    if scoring:
        targets, sample_rows = scoring
        scored = score(logits, targets, num_logprobs=num_logprobs)
        logits = logits[sample_rows]
    penalties = Penalties(*penalty_state, *penalty_rows)
    sampled = sample(
        logits, temperature, top_p, top_k, seeds, counters, banned, penalties, num_logprobs=num_logprobs
    )
    counts = penalties.counts.at[penalties.slot, sampled.ids].add(penalties.on.astype(jnp.int32))
    logits = logits if with_logits else jnp.zeros((logits.shape[0], 0), jnp.float32)
    return sampled, logits, scored, cache, (counts, penalties.in_prompt, penalties.bias)


@functools.cache
def _compiled(cfg: ModelConfig, sparse: bool, with_logits: bool, num_logprobs: int, mesh):
    fn = functools.partial(
        _fused_step, cfg=cfg, sparse=sparse, with_logits=with_logits, num_logprobs=num_logprobs
    )
    return sharding.jit_step(fn, mesh, donate_argnums=(3, 4))


_PROMPT, _OUTPUT, _BIAS = range(3)  # kinds of the entries that fill a slot's penalty rows


def _fill_rows(params, counts, in_prompt, bias, reset, slot, token, kind, value):
    """Penalty rows of newly seated requests: rows with ``reset`` cleared, then each (slot, token)
    entry marked (a prompt token), counted (an output token) or given its bias ``value``;
    out-of-range slots are padding."""
    del params  # the dp wrapper's replicated argument; nothing to replicate here
    clear = reset[:, None]
    counts = jnp.where(clear, 0, counts).at[slot, token].add((kind == _OUTPUT).astype(jnp.int32), mode="drop")
    in_prompt = jnp.where(clear, False, in_prompt).at[slot, token].max(kind == _PROMPT, mode="drop")
    biased = jnp.where(kind == _BIAS, slot, counts.shape[0])  # other kinds: dropped
    bias = jnp.where(clear, 0.0, bias).at[biased, token].set(value, mode="drop")
    return counts, in_prompt, bias


@functools.cache
def _compiled_fill(mesh):
    return sharding.jit_step(_fill_rows, mesh, donate_argnums=(1, 2, 3))


@dataclasses.dataclass
class PenaltyState:
    """Device rows for penalties and logit biases, one per slot, and the request each is for."""

    counts: jax.Array  # [max_num_seqs, V] int32: output token counts
    in_prompt: jax.Array  # [max_num_seqs, V] bool: prompt tokens
    bias: jax.Array  # [max_num_seqs, V] float32: logit bias
    owners: list[Request | None]  # per slot: the request its row was filled for


@dataclasses.dataclass
class StepResult:
    """What one step sampled, one row per sampling segment (in segment order).

    The logprob arrays are fetched from the device only when the step was asked for them.
    """

    ids: np.ndarray  # [n] int32
    logits: np.ndarray | None = None  # [n, V] float32
    logprobs: np.ndarray | None = None  # [n] float32: log p of the sampled token
    top_ids: np.ndarray | None = None  # [n, max_logprobs] int32, most likely first
    top_logprobs: np.ndarray | None = None  # [n, max_logprobs] float32
    scores: list[Scored | None] | None = None  # per segment: its tokens scored against the next token


@dataclasses.dataclass
class _Group:
    """One dp group's share of a step, in group-local ids."""

    tokens: list = dataclasses.field(default_factory=list)
    positions: list = dataclasses.field(default_factory=list)
    seq_ids: list = dataclasses.field(default_factory=list)
    logits_at: list = dataclasses.field(default_factory=list)
    rows: list = dataclasses.field(default_factory=list)  # (temperature, top_p, top_k, seed, counter)
    banned: list = dataclasses.field(default_factory=list)  # per row: token ids it must not sample
    penalties: list = dataclasses.field(
        default_factory=list
    )  # per row: (slot, presence, frequency, repetition, on)
    targets: list = dataclasses.field(default_factory=list)  # next token of each scored token, else -1


class ModelRunner:
    def __init__(
        self,
        cfg: ModelConfig,
        params: dict,
        cache: KVCache,
        *,
        max_num_seqs: int,
        max_model_len: int,
        max_num_batched_tokens: int,
        groups: int = 1,
        max_logprobs: int = 0,
        mesh=None,
        precision=None,
    ):
        self.cfg, self.params, self.mesh, self.precision = cfg, params, mesh, precision
        self.max_logprobs = max_logprobs
        self.page_size = cache.page_size
        self.groups = groups
        self.slots_per_group = max_num_seqs // groups
        self.buckets = token_buckets(max_num_batched_tokens)
        self.page_table = np.zeros((max_num_seqs, -(-max_model_len // self.page_size)), np.int32)
        self.dense_pages = min(self.page_table.shape[1], -(-cfg.index_topk // self.page_size))
        self.can_be_sparse = max_model_len > cfg.index_topk
        self.cache = cache
        self.max_num_seqs = max_num_seqs
        self.penalty = self._penalty_state()

    def _place(self, tree):
        """A step's host inputs as the step takes them: numpy straight into jit on one device (its
        dispatch transfers them), laid out over the dp groups on a mesh. Never via a device array
        first, which would cost a device-to-host copy per input before the mesh put."""
        if self.mesh is None:
            return tree
        return sharding.put(tree, self.mesh, sharding.batch_spec())

    def _bucket(self, n: int) -> int:
        return next(b for b in self.buckets if b >= n)

    def _call(
        self,
        groups: list[_Group],
        *,
        sparse: bool,
        with_logits: bool,
        with_logprobs: bool = False,
        scoring: bool = False,
    ):
        """-> (Sampled [groups, R, ...], logits or None, Scored [groups, T, ...] or None) on the host;
        the logprob fields of Sampled are None unless asked for."""
        T = self._bucket(max(1, max(len(g.tokens) for g in groups)))
        R = min(T, self.slots_per_group)

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

        banned = np.full(
            (len(groups), R, MAX_BANNED_TOKENS), self.cfg.vocab_size, np.int32
        )  # out of range: none
        for i, g in enumerate(groups):
            for j, ids in enumerate(g.banned):
                banned[i, j, : len(ids)] = sorted(ids)

        table = self.page_table if sparse else self.page_table[:, : self.dense_pages]
        logits_at = np.tile(np.arange(T, dtype=np.int32), len(groups)) if scoring else flat("logits_at", R, 0)
        meta = StepMeta(flat("seq_ids", T, -1), np.array(table), logits_at)
        # (slot, presence, frequency, repetition, on); padding rows neutral: slot 0, 0, 0, 1, off
        neutral = ((0, np.int32), (0, np.float32), (0, np.float32), (1, np.float32), (False, bool))
        penalty_rows = tuple(per_row("penalties", c, fill, dt) for c, (fill, dt) in enumerate(neutral))
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
            (flat("targets", T, -1), flat("logits_at", R, 0)) if scoring else (),
        )
        tokens, positions, meta, *rest = self._place(args)
        p = self.penalty
        fn = _compiled(self.cfg, sparse, with_logits, self.max_logprobs, self.mesh)
        with self.precision() if self.precision else contextlib.nullcontext():
            sampled, logits, scored, self.cache, (p.counts, p.in_prompt, p.bias) = fn(
                self.params, tokens, positions, self.cache, (p.counts, p.in_prompt, p.bias), meta, *rest
            )
        rows = lambda a, n=R: sharding.fetch(a).reshape(len(groups), n, *a.shape[1:])  # noqa: E731
        fetched = Sampled(rows(sampled.ids), *(map(rows, sampled[1:]) if with_logprobs else (None,) * 3))
        scored = Scored(*(rows(a, T) for a in scored)) if scoring else None
        return fetched, rows(logits) if with_logits else None, scored

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
        in ``banned`` cannot sample the tokens listed for them."""
        banned = banned or {}
        groups = [_Group() for _ in range(self.groups)]
        where = []  # (group, row) of each sampling segment
        spans = []  # (group, first token) of each segment
        for s in segments:
            r = s.request
            gi = r.slot // self.slots_per_group
            g = groups[gi]
            self.page_table[r.slot, : len(r.pages)] = r.pages
            spans.append((gi, len(g.tokens)))
            tokens = r.tokens
            if score:  # the next token of each scored one, else -1 (decode steps skip this)
                scored = r.request_id in score
                g.targets += [
                    tokens[p + 1] if scored and p + 1 < len(tokens) else -1
                    for p in range(s.start, s.start + s.length)
                ]
            g.tokens += tokens[s.start : s.start + s.length]
            g.positions += range(s.start, s.start + s.length)
            g.seq_ids += [r.slot - gi * self.slots_per_group] * s.length
            if s.samples:
                g.logits_at.append(len(g.tokens) - 1)
                sp = r.sampling
                g.rows.append((sp.temperature, sp.top_p, sp.top_k, seeds[r.request_id], len(r.output)))
                g.banned.append(banned.get(r.request_id, ()))
                g.penalties.append(
                    (
                        r.slot - gi * self.slots_per_group,
                        sp.presence_penalty,
                        sp.frequency_penalty,
                        sp.repetition_penalty,
                        sp.penalized,
                    )
                )
                where.append((gi, len(g.rows) - 1))
        sparse = max(p for g in groups for p in g.positions) + 1 > self.cfg.index_topk
        scoring = any(s.request.request_id in score for s in segments)
        penalized = [s.request for s in segments if s.samples and s.request.sampling.penalized]
        if penalized:
            self._seat_penalized(penalized)
        sampled, logits, scored = self._call(
            groups, sparse=sparse, with_logits=with_logits, with_logprobs=with_logprobs, scoring=scoring
        )
        at = tuple(np.asarray(where, np.intp).reshape(-1, 2).T)  # (group, row) of each sampled segment
        pick = lambda a: None if a is None else a[at]  # noqa: E731
        result = StepResult(pick(sampled.ids), pick(logits), *map(pick, sampled[1:]))
        if scoring:
            result.scores = [
                Scored(*(a[gi, start : start + s.length] for a in scored))
                if s.request.request_id in score
                else None
                for s, (gi, start) in zip(segments, spans)
            ]
        return result

    def _seat_penalized(self, requests: list[Request]) -> None:
        """Fill the penalty rows of requests whose slot's rows were filled for someone else (or
        never): first seated, or back after a preemption that gave their slot away."""
        fresh = [r for r in requests if self.penalty.owners[r.slot] is not r]
        if not fresh:
            return
        per_group = self.slots_per_group
        reset = np.zeros((self.groups, per_group), bool)
        entries = [[] for _ in range(self.groups)]  # (local slot, token, kind, bias)
        for r in fresh:
            gi, local = divmod(r.slot, per_group)
            reset[gi, local] = True
            entries[gi] += [(local, t, _PROMPT, 0.0) for t in set(r.prompt)] + [
                (local, t, _OUTPUT, 0.0) for t in r.output
            ]
            entries[gi] += [(local, t, _BIAS, b) for t, b in r.sampling.logit_bias]
            self.penalty.owners[r.slot] = r
        n = self._bucket_pow2(max(len(e) for e in entries))
        columns = [
            np.full((self.groups, n), per_group, np.int32),
            np.zeros((self.groups, n), np.int32),
            np.zeros((self.groups, n), np.int32),
            np.zeros((self.groups, n), np.float32),
        ]  # padding: slot out of range
        for gi, group in enumerate(entries):
            for column, values in zip(columns, zip(*group)):
                column[gi, : len(values)] = values
        args = self._place(tuple(a.reshape(-1) for a in (reset, *columns)))
        p = self.penalty
        p.counts, p.in_prompt, p.bias = _compiled_fill(self.mesh)({}, p.counts, p.in_prompt, p.bias, *args)

    def reset_penalty_rows(self) -> None:
        """Zeroed rows that no request owns, so each penalized request refills its own before it
        samples again: after a failed step, which may have counted tokens in them or consumed them."""
        self.penalty = self._penalty_state()

    def _penalty_state(self) -> PenaltyState:
        """Zeroed penalty rows for every slot (9 bytes per slot and vocabulary entry), on the
        device, split over the dp groups like the cache."""
        V, S = self.cfg.vocab_size, self.max_num_seqs
        state = (np.zeros((S, V), np.int32), np.zeros((S, V), bool), np.zeros((S, V), np.float32))
        state = self._place(state) if self.mesh is not None else tuple(map(jnp.asarray, state))
        return PenaltyState(*state, owners=[None] * S)

    @staticmethod
    def _bucket_pow2(n: int) -> int:
        """Entries per group padded to a power of two (64 at least), so fills compile a few shapes."""
        return max(64, 1 << (max(n, 1) - 1).bit_length())

    def warmup(self, report=None) -> None:
        """Compile every bucket (and the sparse path when contexts can outgrow index_topk)."""
        variants = [
            (b, sparse) for sparse in ([False, True] if self.can_be_sparse else [False]) for b in self.buckets
        ]
        for i, (b, sparse) in enumerate(variants):
            # All-padding inputs: nothing is written to the cache (slot -1 writes are dropped).
            groups = [_Group(tokens=[0] * b, positions=[0] * b, seq_ids=[-1] * b) for _ in range(self.groups)]
            self._call(groups, sparse=sparse, with_logits=False)
            if report:
                report(i + 1, len(variants))
