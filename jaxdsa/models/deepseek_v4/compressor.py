"""The KV compressor of CSA / HCA layers (models.md §3.4): one entry per complete window of m tokens.

Per source token the compressor projects ``C = x wkv`` and gate logits ``Z = x wgate`` (width
``c * d``; c = 2 with overlapping windows, i.e. CSA); the token at offset o of its window scores
``Z + ape[o]``. Entry w is the per-channel softmax-weighted sum of its window's rows (CSA: the first
d channels of window w - 1's rows and the last d channels of window w's rows, 2m slots), RMSNorm'ed,
then roped at position ``w * m`` (the window's first token) with the compress RoPE.

State for chunked prefill and decode (phase 2) is explicit: a chunk's complete windows are pooled by
:func:`entries_from_windows` given ``first_window`` (their index) and ``prev`` (the previous
window's first-half rows, CSA only); a chunk leaves behind its ``T mod m`` trailing rows
(``C`` and ``Z + ape``) and, for CSA, its last complete window's first-half rows.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxdsa import ops
from jaxdsa.models.deepseek_v4.config import V4Config
from jaxdsa.models.deepseek_v4.rotary import compress_rope_tables, rotate_tail


def source_rows(p: dict, x: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Per token ``(C, Z + ape[pos mod m])`` in float32, [T, c d] each."""
    x32 = x.astype(jnp.float32)
    kv = jnp.matmul(x32, p["wkv"].astype(jnp.float32), precision="highest")
    gate = jnp.matmul(x32, p["wgate"].astype(jnp.float32), precision="highest")
    ratio = p["ape"].shape[0]
    return kv, gate + p["ape"][positions % ratio]


def entries_from_windows(
    p: dict,
    kv: jax.Array,
    score: jax.Array,
    first_window: jax.Array | int,
    cfg: V4Config,
    *,
    prev: tuple[jax.Array, jax.Array] | None = None,
) -> jax.Array:
    """Entries [W, d] of W complete windows ``kv, score [W, m, c d]`` whose first is ``first_window``.

    ``prev = (kv [m, d], score [m, d])``: the first-half rows of window ``first_window - 1`` (CSA);
    None when there is none (weight 0), e.g. the first window of a sequence.
    """
    prev_kv, prev_score = prev if prev is not None else (None, None)
    pooled = ops.compress_pool(
        kv, score, p["norm"], eps=cfg.rms_norm_eps, prev_kv=prev_kv, prev_score=prev_score
    )
    ratio = kv.shape[1]
    cos, sin = compress_rope_tables(cfg, (first_window + jnp.arange(kv.shape[0], dtype=jnp.int32)) * ratio)
    return rotate_tail(pooled, cos, sin)


def compress_sequence(p: dict, x: jax.Array, cfg: V4Config) -> jax.Array:
    """All complete windows of a sequence that starts at position 0: [T // m, d]."""
    ratio = p["ape"].shape[0]
    windows = x.shape[0] // ratio
    kv, score = source_rows(p, x[: windows * ratio], jnp.arange(windows * ratio, dtype=jnp.int32))
    kv, score = (a.reshape(windows, ratio, -1) for a in (kv, score))
    return entries_from_windows(p, kv, score, 0, cfg)
