"""The compressor's explicit state: pooling a sequence chunk by chunk, carrying what the module
docstring says (the partial window's rows; for CSA the last complete window's first-half rows),
gives exactly the entries of the whole sequence. This is the contract phase 2's decode builds on."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxdsa.models.deepseek_v4 import compressor
from jaxdsa.models.deepseek_v4.config import tiny_v4_config

CFG = tiny_v4_config()
_rows = jax.jit(compressor.source_rows)
_pool = jax.jit(compressor.entries_from_windows, static_argnames="cfg")


def _params(seed: int, ratio: int, overlap: bool, width: int = 32):
    c, d = 2 if overlap else 1, CFG.hidden_size
    ks = jax.random.split(jax.random.key(seed), 4)
    return {
        "wkv": jax.random.normal(ks[0], (d, c * width)) * d**-0.5,
        "wgate": jax.random.normal(ks[1], (d, c * width)) * d**-0.5,
        "ape": jax.random.normal(ks[2], (ratio, c * width)),
        "norm": 1.0 + 0.1 * jax.random.normal(ks[3], (width,)),
    }


def _chunked(p, x, cuts, ratio, overlap):
    """Feed x in chunks ending at ``cuts``; pool each chunk's complete windows with carried state."""
    width = p["norm"].shape[0]
    carry_kv = carry_score = jnp.zeros((0, p["wkv"].shape[1]))  # rows of the partial window
    prev, entries, start = None, [], 0
    for end in [*cuts, x.shape[0]]:
        kv, score = _rows(p, x[start:end], jnp.arange(start, end))
        kv, score = jnp.concatenate([carry_kv, kv]), jnp.concatenate([carry_score, score])
        first_window, windows = (start - carry_kv.shape[0]) // ratio, kv.shape[0] // ratio
        if windows:
            w_kv = kv[: windows * ratio].reshape(windows, ratio, -1)
            w_score = score[: windows * ratio].reshape(windows, ratio, -1)
            entries.append(_pool(p, w_kv, w_score, first_window, CFG, prev=prev))
            if overlap:
                prev = (w_kv[-1, :, :width], w_score[-1, :, :width])
        carry_kv, carry_score, start = kv[windows * ratio :], score[windows * ratio :], end
    return jnp.concatenate(entries) if entries else jnp.zeros((0, width))


@pytest.mark.parametrize("ratio, overlap", [(4, True), (8, False)])
def test_chunks_with_carried_state_equal_the_whole_sequence(ratio, overlap):
    p = _params(ratio, ratio, overlap)
    x = jax.random.normal(jax.random.key(9), (19, CFG.hidden_size))
    whole = np.asarray(jax.jit(compressor.compress_sequence, static_argnames="cfg")(p, x, CFG))
    assert whole.shape == (19 // ratio, 32)
    for cuts in ([1, 2, 3], [5, 13], [8, 16], [6, 7, 8, 9]):  # inside windows, on boundaries, decode steps
        got = np.asarray(_chunked(p, x, cuts, ratio, overlap))
        np.testing.assert_allclose(got, whole, rtol=1e-5, atol=1e-6, err_msg=str(cuts))
