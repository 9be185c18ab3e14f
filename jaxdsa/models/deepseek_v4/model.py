"""The DeepSeek-V4 forward over a whole sequence (no cache), as pure functions of a params pytree.

``forward(params, ids, cfg) -> logits [T, V]`` runs embedding -> hc_mult streams -> blocks -> HC
head -> norm -> head. A block is two hyper-connection sites around attention and the MoE.
``mtp_logits`` runs the MTP block on the main model's final streams (DeepSeek's ``MTPBlock``;
HF has none). ``greedy`` recomputes the whole forward per generated token on a fixed-length buffer:
every V4 component is causal, so padding after position t never changes the logits at t.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxdsa.layers.norms import rms_norm
from jaxdsa.models.deepseek_v4 import hyper
from jaxdsa.models.deepseek_v4.attention import attention_sequence
from jaxdsa.models.deepseek_v4.config import V4Config
from jaxdsa.models.deepseek_v4.moe import moe


def block(lp: dict, x: jax.Array, ids: jax.Array, cfg: V4Config, layer: int) -> jax.Array:
    """One block on streams ``x [T, n, D]``; ``ids`` are the tokens (hash routing)."""
    h, post, comb = hyper.site_in(lp["hc_attn"], x, cfg)
    a = attention_sequence(lp["attn"], rms_norm(h, lp["attn_norm"], cfg.rms_norm_eps), cfg, layer)
    x = hyper.site_out(x, a, post, comb)
    h, post, comb = hyper.site_in(lp["hc_ffn"], x, cfg)
    f = moe(
        lp["ffn"], rms_norm(h, lp["ffn_norm"], cfg.rms_norm_eps), ids, cfg, hashed=cfg.is_hash_layer(layer)
    )
    return hyper.site_out(x, f, post, comb)


@functools.partial(jax.jit, static_argnames="cfg")
def streams(params: dict, ids: jax.Array, cfg: V4Config) -> jax.Array:
    """The residual streams after the last block [T, n, D] (also the MTP block's input)."""
    x = hyper.expand(params["embed"][ids], cfg)
    for layer, lp in enumerate(params["layers"]):
        x = block(lp, x, ids, cfg, layer)
    return x


@functools.partial(jax.jit, static_argnames="cfg")
def head_logits(params: dict, x: jax.Array, hc_head: dict, norm: jax.Array, cfg: V4Config) -> jax.Array:
    """HC head, final norm and the (shared) output head: streams [T, n, D] -> logits [T, V] float32."""
    y = rms_norm(hyper.head(hc_head, x, cfg), norm, cfg.rms_norm_eps)
    return jnp.matmul(y, params["head"], preferred_element_type=jnp.float32, precision="highest")


def forward(params: dict, ids: jax.Array, cfg: V4Config) -> jax.Array:
    """Logits [T, V] float32 of a sequence starting at position 0."""
    cfg = cfg.architecture()
    return head_logits(params, streams(params, ids, cfg), params["hc_head"], params["norm"], cfg)


def mtp_logits(params: dict, ids: jax.Array, cfg: V4Config) -> jax.Array:
    """MTP logits [T - 1, V]: row t predicts token t + 2 from the main streams at t and token t + 1.

    ``e = enorm(E[x_{t+1}])``, ``X = e_proj(e)`` broadcast to every stream ``+ h_proj(hnorm(X_t))``
    (hnorm per stream), one block at positions 0..T-2, then the MTP's own HC head and norm and the
    shared head.
    """
    cfg = cfg.architecture()
    x = mtp_block(params, streams(params, ids, cfg)[:-1], ids[1:], cfg)
    mp = params["mtp"][0]
    return head_logits(params, x, mp["hc_head"], mp["norm"], cfg)


@functools.partial(jax.jit, static_argnames="cfg")
def mtp_block(params: dict, x: jax.Array, next_ids: jax.Array, cfg: V4Config) -> jax.Array:
    """The MTP block's streams from the main streams ``x [T, n, D]`` and the next tokens [T]."""
    mp = params["mtp"][0]
    e = rms_norm(params["embed"][next_ids], mp["enorm"], cfg.rms_norm_eps)
    h = rms_norm(x, mp["hnorm"], cfg.rms_norm_eps)
    x = jnp.matmul(e, mp["e_proj"], precision="highest")[:, None, :] + jnp.matmul(
        h, mp["h_proj"], precision="highest"
    )
    return block(mp, x, next_ids, cfg, cfg.num_hidden_layers)


def greedy(
    params: dict, prompt: np.ndarray, steps: int, cfg: V4Config, *, length: int | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Greedy continuation: (tokens [steps], logits [steps, V]) recomputing the forward each step on
    one buffer of ``length`` (default: just long enough) tokens, so it compiles once."""
    n = len(prompt)
    length = length or n + steps - 1
    if length < n + steps - 1:
        raise ValueError(f"a buffer of {length} tokens cannot hold {n} + {steps} - 1")
    buf = np.zeros(length, np.int32)
    buf[:n] = prompt
    tokens, logits = [], []
    for i in range(steps):
        row = np.asarray(forward(params, jnp.asarray(buf), cfg)[n - 1 + i])
        logits.append(row)
        tokens.append(int(np.argmax(row)))
        if i + 1 < steps:
            buf[n + i] = tokens[-1]
    return np.array(tokens, np.int32), np.stack(logits)
