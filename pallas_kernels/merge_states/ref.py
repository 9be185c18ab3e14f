"""Pure-JAX oracle for the log-sum-exp merge of partial attention states."""

from __future__ import annotations

import jax.numpy as jnp


def merge_states(outs, lses, sink=None):
    """outs [n,T,H,D] (each normalized within its part), lses [n,T,H] -> (out [T,H,D], lse [T,H]).

    With ``sink [H]``, exp(sink) joins the merged denominator once. Parts with lse = -inf weigh 0;
    if every part is empty the output is 0 and lse is -inf (or the sink).
    """
    lses = lses.astype(jnp.float32)
    m = jnp.max(lses, axis=0)
    if sink is not None:
        m = jnp.maximum(m, sink.astype(jnp.float32)[None, :])
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    w = jnp.exp(lses - m[None])  # [n,T,H]; exp(-inf) = 0
    denom = jnp.sum(w, axis=0)
    if sink is not None:
        denom = denom + jnp.exp(sink.astype(jnp.float32)[None, :] - m)
    num = jnp.einsum("nth,nthd->thd", w, outs.astype(jnp.float32))
    safe = jnp.where(denom > 0, denom, 1.0)
    out = num / safe[..., None]
    lse = jnp.where(denom > 0, m + jnp.log(safe), -jnp.inf)
    return out.astype(outs.dtype), lse
