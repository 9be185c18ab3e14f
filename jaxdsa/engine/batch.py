"""Host-side batch packing: scheduled segments -> one step's padded buffers (numpy).

Shapes come from a small set of buckets so every step compiles once: the token count (per
data-parallel group) is padded to a power of two up to max_num_batched_tokens, the sampled rows
to min(tokens, slots per group); the page table always has max_num_seqs rows, narrowed to what
the family's step mode addresses (:meth:`ModelFamily.page_columns`). With dp groups each group's
tokens form one block of the flat buffers and use group-local slot and page ids (the scheduler
keeps every sequence inside one group).

A token the host does not know yet (a request's pending token under async scheduling) is packed
as 0 with the slot it comes from (:attr:`StepInputs.from_slot`): the step takes it from what the
step before sampled there.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable
from typing import Any

import numpy as np

from jaxdsa.cache import StepMeta
from jaxdsa.engine.buckets import bucket, buckets
from jaxdsa.engine.request import MAX_BANNED_TOKENS, Request
from jaxdsa.engine.scheduler import Segment
from jaxdsa.engine.step import StepInputs
from jaxdsa.models.family import ModelFamily


@dataclasses.dataclass
class _Group:
    """One dp group's share of a step, in group-local ids."""

    tokens: list = dataclasses.field(default_factory=list)
    positions: list = dataclasses.field(default_factory=list)
    from_slot: list = dataclasses.field(default_factory=list)  # per token: its slot if pending, else -1
    seq_ids: list = dataclasses.field(default_factory=list)
    logits_at: list = dataclasses.field(default_factory=list)  # K per row: its verify positions
    rows: list = dataclasses.field(default_factory=list)  # (temperature, top_p, top_k, seed, counter)
    row_slots: list = dataclasses.field(default_factory=list)  # per row: its slot
    banned: list = dataclasses.field(default_factory=list)  # K per row: token ids it must not emit there
    penalties: list = dataclasses.field(
        default_factory=list
    )  # per row: (slot, presence, frequency, repetition, on)
    targets: list = dataclasses.field(default_factory=list)  # next token of each scored token, else -1
    proposed: list = dataclasses.field(default_factory=list)  # K per row: the draft tested there, else V
    following: list = dataclasses.field(default_factory=list)  # per token: the next token if known, else 0
    limits: list = dataclasses.field(default_factory=list)  # per row: positions it has pages for


def _window(request: Request, drafts: tuple[int, ...], start: int, stop: int) -> list[int | None]:
    """The request's tokens at positions ``[start, stop)``: the ones the host knows (prompt, then
    output), then the drafts that follow them; None for a pending token or past the end. Slices
    only the window, so a step's packing does not grow with the context."""
    prompt, output = request.prompt, request.output
    known = len(prompt) + len(output)
    out = prompt[start : min(stop, len(prompt))]
    out += output[max(start - len(prompt), 0) : max(min(stop, known) - len(prompt), 0)]
    out += drafts[max(start - known, 0) : max(stop - known, 0)]
    return out + [None] * (stop - start - len(out))


@dataclasses.dataclass
class StepBatch:
    """One step's buffers and how to read its outputs back: ``where`` (group, row) of each
    sampling segment; with ``scoring``, ``spans`` (group, first token, length) of each segment
    whose tokens are scored, None for the others."""

    inputs: StepInputs
    mode: Hashable
    T: int
    R: int
    scoring: bool
    where: tuple[np.ndarray, np.ndarray]
    spans: list[tuple[int, int, int] | None]
    penalized: list[Request]  # requests that sample under penalties (their rows must be seated)


