"""MLA's latent projections with their norms and RoPE (pallas_kernels/mla_latent) vs the reference
(CPU, interpret mode) on fresh random INT4 / FP8 weights, norm weights and angles; one launch's K
splits added in the row kernel, layer stacks read at a traced index, ungroupable weights one by one;
lowered for sm_80 / sm_90 / sm_120 at GLM-5.2's and GLM-5.3-Flash's widths.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxdsa import ops
from pallas_kernels._triton import lower_for_cuda
from pallas_kernels.mla_latent import kernel, ref
from pallas_kernels.quant_matmul import kernel as quant_matmul_kernel
from tests.kernels.test_quant_lowering import TARGETS, _abstract
from tests.kernels.test_quant_matmul import _device, random_fp8, random_int4

Q, C, P, WK = 64, 32, 16, 32  # q_lora, kv_lora, rope dim, index head dim (small)


def _weight(rng, fmt: str, k: int, n: int, lead=()):
    if fmt == "int4":
        return _device(random_int4(rng, lead, n, k, 32, symmetric=False)[0])
    return _device(random_fp8(rng, lead, n, k, block=(16, 16))[0])


def _inputs(rng, t: int, dtype, lead=()):
    norms = [jnp.asarray(1 + 0.1 * rng.standard_normal((*lead, n)), dtype) for n in (Q, C)]
    angles = rng.uniform(0, 2 * np.pi, (t, P // 2))
    return (*norms, jnp.asarray(np.cos(angles), jnp.float32), jnp.asarray(np.sin(angles), jnp.float32))


def _close(got, want, dtype) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype == dtype
        tol = 2e-5 if dtype == jnp.float32 else 2e-2
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32), rtol=tol, atol=tol)


@pytest.mark.parametrize("fmt", ["int4", "fp8"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("t,k,wk", [(1, 1024, True), (3, 256, False), (17, 256, True)])
def test_matches_reference(fmt, dtype, t, k, wk):
    """q_lat, the cached row and wk's product against the reference, through the op's dispatch;
    K = 1024 at one row makes the projections' launch split over K (the row kernel adds them)."""
    rng = np.random.default_rng([t, k, wk])
    ws = tuple(_weight(rng, fmt, k, n) for n in (Q, C + P, *((WK,) if wk else ())))
    x = jnp.asarray(rng.standard_normal((t, k)), dtype)
    parts = quant_matmul_kernel.quant_matmul_partials(x, ws, interpret=True)
    assert parts is not None and parts.shape[1] >= t and parts.shape[2] == sum(w.shape[1] for w in ws)
    if k == 1024:
        assert parts.shape[0] > 1
    args = (x, ws, *_inputs(rng, t, dtype))
    _close(ops._impl("mla_latent", "interpret")(*args, eps=1e-6), ref.mla_latent(*args, eps=1e-6), dtype)


@pytest.mark.parametrize("fmt", ["int4", "fp8"])
@pytest.mark.parametrize("t", [1, 5])
def test_nope_rows(fmt, t):
    """NoPE MLA (GLM-5.3-Flash: ``qk_rope_head_dim`` 0): the cached row is the normed latent alone and
    the angles are empty."""
    rng = np.random.default_rng([t, 11])
    ws = tuple(_weight(rng, fmt, 256, n) for n in (Q, C))
    x = jnp.asarray(rng.standard_normal((t, 256)), jnp.bfloat16)
    q_norm, kv_norm, *_ = _inputs(rng, t, jnp.bfloat16)
    empty = jnp.zeros((t, 0), jnp.float32)
    args = (x, ws, q_norm, kv_norm, empty, empty)
    got = ops._impl("mla_latent", "interpret")(*args, eps=1e-6)
    assert got[1].shape == (t, C)
    _close(got, ref.mla_latent(*args, eps=1e-6), jnp.bfloat16)


