"""MLA's absorbed query (pallas_kernels/mla_query) vs the reference (CPU, interpret mode) on fresh
random INT4 / FP8 ``q_b``, ``W_UK`` and angles: ``q_b``'s K splits added in the kernel, ragged and
several row tiles, heads and a nope width that are not powers of two, layer stacks read at a
traced index, a ``q_b`` that takes no partial-products launch, NoPE heads; lowered for sm_80 /
sm_90 / sm_120 at GLM-5.2's widths at tp 4 and GLM-5.3-Flash's at tp 2.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxdsa import ops
from pallas_kernels._triton import lower_for_cuda
from pallas_kernels.mla_query import kernel, ref
from pallas_kernels.quant_matmul import kernel as quant_matmul_kernel
from tests.kernels.test_mla_latent import _close, _weight
from tests.kernels.test_quant_lowering import TARGETS, _abstract

H, NOPE, P, C = 3, 24, 8, 64  # heads, nope and rope dims, kv_lora (small; 3 heads, nope 24: masked tiles)


def _inputs(rng, t: int, q: int, dtype, *, fmt="int4", lead=(), heads=H, nope=NOPE, rope=P):
    """(q_lat, q_b, w_uk, cos, sin) with ``lead`` layer dims on the weights."""
    q_b = _weight(rng, fmt, q, heads * (nope + rope), lead)
    w_uk = jnp.asarray(rng.standard_normal((*lead, C, heads, nope)) / np.sqrt(nope), dtype)
    angles = rng.uniform(0, 2 * np.pi, (t, rope // 2))
    x = jnp.asarray(rng.standard_normal((t, q)), dtype)
    return x, q_b, w_uk, jnp.asarray(np.cos(angles), jnp.float32), jnp.asarray(np.sin(angles), jnp.float32)


@pytest.mark.parametrize("fmt", ["int4", "fp8"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("t,q", [(1, 1024), (3, 256), (8, 256)])
def test_matches_reference(fmt, dtype, t, q):
    """Through the op's dispatch; q_lora = 1024 at one row splits q_b's launch over K (the kernel
    adds the splits)."""
    rng = np.random.default_rng([t, q])
    args = _inputs(rng, t, q, dtype, fmt=fmt)
    parts = quant_matmul_kernel.quant_matmul_partials(args[0], (args[1],), interpret=True)
    assert parts is not None and parts.shape[1] >= t
    if q == 1024:
        assert parts.shape[0] > 1
    got = ops._impl("mla_query", "interpret")(*args, nope=NOPE)
    _close([got], [ref.mla_query(*args, nope=NOPE)], dtype)
    assert got.shape == (t, H, C + P)


@pytest.mark.parametrize("fmt", ["int4", "fp8"])
@pytest.mark.parametrize("t", [1, 5])
def test_nope_query(fmt, t):
    """NoPE MLA (GLM-5.3-Flash: ``qk_rope_head_dim`` 0): the absorbed query alone, no angles."""
    rng = np.random.default_rng([t, 13])
    args = _inputs(rng, t, 256, jnp.bfloat16, fmt=fmt, nope=32, rope=0)
    got = ops._impl("mla_query", "interpret")(*args, nope=32)
    assert got.shape == (t, H, C)
    _close([got], [ref.mla_query(*args, nope=32)], jnp.bfloat16)


def test_rows_past_one_tile():
    """40 rows: two 32-row tiles, the second ragged."""
    rng = np.random.default_rng(40)
    args = _inputs(rng, 40, 256, jnp.float32)
    _close(
        [kernel.mla_query(*args, nope=NOPE, interpret=True)], [ref.mla_query(*args, nope=NOPE)], jnp.float32
    )


def test_layer_stacks_read_at_a_traced_index():
    """Scanned layers hand the op both weights' whole stacks and the layer index."""
    rng = np.random.default_rng(7)
    x, q_b, w_uk, cos, sin = _inputs(rng, 2, 256, jnp.bfloat16, lead=(3,))
    run = jax.jit(
        lambda layer: ops._impl("mla_query", "interpret", True)(
            x, q_b, w_uk, cos, sin, nope=NOPE, layer=layer
        )
    )
    for i in range(3):
        one = jax.tree.map(lambda a, i=i: a[i], q_b)
        _close([run(jnp.int32(i))], [ref.mla_query(x, one, w_uk[i], cos, sin, nope=NOPE)], jnp.bfloat16)


def test_a_q_b_without_partials_is_multiplied_whole():
    """5 heads of 20 + 10 columns: q_b 150 wide, not a multiple of 16, takes no partial-products
    launch; it is multiplied alone and the kernel takes its product as one split (rope 10: five
    pairs in a tile of eight)."""
    rng = np.random.default_rng(3)
    args = _inputs(rng, 4, 256, jnp.float32, heads=5, nope=20, rope=10)
    assert quant_matmul_kernel.quant_matmul_partials(args[0], (args[1],), interpret=True) is None
    _close([kernel.mla_query(*args, nope=20, interpret=True)], [ref.mla_query(*args, nope=20)], jnp.float32)


def test_shapes_that_do_not_fit_raise():
    rng = np.random.default_rng(5)
    x, q_b, w_uk, cos, sin = _inputs(rng, 2, 256, jnp.float32)
    with pytest.raises(ValueError, match="do not fit"):
        kernel.mla_query(x, q_b, w_uk, cos, sin, nope=NOPE + 2, interpret=True)
    with pytest.raises(ValueError, match="do not fit"):
        kernel.mla_query(x, q_b, w_uk, cos[:, :-1], sin[:, :-1], nope=NOPE, interpret=True)


# (heads, q_lora, nope, rope) a GPU at one decode row, kv_lora 512: GLM-5.2 at tp 4, GLM-5.3-Flash
# (NoPE) at tp 2
LOWERED = {"glm52-tp4": (16, 2048, 192, 64), "glm53flash-tp2": (32, 1536, 256, 0)}


@pytest.mark.parametrize("target", list(TARGETS))
@pytest.mark.parametrize("fmt", ["int4", "fp8"])
@pytest.mark.parametrize("model", list(LOWERED))
def test_lowers_for_cuda(target, fmt, model):
    """Both weights in layer stacks: q_b's launch and the query kernel, no other XLA op but the
    layer index's reshape and FP8 codes' bitcast to bytes (neither a launch: no slice of the
    partials)."""
    heads, q, nope, rope = LOWERED[model]
    s = jax.ShapeDtypeStruct
    shapes = (s((1, q), jnp.bfloat16), _abstract(fmt, (4,), q, heads * (nope + rope), group=32))
    shapes += (s((4, 512, heads, nope), jnp.bfloat16), s((1, rope // 2), jnp.float32))
    shapes += (s((1, rope // 2), jnp.float32),)
    text = lower_for_cuda(
        lambda x, q_b, w_uk, cos, sin, layer: kernel.mla_query(
            x, q_b, w_uk, cos, sin, nope=nope, layer=layer
        ),
        *shapes,
        s((), jnp.int32),
        target=target,
    )
    assert text.count("__gpu$xla.gpu.triton") == 2
    ops_between = {line.split("=")[1].split()[0] for line in text.splitlines() if "= stablehlo." in line}
    assert ops_between <= {"stablehlo.custom_call", "stablehlo.reshape", "stablehlo.bitcast_convert"}, (
        ops_between
    )