class BatchPacker:
    """Packs segments into :class:`StepInputs`; owns the host page table (a row per slot)."""

    def __init__(
        self,
        family: ModelFamily,
        cfg: Any,
        *,
        page_size: int,
        max_num_seqs: int,
        max_model_len: int,
        max_num_batched_tokens: int,
        groups: int,
        num_spec: int,
    ):
        self.family, self.cfg = family, cfg
        self.page_size, self.groups, self.num_spec = page_size, groups, num_spec
        self.slots_per_group = max_num_seqs // groups
        self.max_tokens, self.max_model_len = max_num_batched_tokens, max_model_len
        self.page_table = np.zeros((max_num_seqs, -(-max_model_len // page_size)), np.int32)

    def buckets(self, mode: Hashable) -> list[int]:
        """Every token count a step in ``mode`` is padded to: each bucket up to
        ``max_num_batched_tokens``, or up to what every slot of a group holding the mode's whole
        context would fill (a dense DSA step: index_topk tokens a slot), since no step in that mode
        can hold more. Warm-up compiles exactly these."""
        context = self.family.mode_context(self.cfg, mode)
        if context is None:
            return buckets(self.max_tokens)
        return buckets(min(bucket(self.slots_per_group * context), self.max_tokens))

    def pack(
        self,
        segments: list[Segment],
        seeds: dict[str, int],
        *,
        score: frozenset[str],
        banned: dict[str, frozenset[int]],
    ) -> StepBatch:
        """The step over ``segments``: requests in ``score`` have their tokens scored against the
        token after each; requests in ``banned`` cannot emit those tokens at verify positions still
        under their ``min_tokens``."""
        K, V = self.num_spec + 1, self.cfg.vocab_size
        groups = [_Group() for _ in range(self.groups)]
        where, spans, penalized = [], [], []
        for s in segments:
            r = s.request
            gi, local = divmod(r.slot, self.slots_per_group)
            g = groups[gi]
            self.page_table[r.slot, : len(r.pages)] = r.pages
            spans.append((gi, len(g.tokens), s.length) if r.request_id in score else None)
            end = s.start + s.num_run
            window = _window(r, s.drafts, s.start, end + 1)  # the run's tokens and the one after it
            run, after = window[:-1], window[1:]
            if score:  # the next token of each scored one, else -1 (decode steps skip this)
                scored = r.request_id in score
                g.targets += [t if scored and t is not None else -1 for t in after]
            g.tokens += [0 if t is None else t for t in run]
            g.from_slot += [local if t is None else -1 for t in run]
            g.positions += range(s.start, end)
            g.seq_ids += [local] * s.num_run
            if self.num_spec:
                g.following += [0 if t is None else t for t in after]
            if s.samples:
                self._sample_row(g, s, local, seeds[r.request_id], banned.get(r.request_id, ()), K, V)
                where.append((gi, len(g.rows) - 1))
                if r.sampling.penalized:
                    penalized.append(r)
        # the drafts of this step reach num_spec - 1 positions past its last verified one
        furthest = max(p for g in groups for p in g.positions) + max(self.num_spec - 1, 0)
        mode = self.family.step_mode(self.cfg, max_position=furthest)
        scoring = any(s.request.request_id in score for s in segments)
        at = np.asarray(where, np.intp).reshape(-1, 2).T
        return self._buffers(groups, mode, scoring, (at[0], at[1]), spans, penalized)

    def _sample_row(self, g: _Group, s: Segment, local: int, seed: int, banned, K: int, V: int) -> None:
        r, sp, n = s.request, s.request.sampling, len(s.drafts)
        last = len(g.tokens) - 1 - n  # the request's last token; its drafts follow
        g.logits_at += [last + min(j, n) for j in range(K)]
        g.proposed += list(s.drafts) + [V] * (K - n)
        g.rows.append((sp.temperature, sp.top_p, sp.top_k, seed, r.num_output))
        g.row_slots.append(local)
        g.banned += [banned if r.num_output + j < sp.min_tokens else () for j in range(K)]
        g.penalties.append(
            (local, sp.presence_penalty, sp.frequency_penalty, sp.repetition_penalty, sp.penalized)
        )
        g.limits.append(min(len(r.pages) * self.page_size, self.max_model_len))

    def padding(self, tokens: int, mode: Hashable) -> StepBatch:
        """A step of ``tokens`` padding tokens per group (nothing written, nothing sampled): warm-up."""
        groups = [
            _Group(tokens=[0] * tokens, positions=[0] * tokens, seq_ids=[-1] * tokens)
            for _ in range(self.groups)
        ]
        empty = np.zeros(0, np.intp)
        return self._buffers(groups, mode, False, (empty, empty), [], [])

    def _buffers(self, groups: list[_Group], mode, scoring: bool, where, spans, penalized) -> StepBatch:
        """The buffers padded to the bucket of T tokens and R sampled rows."""
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

        columns = self.family.page_columns(self.cfg, mode, self.page_size, self.page_table.shape[1])
        verify_at = flat("logits_at", R * K, 0)
        logits_at = np.tile(np.arange(T, dtype=np.int32), len(groups)) if scoring else verify_at
        meta = StepMeta(flat("seq_ids", T, -1), np.array(self.page_table[:, :columns]), logits_at)
        # (slot, presence, frequency, repetition, on); padding rows neutral: slot 0, 0, 0, 1, off
        neutral = ((0, np.int32), (0, np.float32), (0, np.float32), (1, np.float32), (False, bool))
        rows = ((0, np.float32), (1, np.float32), (0, np.int32), (0, np.int32), (0, np.int32))
        inputs = StepInputs(
            tokens=flat("tokens", T, 0),
            positions=flat("positions", T, 0),
            from_slot=flat("from_slot", T, -1),
            meta=meta,
            rows=tuple(per_row("rows", c, fill, dt) for c, (fill, dt) in enumerate(rows)),
            row_slots=flat("row_slots", R, self.slots_per_group),  # padding: out of range, dropped
            banned=banned.reshape(-1, MAX_BANNED_TOKENS),
            penalty_rows=tuple(per_row("penalties", c, fill, dt) for c, (fill, dt) in enumerate(neutral)),
            proposed=flat("proposed", R * K, V).reshape(-1, K),
            drafting=(flat("following", T, 0), flat("limits", R, 0)) if self.num_spec else (),
            scoring=(flat("targets", T, -1), verify_at) if scoring else (),
        )
        return StepBatch(inputs, mode, T, R, scoring, where, spans, penalized)
