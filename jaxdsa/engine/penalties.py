"""Device rows for presence / frequency / repetition penalties and logit biases, one per slot.

Penalties need per-request rows over the vocabulary (output token counts, prompt-token flags, a
bias row: 9 bytes per slot and vocabulary entry), kept on the device and split over the dp groups
like the cache. Every step samples from the penalized logits (rows without penalties are
neutral) and adds the tokens its penalized rows sample to their counts (in the step itself), so
requests with and without penalties share one compiled step. A request taking a slot whose rows
were filled for someone else (first seated, or back after a preemption gave its slot away) has
its rows filled from its prompt, output and bias first (:meth:`PenaltyRows.seat`). Under async
scheduling a request may be seated while its last token is still on the device: that token is
counted from the slot tokens the steps keep (:mod:`jaxdsa.engine.step`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxdsa import sharding
from jaxdsa.engine.buckets import bucket
from jaxdsa.engine.request import Request

# kinds of the entries that fill a slot's penalty rows; _PENDING: an output token still on the device
_PROMPT, _OUTPUT, _BIAS, _PENDING = range(4)
BYTES_PER_ENTRY = 4 + 1 + 4  # per slot and vocabulary entry: counts (int32), in_prompt (bool), bias (f32)


def _fill_rows(counts, in_prompt, bias, slot_tokens, reset, slot, token, kind, value):
    """Penalty rows of newly seated requests: rows with ``reset`` cleared, then each (slot, token)
    entry marked (a prompt token), counted (an output token; a pending one is the slot's last
    sampled token in ``slot_tokens``) or given its bias ``value``; out-of-range slots are padding."""
    clear = reset[:, None]
    pending = kind == _PENDING
    token = jnp.where(pending, slot_tokens[jnp.clip(slot, 0, slot_tokens.shape[0] - 1)], token)
    output = (kind == _OUTPUT) | pending
    counts = jnp.where(clear, 0, counts).at[slot, token].add(output.astype(jnp.int32), mode="drop")
    in_prompt = jnp.where(clear, False, in_prompt).at[slot, token].max(kind == _PROMPT, mode="drop")
    biased = jnp.where(kind == _BIAS, slot, counts.shape[0])  # other kinds: dropped
    bias = jnp.where(clear, 0.0, bias).at[biased, token].set(value, mode="drop")
    return counts, in_prompt, bias


@functools.cache
def _compiled_fill(mesh):
    return sharding.jit_step(_fill_rows, mesh, donate_argnums=(0, 1, 2))


class PenaltyRows:
    """``counts`` [slots, V] int32, ``in_prompt`` [slots, V] bool, ``bias`` [slots, V] float32, and
    per slot the request its rows were filled for."""

    def __init__(self, slots: int, vocab: int, groups: int, mesh, place: Callable, home=None):
        """``place`` puts host arrays where a step takes them; ``home``: without a mesh, the
        parameters' device sharding, which the rows are committed to as the steps' outputs are."""
        state = (
            np.zeros((slots, vocab), np.int32),
            np.zeros((slots, vocab), bool),
            np.zeros((slots, vocab), np.float32),
        )
        self.counts, self.in_prompt, self.bias = (
            place(state) if mesh is not None else jax.device_put(state, home)
        )
        self.owners: list[Request | None] = [None] * slots
        self.groups, self.slots_per_group, self.mesh, self._place = groups, slots // groups, mesh, place

    @property
    def state(self) -> tuple[jax.Array, jax.Array, jax.Array]:
        return self.counts, self.in_prompt, self.bias

    @state.setter
    def state(self, value) -> None:
        self.counts, self.in_prompt, self.bias = value

    def seat(self, requests: list[Request], slot_tokens: jax.Array) -> None:
        """Fill the rows of the requests whose slot's rows were filled for someone else (or never);
        ``slot_tokens``: the last token each slot sampled (a pending token is read there)."""
        fresh = [r for r in requests if self.owners[r.slot] is not r]
        if not fresh:
            return
        per_group = self.slots_per_group
        reset = np.zeros((self.groups, per_group), bool)
        entries = [[] for _ in range(self.groups)]  # (local slot, token, kind, bias)
        for r in fresh:
            gi, local = divmod(r.slot, per_group)
            reset[gi, local] = True
            entries[gi] += [(local, t, _PROMPT, 0.0) for t in set(r.prompt)]
            entries[gi] += [(local, t, _OUTPUT, 0.0) for t in r.output]
            entries[gi] += [(local, 0, _PENDING, 0.0)] * r.pending  # at most one: the step before's
            entries[gi] += [(local, t, _BIAS, b) for t, b in r.sampling.logit_bias]
            self.owners[r.slot] = r
        n = bucket(max(len(e) for e in entries), minimum=64)  # a few fill shapes compile
        columns = [  # padding: slot out of range
            np.full((self.groups, n), per_group, np.int32),
            np.zeros((self.groups, n), np.int32),
            np.zeros((self.groups, n), np.int32),
            np.zeros((self.groups, n), np.float32),
        ]
        for gi, group in enumerate(entries):
            for column, values in zip(columns, zip(*group)):
                column[gi, : len(values)] = values
        args = self._place(tuple(a.reshape(-1) for a in (reset, *columns)))
        self.state = _compiled_fill(self.mesh)(*self.state, slot_tokens, *args)
