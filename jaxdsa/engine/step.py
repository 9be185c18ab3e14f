"""The jitted step: the model over one packed batch, sampling and the next step's drafts, as one
XLA computation per (bucket, mode) shape.

The model is split once (:class:`ModelState`): the step is a pure function of the parameter
leaves, the device state it carries from step to step (the cache, the next-n layers' cache, the
penalty rows of :mod:`jaxdsa.engine.penalties`, the last token each slot sampled) and the step's
host buffers (:class:`StepInputs`); it merges the module tree only while tracing, so a step costs
no graph traversal on the host. The carried state is donated: each step updates it in place.

Under async scheduling a step is launched before the tokens of the step before it reach the
host: a token the host does not know yet comes from the device (``StepInputs.from_slot``: the
slot whose last sampled token it is), and every step records the last token each of its rows
emitted, by slot (:func:`fused_step`).

The host sends a step's buffers as one int32 array (:func:`pack_inputs`), which the step takes
apart on the device (:func:`unpack_inputs`): one transfer per device instead of one per buffer
(about twenty, each a host-side transfer call, on every device of a mesh).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxdsa import sharding
from jaxdsa.cache import StepMeta
from jaxdsa.engine.sampling import Penalties, score
from jaxdsa.engine.speculative import verify
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


class StepInputs(NamedTuple):
    """A step's host buffers over T tokens and R sampling rows per dp group (flat over the groups),
    K = drafts + 1 verify positions per row.

    ``from_slot`` [T]: -1, or the group-local slot whose last sampled token is this token (one the
    host does not know yet). ``rows`` = (temperature, top_p, top_k, seed, counter) [R] per row,
    ``row_slots`` [R]: the slot of each row (out of range for padding), ``banned`` [R * K, B],
    ``penalty_rows`` = (slot, presence, frequency, repetition, on) [R], ``proposed`` [R, K]: the
    draft each verify position tests (V: none), ``drafting`` = (following [T], limits [R]) with
    speculative decoding, ``scoring`` = (targets [T], verify rows [R * K]) when some token is
    scored (:func:`fused_step`); empty tuples otherwise."""

    tokens: Any
    positions: Any
    from_slot: Any
    meta: StepMeta
    rows: tuple
    row_slots: Any
    banned: Any
    penalty_rows: tuple
    proposed: Any
    drafting: tuple
    scoring: tuple


@dataclasses.dataclass(frozen=True)
class InputLayout:
    """Where a step's :class:`StepInputs` lie in the int32 array :func:`pack_inputs` makes: the
    tree's structure and each buffer's shape (one dp group's share) and dtype, in order. It
    depends only on the step's shapes, so each compiled step has one."""

    treedef: Any
    leaves: tuple[tuple[tuple[int, ...], str], ...]  # (shape per group, dtype name)


_PACKED = {"int32": lambda a: a, "float32": lambda a: a.view(np.int32), "bool": lambda a: a.astype(np.int32)}


def pack_inputs(inputs: StepInputs, groups: int) -> tuple[np.ndarray, InputLayout]:
    """``inputs`` (numpy; every buffer's leading dim split into ``groups`` dp groups, group-major)
    as one ``[groups, words]`` int32 array, each group's row holding its share of every buffer
    (float32 by its bits, bool as 0 / 1), and the layout that reads it back."""
    leaves, treedef = jax.tree.flatten(inputs)
    rows, shapes = [], []
    for leaf in leaves:
        a = np.asarray(leaf)
        if a.dtype.name not in _PACKED:
            raise TypeError(f"a step buffer of dtype {a.dtype} (packed: {', '.join(_PACKED)})")
        if a.ndim == 0 or a.shape[0] % groups:
            raise ValueError(f"a step buffer of shape {a.shape} does not split into {groups} groups")
        rows.append(_PACKED[a.dtype.name](a).reshape(groups, -1))
        shapes.append(((a.shape[0] // groups, *a.shape[1:]), a.dtype.name))
    packed = np.concatenate(rows, axis=1) if rows else np.zeros((groups, 0), np.int32)
    return packed, InputLayout(treedef, tuple(shapes))


def unpack_inputs(packed: jax.Array, layout: InputLayout) -> StepInputs:
    """One dp group's row of :func:`pack_inputs`' array (``[1, words]``) -> its :class:`StepInputs`."""
    words, leaves, at = packed.reshape(-1), [], 0
    for shape, dtype in layout.leaves:
        part = words[at : at + math.prod(shape)].reshape(shape)
        at += math.prod(shape)
        if dtype == "float32":
            part = jax.lax.bitcast_convert_type(part, jnp.float32)
        elif dtype == "bool":
            part = part != 0
        leaves.append(part)
    return jax.tree.unflatten(layout.treedef, leaves)


def fused_step(
    leaves,
    cache,
    mtp_cache,
    penalty_state,
    slot_tokens,
    inputs: StepInputs,
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
    sample row (its last token, then its drafts). With ``scoring`` the model returned logits for
    every token (meta.logits_indices covers them all): each token is scored against its target
    (the prompt's next token) and the verify rows are picked after. ``penalty_state`` = (counts,
    in_prompt, bias) [slots, V]: the ``on`` rows sample under their penalties and add the tokens
    they emit to their slot's counts. ``slot_tokens`` [slots]: the last token each slot sampled,
    read for the tokens ``from_slot`` names and updated with what this step's rows emit. Returns
    ``sampled`` [R, K + 1 + N] (each row's emitted ids, how many, its next drafts), the Verified
    rows (logprobs), logits, scores and the carried state."""
    model = state.model(leaves)
    meta = inputs.meta
    R, K = inputs.proposed.shape
    tokens = jnp.where(inputs.from_slot >= 0, slot_tokens[jnp.maximum(inputs.from_slot, 0)], inputs.tokens)
    hidden, cache = family.hidden(model, tokens, inputs.positions, cache, meta, mode)
    logits = family.logits(model, hidden[meta.logits_indices])  # the rows of family.step
    scored = None
    if inputs.scoring:
        targets, verify_rows = inputs.scoring
        scored = score(logits, targets, num_logprobs=num_logprobs)
        logits = logits[verify_rows]
    # The sampled rows whole on every device: the sampler's fallback to a full sort is a lax.cond,
    # and a vocabulary split over TP would put a collective inside it, which XLA's GPU backend
    # cannot capture in a CUDA graph: it would read the predicate on the host, stalling every
    # step's launching until the device got there.
    logits = sharding.constrain(logits, ("batch", None))
    penalties = Penalties(*penalty_state, *inputs.penalty_rows)
    verified = verify(
        logits.reshape(R, K, -1),
        inputs.proposed,
        *inputs.rows,
        inputs.banned.reshape(R, K, -1),
        penalties,
        num_logprobs=num_logprobs,
    )
    emitted = (jnp.arange(K) < verified.num_emitted[:, None]) & penalties.on[:, None]
    counts = penalties.counts.at[penalties.slot[:, None], verified.tokens].add(emitted.astype(jnp.int32))
    last = verified.tokens[jnp.arange(R), verified.num_emitted - 1]
    slot_tokens = slot_tokens.at[inputs.row_slots].set(last, mode="drop")
    drafts = jnp.zeros((R, 0), jnp.int32)
    if layers:
        verify_at = (inputs.scoring[1] if inputs.scoring else meta.logits_indices).reshape(R, K)
        drafts, mtp_cache = _draft(
            family, model, hidden, inputs.positions, meta, mtp_cache, mode, verified, verify_at,
            *inputs.drafting, layers,
        )  # fmt: skip
    logits = logits if with_logits else jnp.zeros((logits.shape[0], 0), jnp.float32)
    penalty_state = (counts, penalties.in_prompt, penalties.bias)
    # what the host reads of every step, in one array (one copy): emitted ids | how many | drafts
    sampled = jnp.concatenate([verified.tokens, verified.num_emitted[:, None], drafts], axis=1)
    return sampled, verified, logits, scored, cache, mtp_cache, penalty_state, slot_tokens


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


def jit_fused_step(
    family: ModelFamily,
    state: ModelState,
    mesh,
    *,
    cache_axes,
    mtp_cache_axes,
    mode,
    with_logits: bool,
    num_logprobs: int,
    layers: tuple[int, ...],
    layout: InputLayout,
):
    """The jitted :func:`fused_step` of one (mode, with_logits, input layout) variant, taking its
    inputs packed (:func:`pack_inputs`); its carried state donated."""

    def fused_step_packed(leaves, cache, mtp_cache, penalty_state, slot_tokens, packed):
        return fused_step(
            leaves,
            cache,
            mtp_cache,
            penalty_state,
            slot_tokens,
            unpack_inputs(packed, layout),
            family=family,
            state=state,
            mode=mode,
            with_logits=with_logits,
            num_logprobs=num_logprobs,
            layers=layers,
        )

    return sharding.jit_step(
        fused_step_packed,
        mesh,
        donate_argnums=(1, 2, 3, 4),
        in_axes=(state.axes, cache_axes, mtp_cache_axes),
        out_axes=(None, None, None, None, cache_axes, mtp_cache_axes, None, None),
    )


@functools.cache
def jit_sequence_logits(family: ModelFamily, graphdef, treedef, axes: tuple, cache_axes: tuple, mode, mesh):
    """The jitted forward of one sequence (logits of every token) for a model structure and mode;
    the cache it fills is donated."""

    def fn(leaves, cache, tokens, positions, meta):
        model = nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves))
        return family.step(model, tokens, positions, cache, meta, mode)

    cache_axes = dict(cache_axes)
    return sharding.jit_step(
        fn, mesh, donate_argnums=(1,), in_axes=(axes, cache_axes), out_axes=(None, cache_axes)
    )
