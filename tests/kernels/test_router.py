"""Router expert-selection kernel vs the reference (CPU, interpret mode) + CUDA lowering.

Inputs are built without near-ties: in every row the biased scores are a permutation of evenly
spaced values (the logits are solved for them from a random bias with negative entries), and rows
whose ``topk_group``-th and next group scores come closer than half that spacing are redrawn. So
the ids must equal the reference's exactly (order included) on any sigmoid; the weights agree to
float32 rounding.
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxdsa import ops
from pallas_kernels._triton import lower_for_cuda
from pallas_kernels.router import kernel, ref

TARGETS = ("sm_80", "sm_90", "sm_120")
GROUPS = ((1, 1), (4, 2), (8, 4))  # (n_group, topk_group)
STATIC = ("top_k", "n_group", "topk_group", "norm_topk_prob", "scaling", "shared_slot")
# One compilation per case instead of one per op of an eager run (which took as long as the kernel's).
reference = jax.jit(ref.select_experts, static_argnames=STATIC)


def _inputs(rng, t: int, e: int, n_group: int, topk_group: int):
    """logits [t, e], bias [e] (float32) whose biased scores have no near-ties where they matter."""
    bias = rng.uniform(-0.4, 0.4, e)
    grid = np.linspace(0.45, 0.55, e)  # every value minus any bias stays inside (0.05, 0.95)
    spacing = grid[1] - grid[0]
    rows = []
    while len(rows) < t:
        choice = rng.permutation(grid)
        if n_group > 1:
            top2 = np.sort(choice.reshape(n_group, -1), axis=1)[:, -2:].sum(1)
            ranked = np.sort(top2)[::-1]
            if ranked[topk_group - 1] - ranked[topk_group] < spacing / 2:
                continue
        rows.append(choice)
    scores = np.stack(rows) - bias
    logits = np.log(scores) - np.log1p(-scores)
    return jnp.asarray(logits, jnp.float32), jnp.asarray(bias, jnp.float32)


def _check(got, want):
    (ids, weights), (want_ids, want_weights) = got, want
    assert ids.dtype == jnp.int32 and weights.dtype == jnp.float32
    assert ids.shape == weights.shape == want_ids.shape
    np.testing.assert_array_equal(np.asarray(ids), np.asarray(want_ids))
    np.testing.assert_allclose(np.asarray(weights), np.asarray(want_weights), rtol=1e-6, atol=0)


def _cases():
    """Every valid (E, groups, top_k); T, normalization and scaling cycle through their values."""
    combos = [
        (e, g, k)
        for e, g, k in itertools.product((8, 16, 256), GROUPS, (1, 2, 8))
        if g[0] == 1 or e // g[0] >= 2
    ]
    for i, (e, (n_group, topk_group), top_k) in enumerate(combos):
        t = (1, 3, 17)[i % 3]
        norm, scaling = [(True, 2.5), (False, 1.0), (True, 1.0), (False, 2.5)][i % 4]
        yield pytest.param(
            t, e, top_k, n_group, topk_group, norm, scaling, id=f"T{t}-E{e}-k{top_k}-g{n_group}x{topk_group}"
        )


@pytest.mark.parametrize("t, e, top_k, n_group, topk_group, norm, scaling", list(_cases()))
def test_kernel_matches_reference(t, e, top_k, n_group, topk_group, norm, scaling):
    """Through the op's dispatch, as the model calls it. E = 8 with 4 groups and top_k = 8 asks for
    more experts than the two kept groups hold: the rest are -inf ties, taken in index order."""
    rng = np.random.default_rng([t, e, top_k, n_group])
    logits, bias = _inputs(rng, t, e, n_group, topk_group)
    kw = dict(top_k=top_k, n_group=n_group, topk_group=topk_group, norm_topk_prob=norm, scaling=scaling)
    _check(ops._impl("select_experts", "interpret")(logits, bias, **kw), reference(logits, bias, **kw))


@pytest.mark.parametrize("e, top_k, n_group, topk_group", [(12, 3, 3, 2), (160, 6, 8, 3), (100, 5, 1, 1)])
def test_experts_not_a_power_of_two(e, top_k, n_group, topk_group):
    """The row and the groups are padded in registers; padded experts never win."""
    rng = np.random.default_rng(e)
    logits, bias = _inputs(rng, 5, e, n_group, topk_group)
    kw = dict(top_k=top_k, n_group=n_group, topk_group=topk_group, norm_topk_prob=True, scaling=2.5)
    _check(kernel.select_experts(logits, bias, interpret=True, **kw), reference(logits, bias, **kw))


@pytest.mark.parametrize("n_group, topk_group", [(1, 1), (4, 2)])
def test_bias_read_from_a_layer_stack(n_group, topk_group):
    """A scanned layer hands its router the bias stack [L, E] and its layer index (a slice would be
    copied out for the kernel): the same selection as that layer's bias alone, through the op."""
    rng = np.random.default_rng(n_group)
    logits, bias = _inputs(rng, 3, 16, n_group, topk_group)
    stack = jnp.stack([bias[::-1], bias, -bias])
    kw = dict(top_k=4, n_group=n_group, topk_group=topk_group, norm_topk_prob=True, scaling=2.5)
    want = reference(logits, bias, **kw)
    _check(ops._impl("select_experts", "interpret", True)(logits, stack, layer=jnp.int32(1), **kw), want)
    _check(ops._impl("select_experts", "reference", True)(logits, stack, layer=jnp.int32(1), **kw), want)