def test_layer_stacks_read_at_a_traced_index():
    """Scanned layers hand the op whole stacks (weights and norms) and the layer index."""
    rng = np.random.default_rng(7)
    stacks = tuple(_weight(rng, "int4", 256, n, lead=(3,)) for n in (Q, C + P))
    x = jnp.asarray(rng.standard_normal((2, 256)), jnp.float32)
    q_norm, kv_norm, cos, sin = _inputs(rng, 2, jnp.float32, lead=(3,))
    run = jax.jit(
        lambda layer: ops._impl("mla_latent", "interpret", True)(
            x, stacks, q_norm, kv_norm, cos, sin, eps=1e-6, layer=layer
        )
    )
    for i in range(3):
        one = tuple(jax.tree.map(lambda a, i=i: a[i], s) for s in stacks)
        _close(
            run(jnp.int32(i)), ref.mla_latent(x, one, q_norm[i], kv_norm[i], cos, sin, eps=1e-6), jnp.float32
        )


def test_weights_of_two_formats_go_one_by_one():
    """An INT4 q_a beside an FP8 kv_a do not share a launch: each is multiplied alone, same rows."""
    rng = np.random.default_rng(3)
    ws = (_weight(rng, "int4", 256, Q), _weight(rng, "fp8", 256, C + P))
    x = jnp.asarray(rng.standard_normal((4, 256)), jnp.float32)
    assert quant_matmul_kernel.quant_matmul_partials(x, ws, interpret=True) is None
    args = (x, ws, *_inputs(rng, 4, jnp.float32))
    _close(kernel.mla_latent(*args, eps=1e-6, interpret=True), ref.mla_latent(*args, eps=1e-6), jnp.float32)


def test_shapes_that_do_not_fit_raise():
    rng = np.random.default_rng(5)
    ws = tuple(_weight(rng, "int4", 256, n) for n in (Q, C + P))
    x = jnp.zeros((2, 256), jnp.float32)
    q_norm, kv_norm, cos, sin = _inputs(rng, 2, jnp.float32)
    with pytest.raises(ValueError, match="do not fit"):
        kernel.mla_latent(x, ws, q_norm[:-1], kv_norm, cos, sin, eps=1e-6, interpret=True)
    with pytest.raises(ValueError, match="optionally wk"):
        kernel.mla_latent(x, ws[:1], q_norm, kv_norm, cos, sin, eps=1e-6, interpret=True)


# (hidden, q_lora, kv_lora, rope, index head dim) at one decode row: GLM-5.2's q_a, kv_a and wk, and
# GLM-5.3-Flash's q_a and kv_a (NoPE: no RoPE part, no wk joined)
LOWERED = {"glm52": (6144, 2048, 512, 64, 128), "glm53flash": (4096, 1536, 512, 0, 0)}


@pytest.mark.parametrize("target", list(TARGETS))
@pytest.mark.parametrize("fmt", ["int4", "fp8"])
@pytest.mark.parametrize("model", list(LOWERED))
def test_lowers_for_cuda(target, fmt, model):
    """Norm weights in layer stacks: the projections' launch and the row kernel."""
    d, q, c, p, wk = LOWERED[model]
    s = jax.ShapeDtypeStruct
    ws = tuple(_abstract(fmt, (4,), d, n, group=32) for n in (q, c + p, *((wk,) if wk else ())))
    shapes = (s((1, d), jnp.bfloat16), ws, s((4, q), jnp.bfloat16), s((4, c), jnp.bfloat16))
    shapes += (s((1, p // 2), jnp.float32), s((1, p // 2), jnp.float32), s((), jnp.int32))
    text = lower_for_cuda(
        lambda x, ws, qn, kvn, cos, sin, layer: kernel.mla_latent(
            x, ws, qn, kvn, cos, sin, eps=1e-6, layer=layer
        ),
        *shapes,
        target=target,
    )
    assert text.count("__gpu$xla.gpu.triton") == 2
