"""On-device sampling: greedy, temperature, top-k and top-p, with per-request seeds; penalties;
logprobs.

Each request's key is fold_in(key(seed), n) where n counts its generated tokens, so a seeded
request samples the same tokens whatever else shares its batch, and after a preemption.

Logprobs are those of the model's own distribution (log-softmax of the raw logits, before
temperature and the top-k / top-p filters), as vLLM reports them by default. The top-k / top-p
filters already sort every row; the sort carries the token ids along, so the most likely
``num_logprobs`` tokens come out of it without a second sort.

Penalties follow vLLM: a request's logit bias is added first; then a repetition penalty divides
positive logits (multiplies negative ones) of every token seen in the prompt or the output, and
frequency and presence penalties subtract ``frequency * count + presence * (count > 0)`` over the
output's token counts. They apply to the logits before the bans, temperature and filters;
logprobs stay the model's own.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class Sampled(NamedTuple):
    ids: jax.Array  # [R] int32: the sampled tokens
    logprobs: jax.Array  # [R] float32: log p(ids)
    top_ids: jax.Array  # [R, L] int32: the L most likely tokens, most likely first (ties: lower id first)
    top_logprobs: jax.Array  # [R, L] float32


class Penalties(NamedTuple):
    counts: jax.Array  # [R, V] int32: each token's count in the row's output so far
    in_prompt: jax.Array  # [R, V] bool: tokens of the row's prompt
    presence: jax.Array  # [R] float32 (0: off)
    frequency: jax.Array  # [R] float32 (0: off)
    repetition: jax.Array  # [R] float32 (1: off)
    bias: jax.Array  # [R, V] float32: the row's logit bias (0: none)


def penalize(logits: jax.Array, p: Penalties) -> jax.Array:
    """vLLM's logit bias and penalties on logits [R, V]; a row with all of them off comes back
    bit for bit."""
    logits = logits + p.bias
    seen = p.in_prompt | (p.counts > 0)
    rep = p.repetition[:, None]
    logits = jnp.where(seen, jnp.where(logits > 0, logits / rep, logits * rep), logits)
    return logits - p.frequency[:, None] * p.counts - p.presence[:, None] * (p.counts > 0)


def sample(logits, temperature, top_p, top_k, seeds, counters, banned=None, penalties: Penalties | None = None, *,
           num_logprobs: int = 0) -> Sampled:
    """logits [R, V] float32; per-row temperature/top_p (f32), top_k/seeds/counters (i32);
    ``banned`` [R, B] int32: token ids a row must not pick (ids >= V are padding); ``penalties``
    change the logits a row samples from (not its logprobs).

    ``num_logprobs`` (static) is L, the number of top tokens reported per row (clamped to V).
    Logprobs and top tokens are the model's own, banned tokens included (ties between a banned
    and an unbanned token list the unbanned one first).
    """
    R, V = logits.shape
    raw = logits
    if penalties is not None:
        logits = penalize(logits, penalties)
    if banned is not None:
        logits = logits.at[jnp.arange(R)[:, None], banned].set(-jnp.inf, mode="drop")
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    z = logits / jnp.where(temperature > 0, temperature, 1.0)[:, None]
    # Sorting the logits (stable: ties keep id order, as argmax does) orders z the same way.
    vocab_ids = jnp.broadcast_to(jnp.arange(V, dtype=jnp.int32), (R, V))
    _, order = jax.lax.sort((-logits, vocab_ids), num_keys=1, is_stable=True)
    ordered = jnp.take_along_axis(z, order, axis=-1)
    kth = jnp.take_along_axis(ordered, jnp.clip(top_k - 1, 0, V - 1)[:, None], axis=-1)
    z = jnp.where((top_k[:, None] > 0) & (z < kth), -jnp.inf, z)
    ordered = jnp.where((top_k[:, None] > 0) & (ordered < kth), -jnp.inf, ordered)
    probs = jax.nn.softmax(ordered, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # mass strictly above each sorted token
    cutoff = jnp.min(jnp.where(before < top_p[:, None], ordered, jnp.inf), axis=-1, keepdims=True)
    z = jnp.where(z < cutoff, -jnp.inf, z)
    keys = jax.vmap(lambda s, c: jax.random.fold_in(jax.random.key(s), c))(seeds, counters)
    drawn = jax.vmap(jax.random.categorical)(keys, z).astype(jnp.int32)
    ids = jnp.where(temperature > 0, drawn, greedy)

    lse = jax.nn.logsumexp(raw, axis=-1)
    L = min(num_logprobs, V)
    top_ids = order[:, :L]
    top_raw = jnp.take_along_axis(raw, top_ids, axis=-1)
    if penalties is not None and L:  # the sort ranked penalized logits: rank the raw ones afresh
        top_raw, top_ids = jax.lax.top_k(raw, L)
    elif banned is not None and L:
        # The sort ran without the banned tokens. The unbanned top L is in it, so the raw top L is
        # among those L and the banned ones: a top-k over L + B candidates, not a second sort.
        valid = banned < V
        ids_b = jnp.where(valid, banned, 0)
        vals_b = jnp.where(valid, jnp.take_along_axis(raw, ids_b, axis=-1), -jnp.inf)
        top_raw, pick = jax.lax.top_k(jnp.concatenate([top_raw, vals_b], axis=-1), L)
        top_ids = jnp.take_along_axis(jnp.concatenate([top_ids, ids_b], axis=-1), pick, axis=-1)
    return Sampled(
        ids,
        jnp.take_along_axis(raw, ids[:, None], axis=-1)[:, 0] - lse,
        top_ids,
        top_raw - lse[:, None],
    )


class Scored(NamedTuple):
    logprobs: jax.Array  # [N] float32: log p(target) (meaningless where target < 0)
    top_ids: jax.Array  # [N, L] int32: the L most likely tokens, most likely first
    top_logprobs: jax.Array  # [N, L] float32


def score(logits, targets, *, num_logprobs: int) -> Scored:
    """Each row's log-probability of its target token (the prompt's next token) and top tokens.

    logits [N, V] float32, targets [N] int32. Used for prompt logprobs, where N is every token of
    a step, so the top tokens come from ``lax.top_k`` rather than a full sort of each row.
    """
    lse = jax.nn.logsumexp(logits, axis=-1)
    target = jnp.take_along_axis(logits, jnp.maximum(targets, 0)[:, None], axis=-1)[:, 0] - lse
    L = min(num_logprobs, logits.shape[-1])
    if L == 0:
        return Scored(target, jnp.zeros((logits.shape[0], 0), jnp.int32), jnp.zeros((logits.shape[0], 0), jnp.float32))
    values, ids = jax.lax.top_k(logits, L)  # ties: lower id first, as the sampler's stable sort
    return Scored(target, ids.astype(jnp.int32), values - lse[:, None])
