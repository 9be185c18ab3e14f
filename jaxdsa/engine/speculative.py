"""Speculative decoding with the model's next-n (MTP) layers: configuration and verification.

Each decode step runs the main model over a sequence's last token and the ``N`` tokens the MTP
layer drafted for it, then :func:`verify` decides how many drafts to keep. Drafts are the MTP
layer's argmax (as vLLM drafts them), so the draft distribution is a point mass ``q = δ(d)`` and
the rejection rule of Leviathan et al. / Chen et al. becomes: accept ``d`` with probability
``min(1, p(d) / q(d)) = p(d)``; on rejection draw from the residual ``max(p - q, 0)``, which is
``p`` without ``d``, renormalized. The emitted token then has exactly the distribution ``p``:
``P(d) = p(d)`` and ``P(x) = (1 - p(d)) · p(x) / (1 - p(d))`` for ``x ≠ d``. Greedy rows accept a
draft iff it is the argmax, so their output is the main model's greedy output. ``p`` is the row's
distribution after everything :func:`jaxdsa.engine.sampling.sample` applies (penalties counted
over the drafts before each position, bans, temperature, top-k, top-p).

Randomness: position ``j`` of a row draws from ``fold_in(key(seed), counter + j)`` (the key the
plain sampler would use for that token), its acceptance test from a key folded from it; a step
without drafts therefore samples exactly as the engine without speculation does.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jaxdsa.engine.sampling import Penalties, Sampled, process, report, sample

METHODS = ("mtp", "deepseek_mtp")  # vLLM's names of the method: the model's own next-n layers
MAX_SPECULATIVE_TOKENS = 5


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's ``--speculative-config``: ``{"method": "mtp", "num_speculative_tokens": N}``."""

    method: str = "mtp"
    num_speculative_tokens: int = 1

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"speculative method {self.method!r}: jaxdsa drafts with {' or '.join(METHODS)}")
        n = self.num_speculative_tokens
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(
                f"num_speculative_tokens must be an integer in [1, {MAX_SPECULATIVE_TOKENS}], got {n!r}"
            )

    @classmethod
    def parse(cls, value: str | Mapping[str, Any] | SpeculativeConfig | None) -> SpeculativeConfig | None:
        """From vLLM's JSON string or dict (unknown keys are an error, not silently dropped)."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative config is not JSON: {e}") from None
        if not isinstance(value, Mapping):
            raise ValueError(f"speculative config must be a JSON object, got {value!r}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative config: unknown key(s) {unknown}; jaxdsa reads {sorted(known)}")
        if "num_speculative_tokens" not in value:
            raise ValueError("speculative config needs num_speculative_tokens")
        return cls(**value)


class Verified(NamedTuple):
    """Per row: the tokens a verify step emits (the accepted drafts, then one the main model chose)."""

    tokens: jax.Array  # [R, K] int32; entries past num_emitted are meaningless
    num_emitted: jax.Array  # [R] int32 in [1, K]: accepted drafts + 1
    logprobs: jax.Array  # [R, K] float32: the main model's log p of each emitted token
    top_ids: jax.Array  # [R, K, L] int32
    top_logprobs: jax.Array  # [R, K, L] float32


def verify(
    logits,
    proposed,
    temperature,
    top_p,
    top_k,
    seeds,
    counters,
    banned,
    penalties: Penalties,
    *,
    num_logprobs: int,
) -> Verified:
    """logits [R, K, V] at a row's K verify positions; ``proposed`` [R, K] int32: the draft each
    position tests (the token after it), V where it tests none (past the row's drafts, and the
    last position); ``banned`` [R, K, B]; per-row sampling parameters and ``penalties`` as for
    :func:`jaxdsa.engine.sampling.sample`, the counter being the row's first position's."""
    R, K, V = logits.shape
    per_position = lambda a: jnp.repeat(a, K, axis=0)  # noqa: E731
    counter = per_position(counters) + jnp.tile(jnp.arange(K, dtype=counters.dtype), R)
    flat = logits.reshape(R * K, V)
    banned = banned.reshape(R * K, -1)
    rows = (per_position(temperature), per_position(top_p), per_position(top_k))
    if K == 1:  # nothing to verify: the plain sampler, bit for bit
        s = sample(flat, *rows, seeds, counter, banned, penalties, num_logprobs=num_logprobs)
        return _shaped(s.ids, jnp.ones(R, jnp.int32), s, R, K)
    pr = process(flat, *rows, banned, _at_positions(penalties, proposed))
    draft = proposed.reshape(-1)
    keys = jax.vmap(lambda s, c: jax.random.fold_in(jax.random.key(s), c))(per_position(seeds), counter)
    has_draft = draft < V
    log_p = jax.nn.log_softmax(pr.z, axis=-1)
    p_draft = jnp.where(
        has_draft, jnp.exp(jnp.take_along_axis(log_p, jnp.minimum(draft, V - 1)[:, None], -1)[:, 0]), 0
    )
    u = jax.vmap(lambda k: jax.random.uniform(jax.random.fold_in(k, 1)))(keys)
    accept = has_draft & jnp.where(pr.sampled, u < p_draft, draft == pr.greedy)
    residual = pr.z.at[jnp.arange(R * K), draft].set(-jnp.inf, mode="drop")
    drawn = jax.vmap(jax.random.categorical)(keys, residual).astype(jnp.int32)
    replacement = jnp.where(pr.sampled, drawn, pr.greedy)  # a rejected greedy draft is not the argmax
    kept = jnp.cumprod(accept.reshape(R, K), axis=1).sum(axis=1).astype(jnp.int32)
    tokens = jnp.where(jnp.arange(K) < kept[:, None], proposed, replacement.reshape(R, K))
    s = report(pr, tokens.reshape(-1), banned, True, num_logprobs)
    return _shaped(tokens.reshape(-1), kept + 1, s, R, K)


def _shaped(ids, num_emitted, s: Sampled, R: int, K: int) -> Verified:
    return Verified(
        ids.reshape(R, K),
        num_emitted,
        s.logprobs.reshape(R, K),
        s.top_ids.reshape(R, K, -1),
        s.top_logprobs.reshape(R, K, -1),
    )


def _at_positions(p: Penalties, proposed) -> Penalties:
    """Penalties per verify position: position j counts the drafts before it as output tokens
    (they are the output there if it is reached); one row per (row, position)."""
    R, K = proposed.shape
    V = p.counts.shape[1]
    later = jnp.arange(K)[None, :] + 1  # a draft tested at j is output from position j + 1 on
    added = (
        jnp.zeros((R, K + 1, V), jnp.int32).at[jnp.arange(R)[:, None], later, proposed].add(1, mode="drop")
    )
    counts = (p.counts[p.slot][:, None, :] + jnp.cumsum(added[:, :K], axis=1)).reshape(R * K, V)
    per_position = lambda a: jnp.repeat(a, K, axis=0)  # noqa: E731
    return Penalties(
        counts,
        per_position(p.in_prompt[p.slot]),
        per_position(p.bias[p.slot]),
        jnp.arange(R * K, dtype=jnp.int32),
        per_position(p.presence),
        per_position(p.frequency),
        per_position(p.repetition),
        per_position(p.on),
    )
