"""Scanned layers with the Pallas kernels: the kernels read the weights' whole layer stacks.

A kernel is an XLA custom call, so a stacked weight scanned as an ``xs`` would reach it as a slice
that XLA copies out of the stack every step. The scan instead hands routed experts and quantized
linears to the layer whole (``jaxdsa.layers.stacks.LayerSlice``) and the kernels index the stack
in place. Checked structurally on the traced step (every kernel call inside a scan body gets the
``[L, ...]`` stack and a layer index), and numerically: scanned equals unrolled, quantized weights
through the interpreted kernels.
"""

from __future__ import annotations

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxdsa
from jaxdsa.cache import StepMeta, init_cache
from jaxdsa.models.layer_groups import ScannedLayers
from tests.conftest import FIXTURES

pytestmark = pytest.mark.slow  # scanned layers through the kernels; reference ops: tests/models

KW = dict(dtype="float32", page_size=8, progress=False, max_model_len=64)
WEIGHT_KERNELS = ("quant_matmul", "moe_gate_up", "moe_down")


def _kernel_calls(jaxpr, scan_length: int | None = None, names: tuple[str, ...] = WEIGHT_KERNELS):
    """``(kernel name, operand avals, length of the innermost enclosing scan or None)`` of every
    ``pallas_call`` named in ``names`` (the weight-reading ones) in ``jaxpr``, nested calls included."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            name = eqn.params["name"]
            if name in names:
                yield name, [v.aval for v in eqn.invars], scan_length
        length = eqn.params["length"] if eqn.primitive.name == "scan" else scan_length
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            yield from _kernel_calls(sub, length, names)


def _step_jaxpr(llm: jaxdsa.LLM, n_tokens: int):
    """The traced single-sequence step of ``llm`` over ``n_tokens`` tokens (never compiled)."""
    graphdef, state = nnx.split(llm.model)
    spec = llm.family.cache_spec(llm.config)
    cache = jax.eval_shape(lambda: init_cache(spec, 2, llm.page_size, jnp.float32))
    meta = StepMeta(
        seq_ids=jnp.zeros((n_tokens,), jnp.int32),
        page_table=jnp.zeros((1, 2), jnp.int32),
        logits_indices=jnp.zeros((1,), jnp.int32),
    )
    tokens = jnp.zeros((n_tokens,), jnp.int32)
    mode = llm.family.step_mode(llm.config, max_position=n_tokens - 1)

    def step(state, cache):
        return llm.family.step(nnx.merge(graphdef, state), tokens, tokens, cache, meta, mode)

    return jax.make_jaxpr(step)(state, cache).jaxpr


@pytest.mark.parametrize("name", ["glm5_int4", "dsv4_fp8"])
def test_kernels_in_a_scan_read_whole_stacks(name, interpret):
    """Every MoE kernel call inside a scan gets the experts as the group's whole stacks (leading
    dim = the scan's length) plus the layer index operand, never a slice; so does every
    quant_matmul call (one index in front of each weight of a grouped one) but those of the tiny
    V4's 40-wide ``q_lora`` weights, which are padded to multiples of 16 (padding copies the
    layer's weight anyway, so the op slices it first)."""
    llm = jaxdsa.LLM(FIXTURES / name, scan_layers=True, **KW)
    assert any(isinstance(g, ScannedLayers) for g in llm.model.groups)
    calls = [c for c in _kernel_calls(_step_jaxpr(llm, 4)) if c[2] is not None]
    assert {kernel for kernel, _, _ in calls} == set(WEIGHT_KERNELS)
    stacked = 0
    for kernel, avals, length in calls:
        index = [i for i, a in enumerate(avals) if a.shape == (1,) and a.dtype == jnp.int32]
        if not index:  # the traced layer index travels as a (1,) operand in front of the weight
            assert kernel == "quant_matmul" and name == "dsv4_fp8", (kernel, avals)
            assert 48 in avals[0].shape + avals[1].shape  # q_lora 40 padded to 48 (K or N)
            continue
        stacked += kernel == "quant_matmul"
        weights = [a for i, a in enumerate(avals) if i > index[0] and i not in index]  # one index per weight
        expected_ndim = 3 if kernel == "quant_matmul" else 4  # [L, K, N] / [L, E, K, N]
        assert all(a.ndim == expected_ndim and a.shape[0] == length for a in weights), (kernel, weights)
    assert stacked


def test_the_absorbed_query_reads_w_uk_in_its_stack(interpret):
    """A decode step (absorbed form, INT4 q_b) builds its queries with the mla_query kernel, which
    gets the dense W_UK as the group's whole ``[L, C, H, nope]`` stack behind the layer index
    (``MLAttention.w_uk`` declares the stack read), never a slice XLA would copy out."""
    llm = jaxdsa.LLM(FIXTURES / "glm5_int4", scan_layers=True, **KW)
    calls = [c for c in _kernel_calls(_step_jaxpr(llm, 1), names=("mla_query",)) if c[2] is not None]
    assert calls
    for _, (_, index, w_uk, *_), length in calls:
        assert index.shape == (1,) and index.dtype == jnp.int32
        assert w_uk.ndim == 4 and w_uk.shape[0] == length, w_uk


def test_scanned_equals_unrolled_through_the_kernels(interpret):
    """GLM-5 with INT4 linears and experts on the interpreted kernels: the scanned model (stacks
    read in place at a traced layer) and the unrolled one (each layer's own arrays) give the same
    logits and the same greedy tokens."""
    scanned = jaxdsa.LLM(FIXTURES / "glm5_int4", scan_layers=True, **KW)
    unrolled = jaxdsa.LLM(FIXTURES / "glm5_int4", scan_layers=False, **KW)
    prompt = np.load(FIXTURES / "glm5_int4" / "golden.npz")["prompt_short"].tolist()
    np.testing.assert_allclose(scanned.score(prompt), unrolled.score(prompt), rtol=1e-5, atol=1e-5)
    assert scanned.generate([prompt[:6]], max_new_tokens=3) == unrolled.generate(
        [prompt[:6]], max_new_tokens=3
    )