@pytest.mark.parametrize("e, top_k, n_group, topk_group", [(16, 4, 4, 2), (256, 8, 1, 1), (12, 3, 3, 2)])
def test_shared_expert_column(e, top_k, n_group, topk_group):
    """A shared expert held as expert ``E`` of the stacks (jaxdsa.shared_experts): the routed
    selection unchanged, then one more column routing every token to it at weight 1 (top_k = 8
    pads the slots to 16 in registers)."""
    rng = np.random.default_rng(e + top_k)
    logits, bias = _inputs(rng, 5, e, n_group, topk_group)
    kw = dict(top_k=top_k, n_group=n_group, topk_group=topk_group, norm_topk_prob=True, scaling=2.5)
    ids, weights = reference(logits, bias, shared_slot=e, **kw)
    _check((ids[:, :top_k], weights[:, :top_k]), reference(logits, bias, **kw))
    assert (np.asarray(ids[:, top_k]) == e).all() and (np.asarray(weights[:, top_k]) == 1.0).all()
    _check(ops._impl("select_experts", "interpret")(logits, bias, shared_slot=e, **kw), (ids, weights))


def test_no_tokens():
    logits, bias = jnp.zeros((0, 16), jnp.float32), jnp.zeros((16,), jnp.float32)
    kw = dict(top_k=4, n_group=4, topk_group=2, norm_topk_prob=True, scaling=2.5)
    ids, weights = kernel.select_experts(logits, bias, interpret=True, **kw)
    assert ids.shape == weights.shape == (0, 4)
    ids, weights = kernel.select_experts(logits, bias, interpret=True, shared_slot=16, **kw)
    assert ids.shape == weights.shape == (0, 5)


@pytest.mark.parametrize(
    "e, top_k, n_group, topk_group, match",
    [
        (16, 17, 1, 1, "top_k"),
        (16, 0, 1, 1, "top_k"),
        (16, 2, 16, 4, "groups of at least 2"),
        (12, 2, 5, 2, "groups of at least 2"),
        (16, 2, 4, 5, "topk_group"),
        (128, 2, 64, 4, "n_group"),
    ],
)
def test_invalid_shapes_raise(e, top_k, n_group, topk_group, match):
    logits, bias = jnp.zeros((2, e), jnp.float32), jnp.zeros((e,), jnp.float32)
    kw = dict(top_k=top_k, n_group=n_group, topk_group=topk_group, norm_topk_prob=True, scaling=1.0)
    with pytest.raises(ValueError, match=match):
        kernel.select_experts(logits, bias, **kw)


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize(
    "e, top_k, n_group, topk_group",
    [(256, 8, 8, 4), (256, 8, 1, 1), (160, 6, 8, 3)],
    ids=["dsv32", "glm5", "padded"],
)
@pytest.mark.parametrize("stacked", [False, True], ids=["bias", "bias-stack"])
def test_lowers_for_cuda(target, e, top_k, n_group, topk_group, stacked):
    """DeepSeek-V3.2 (8 groups, 4 kept) and GLM-5 (no groups) routers at T = 4, the bias alone or
    read in a layer stack (with the shared expert's column, jaxdsa.shared_experts): one Triton call."""
    shapes = [
        jax.ShapeDtypeStruct((4, e), jnp.float32),
        jax.ShapeDtypeStruct((3, e) if stacked else (e,), jnp.float32),
    ]
    if stacked:
        shapes.append(jax.ShapeDtypeStruct((), jnp.int32))
    text = lower_for_cuda(
        lambda logits, bias, *layer, **kw: kernel.select_experts(
            logits, bias, layer=(layer or [None])[0], **kw
        ),
        *shapes,
        target=target,
        top_k=top_k,
        n_group=n_group,
        topk_group=topk_group,
        norm_topk_prob=True,
        scaling=2.5,
        shared_slot=e if stacked else None,
    )
    assert text.count("__gpu$xla.gpu.triton") == 1
