"""MoE expert kernels vs the pure-JAX reference (CPU, interpret mode) + CUDA lowering.

Interpret mode runs the real kernel bodies one grid step at a time, so D and N stay small while
T, E and the routings vary (uneven groups, empty experts, experts spanning several blocks,
out-of-range ids). The GLM-5 production shapes are only lowered (Pallas -> Triton IR).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxdsa import ops
from pallas_kernels._triton import lower_for_cuda
from pallas_kernels.moe import kernel, ref, routing, tuning
from pallas_kernels.moe.tuning import MoeConfig, Tile

_group_by_expert = jax.jit(routing.group_by_expert, static_argnums=(1, 2))
_one_block_per_slot = jax.jit(
    lambda ids, e, bm: routing.SlotBlocks(ids.reshape(-1).astype(jnp.int32)).block_map(e, bm),
    static_argnums=(1, 2),
)
_ref = jax.jit(ref.moe_experts, static_argnames=("swiglu_limit",))


@functools.partial(jax.jit, static_argnames=("swiglu_limit", "config"))
def _kernel(x, ids, weights, experts, *, swiglu_limit, config):
    return kernel.moe_experts(
        x, ids, weights, experts, swiglu_limit=swiglu_limit, interpret=True, config=config
    )


def _routing(rng, t, k, e, *, skew, invalid):
    """Distinct experts per token; ``skew`` concentrates tokens on few experts (uneven groups,
    empty experts); a fraction ``invalid`` of the slots gets ids outside [0, E)."""
    scores = rng.gumbel(size=(t, e)) + skew * np.linspace(4.0, 0.0, e)
    ids = np.argsort(-scores, axis=1)[:, :k]
    bad = rng.random((t, k)) < invalid
    ids[bad] = rng.choice([-1, -7, e, e + 5], size=int(bad.sum()))
    return jnp.asarray(ids, jnp.int32)


def _inputs(seed, t, k, e, d, n, dtype, *, skew=0.0, invalid=0.1):
    rng = np.random.default_rng(seed)
    gate = rng.standard_normal((e, n, d), np.float32) / np.sqrt(d)
    up = rng.standard_normal((e, n, d), np.float32) / np.sqrt(d)
    down = rng.standard_normal((e, d, n), np.float32) / np.sqrt(n)
    experts = ref.pack_experts(*(jnp.asarray(w, dtype) for w in (gate, up, down)))
    x = jnp.asarray(rng.standard_normal((t, d), np.float32), dtype)
    weights = jnp.asarray(rng.random((t, k)), jnp.float32)
    return x, _routing(rng, t, k, e, skew=skew, invalid=invalid), weights, experts


def _check(x, ids, weights, experts, *, swiglu_limit=None, config=None):
    got = _kernel(x, ids, weights, experts, swiglu_limit=swiglu_limit, config=config)
    f32 = {name: w.astype(jnp.float32) for name, w in experts.items()}
    want = _ref(x.astype(jnp.float32), ids, weights, f32, swiglu_limit=swiglu_limit)
    assert got.shape == x.shape and got.dtype == x.dtype
    got, want = np.asarray(got, np.float32), np.asarray(want)
    assert np.isfinite(got).all()
    rel = np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30)
    assert rel <= (1e-2 if x.dtype == jnp.bfloat16 else 1e-5), rel
    dropped = np.asarray(((ids < 0) | (ids >= experts["down"].shape[0])).all(axis=1))
    assert (got[dropped] == 0).all()  # tokens whose every id is out of range get exactly 0


CASES = [  # (T, k, E, dtype, swiglu_limit, skew): D = 64, N = 32
    pytest.param(1, 8, 256, jnp.bfloat16, None, 0.0, id="decode-T1-E256-bf16"),
    pytest.param(1, 8, 8, jnp.float32, 0.3, 0.0, id="decode-T1-all-experts-limit"),
    pytest.param(1, 1, 8, jnp.float32, None, 0.0, id="decode-T1-k1"),
    pytest.param(37, 8, 256, jnp.float32, 0.3, 2.0, id="T37-E256-uneven-limit"),
    pytest.param(96, 1, 8, jnp.bfloat16, None, 3.0, id="T96-k1-E8-skewed"),
    pytest.param(300, 8, 8, jnp.float32, None, 0.0, id="T300-E8-multiblock"),
    pytest.param(2048, 2, 256, jnp.bfloat16, 0.3, 1.0, id="T2048-k2-E256-bf16-limit"),
    pytest.param(4096, 1, 8, jnp.float32, None, 2.0, id="T4096-k1-E8"),
]


@pytest.mark.parametrize("t,k,e,dtype,limit,skew", CASES)
def test_matches_reference(t, k, e, dtype, limit, skew):
    x, ids, weights, experts = _inputs(1000 + t * k + e, t, k, e, 64, 32, dtype, skew=skew)
    _check(x, ids, weights, experts, swiglu_limit=limit)


@pytest.mark.parametrize("block_m,absorb_m,splits", [(128, 32, 1), (64, 16, 1), (128, 0, 1), (64, 16, 2)])
def test_tail_blocks(block_m, absorb_m, splits):
    """Every kind of last block: absorbed tails of 1..absorb_m rows (both extra tile sizes), tails
    just too big to absorb, a lone small block, an empty expert, an expert of 3 blocks + tail; with
    gate|up split over K too (the absorbed rows' partial sums added before the down kernel)."""
    tails = [1, 5, 16, 17, 32, 33, 64]
    counts = [block_m + t for t in tails] + [3, 0, 2 * block_m + 9, block_m]
    rng = np.random.default_rng(block_m + absorb_m)
    ids = rng.permutation(np.repeat(np.arange(len(counts)), counts))[:, None]
    x, _, weights, experts = _inputs(5, ids.shape[0], 1, len(counts), 64, 32, jnp.float32, invalid=0.0)
    cfg = MoeConfig(block_m, Tile(32, 32, 4, 2), Tile(32, 16, 4, 2), absorb_m=absorb_m, splits=splits)
    _check(x, jnp.asarray(ids, jnp.int32), weights[:, :1], experts, config=cfg)


@pytest.mark.parametrize(
    "t,splits,limit,d,dtype",
    [
        (1, 2, None, 128, jnp.float32),
        (1, 4, 0.3, 128, jnp.bfloat16),
        (1, 3, None, 96, jnp.float32),
        (5, 4, 0.3, 128, jnp.bfloat16),
        (37, 4, None, 128, jnp.float32),
        (300, 2, 0.3, 128, jnp.float32),
    ],
)
def test_k_splits(t, splits, limit, d, dtype):
    """gate|up split over K (float32 partial sums, added and activated by their own kernel): the
    decode regime of a few experts (3 splits of a 3-step K loop too), and grouped and multi-block
    routings with dropped ids, bf16 and float32, with and without the clamp."""
    x, ids, weights, experts = _inputs(70 + t, t, 4, 8, d, 32, dtype, skew=1.0)
    cfg = MoeConfig(16, Tile(32, 32, 4, 2), Tile(32, 16, 4, 2), splits=splits)
    _check(x, ids, weights, experts, swiglu_limit=limit, config=cfg)
    assert kernel._k_splits(8, 12) == 6 and kernel._k_splits(4, 3) == 3  # only splits dividing the loop
    assert kernel._k_splits(4, 7) == 1


@pytest.mark.parametrize("splits", [1, 4])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_single_token_reads_its_ids_as_the_block_map(splits, dtype):
    """At T = 1 the kernels read the routing ids as the block map (:class:`routing.SlotBlocks`):
    the same bits as the kernels given that map as arrays (the metadata table and ``row_slot``),
    out-of-range ids included."""
    e, k = 16, 8
    x, _, _, experts = _inputs(91, 1, k, e, 128, 32, dtype)
    ids = jnp.asarray([[3, -1, 15, 0, e, 7, -7, 9]], jnp.int32)
    cfg = MoeConfig(16, Tile(32, 32, 4, 2), Tile(32, 16, 4, 2), splits=splits)
    slot_blocks = kernel.route(ids, e, cfg.block_m)
    assert isinstance(slot_blocks, routing.SlotBlocks)

    @jax.jit
    def run(x, experts, bmap):
        h = kernel.gate_up(x, bmap, experts["gate_up"], cfg, top_k=k, swiglu_limit=0.4, interpret=True)
        return kernel.down(h, bmap, experts["down"], cfg, num_slots=k, interpret=True)

    got = run(x, experts, slot_blocks)
    want = run(x, experts, slot_blocks.block_map(e, cfg.block_m))
    written = np.asarray((ids >= 0) & (ids < e)).reshape(-1)  # rows of dropped slots are never written
    np.testing.assert_array_equal(np.asarray(got)[:k][written], np.asarray(want)[:k][written])


def test_all_ids_out_of_range():
    x, ids, weights, experts = _inputs(7, 5, 4, 8, 64, 32, jnp.float32, invalid=1.0)
    _check(x, ids, weights, experts)


@pytest.mark.parametrize("block_m,min_block_m", [(16, 16), (64, 16), (64, 64), (128, 32)])
def test_block_size_override(block_m, min_block_m):
    """Small blocks split big groups over several blocks; big blocks hold many padding rows, and
    partly filled ones run at every row tile from ``block_m`` down to ``min_block_m``."""
    cfg = MoeConfig(block_m, Tile(32, 32, 4, 2), Tile(32, 16, 4, 2), min_block_m=min_block_m)
    x, ids, weights, experts = _inputs(11, 100, 2, 8, 64, 32, jnp.float32, skew=1.0)
    _check(x, ids, weights, experts, config=cfg)


@pytest.mark.parametrize("t,dtype", [(1, jnp.bfloat16), (37, jnp.float32)])
def test_layer_stack_read_in_place(t, dtype):
    """Experts stacked over 3 layers (``[L, E, D, 2N]``, ``[L, E, N, D]``) with a traced layer index:
    exactly the result on that layer's own experts, for every layer, in the kernels and in the
    reference."""
    x, ids, weights, _ = _inputs(50, t, 4, 8, 64, 32, dtype)
    per_layer = [_inputs(51 + i, t, 4, 8, 64, 32, dtype)[3] for i in range(3)]
    stack = jax.tree.map(lambda *a: jnp.stack(a), *per_layer)
    assert stack["gate_up"].shape == (3, 8, 64, 64)
    stacked = jax.jit(lambda layer: kernel.moe_experts(x, ids, weights, stack, layer=layer, interpret=True))
    stacked_ref = jax.jit(lambda layer: ref.moe_experts(x, ids, weights, stack, layer=layer))
    for i, experts in enumerate(per_layer):
        want = _kernel(x, ids, weights, experts, swiglu_limit=None, config=None)
        np.testing.assert_array_equal(stacked(jnp.int32(i)), want)
        np.testing.assert_array_equal(stacked_ref(jnp.int32(i)), _ref(x, ids, weights, experts))


def test_ops_dispatch_interpret():
    x, ids, weights, _ = _inputs(3, 4, 2, 8, 64, 32, jnp.float32)
    rng = np.random.default_rng(3)
    gate, up = (jnp.asarray(rng.standard_normal((8, 32, 64)), jnp.float32) / 8 for _ in range(2))
    down = jnp.asarray(rng.standard_normal((8, 64, 32)), jnp.float32) / 6
    previous = ops.get_kernels()
    try:
        ops.set_kernels("interpret")
        run = jax.jit(lambda *a: ops.moe_experts(*a, ref.pack_experts(gate, up, down), swiglu_limit=0.5))
        got = run(x, ids, weights)
    finally:
        ops.set_kernels(previous)
    want = ref.moe_experts(x, ids, weights, ref.pack_experts(gate, up, down), swiglu_limit=0.5)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("t,k,e,bm", [(50, 8, 16, 16), (33, 2, 256, 32), (1, 8, 256, 16)])
def test_block_map_invariants(t, k, e, bm):
    ids = _routing(np.random.default_rng(t), t, k, e, skew=2.0, invalid=0.2)
    flat = np.asarray(ids).reshape(-1)
    valid = (flat >= 0) & (flat < e)
    for bmap in (_group_by_expert(ids, e, bm), _one_block_per_slot(ids, e, bm)):
        block_expert = np.asarray(bmap.block_expert)
        row_slot = np.asarray(bmap.row_slot).reshape(-1, bm)
        held = row_slot[row_slot >= 0]
        np.testing.assert_array_equal(np.sort(held), np.flatnonzero(valid))  # each valid slot once
        for blk, rows, slots in zip(block_expert, np.asarray(bmap.block_rows), row_slot):
            assert (slots[:rows] >= 0).all() and (slots[rows:] < 0).all()  # filled rows: a prefix
            slots = slots[slots >= 0]
            assert (flat[slots] == blk).all() and (blk >= 0 or slots.size == 0)
        start, length = np.asarray(bmap.span_start), np.asarray(bmap.span_len)
        for b, (s, c) in enumerate(zip(start, length)):  # spans tile the blocks, one expert each
            assert s <= b < s + c and (block_expert[s : s + c] == block_expert[b]).all()
            assert (start[s : s + c] == s).all() and (length[s : s + c] == c).all()
    grouped = _group_by_expert(ids, e, bm)
    block_expert, start, length = (
        np.asarray(a) for a in (grouped.block_expert, grouped.span_start, grouped.span_len)
    )
    for b, (_s, c) in enumerate(zip(start, length)):  # grouped: a span is all of its expert's blocks
        assert (c == 1) if block_expert[b] < 0 else (block_expert == block_expert[b]).sum() == c
    grouped = block_expert
    counts = np.bincount(flat[valid], minlength=e)
    np.testing.assert_array_equal(np.bincount(grouped[grouped >= 0], minlength=e), -(-counts // bm))


def test_max_blocks_is_tight():
    """Worst case: every expert but one holds a single slot, the last one holds the rest."""
    e, bm, slots = 16, 16, 15 + 40
    ids = jnp.asarray(np.r_[np.arange(15), np.full(40, 15)], jnp.int32)[:, None]
    bmap = _group_by_expert(ids, e, bm)
    assert int((bmap.block_expert >= 0).sum()) == 15 + 3 == routing.max_blocks(slots, e, bm)


def test_sm90_table_matches_h100_sweep():
    """bf16 at GLM-5 shapes (E = 256, top-8) picks each T's fastest config in moe-h100.md."""
    wide = Tile(128, 64, 4, 4)
    compute = (Tile(128, 64, 8, 4), Tile(128, 64, 8, 3))
    want = {
        1: (16, wide, wide),
        8: (16, wide, wide),
        32: (16, wide, wide),
        128: (16, wide, wide),
        512: (32, wide, wide),
        4096: (128, *compute),
    }
    for t, (block_m, gate_up, down) in want.items():
        assert tuning.choose(t * 8, 256, itemsize=2, cc=90) == MoeConfig(block_m, gate_up, down), t


def test_h100_4bit_experts_stream_with_8_warps_3_stages_and_whole_word_chunks():
    """INT4 experts in words at GLM-5 widths: the stream tiles with 8 warps, 3 stages and a K step
    of one 256-row chunk, in 32-row blocks up to T = 2048; the compute tiles (T = 4096) are not the
    stream tiles' (their stages fitted to the shared memory)."""
    word = Tile(128, 256, 8, 3)
    for t in (1, 8, 32, 128, 512, 1024, 2048):
        cfg = tuning.choose(t * 8, 256, itemsize=2, cc=90, weight_bits=4, kpack=256)
        assert (cfg.block_m, cfg.gate_up, cfg.down) == (16 if t <= 256 else 32, word, word), t
    cfg = tuning.choose(4096 * 8, 256, itemsize=2, cc=90, weight_bits=4, kpack=256)
    assert cfg.block_m == 128 and cfg.gate_up.num_stages == 2


def test_4bit_experts_keep_32_row_blocks_to_64_slots_per_expert_on_h100_only():
    """Up to 64 slots per expert on average (any expert count) 4-bit weights stay in 32-row blocks
    on sm_90, past it they take the block rule; 8-bit weights and other GPUs always take it."""
    for experts in (16, 256):
        assert tuning.choose(64 * experts, experts, itemsize=2, cc=90, weight_bits=4, kpack=256).block_m == 32
        assert (
            tuning.choose(65 * experts, experts, itemsize=2, cc=90, weight_bits=4, kpack=256).block_m == 128
        )
        assert tuning.choose(64 * experts, experts, itemsize=2, cc=90, weight_bits=8).block_m == 128
        assert tuning.choose(64 * experts, experts, itemsize=2, cc=80, weight_bits=4, kpack=256).block_m == 64


def test_decode_batches_of_quantized_experts_split_gate_up_over_k():
    """One token at top-8 of 256 meets 8 experts: at TP 4 (N = 512 per GPU, 4 tiles of 128) 32
    programs, split 4 ways (H100: 45 vs 89 us); at TP 1 (128 programs), at T = 8 (256 programs)
    and for dense experts, no split."""
    choose = lambda t, n, bits=4: tuning.choose(  # noqa: E731
        t * 8, 256, itemsize=2, cc=90, weight_bits=bits, kpack=256 if bits == 4 else 0, n_out=n
    )
    assert choose(1, 512).splits == 4 and choose(1, 512, bits=8).splits == 4
    assert choose(1, 2048).splits == 1 and choose(8, 512).splits == 1 and choose(1, 1024).splits == 2
    assert tuning.choose(8, 256, itemsize=2, cc=90, n_out=512).splits == 1  # bf16 experts
    assert tuning.k_splits(8, 256, 256, 128, sms=132) == 4  # TP 8: 16 programs, at most 4 splits
    assert tuning.k_splits(9, 257, 512, 128, sms=132) == 3  # and the shared expert: 108 programs, one wave
    assert tuning.k_splits(18, 257, 512, 128, sms=132) == 3  # two tokens: 216 in two waves


def test_block_m_regimes():
    assert [tuning.block_m_for(t * 8, 256, 64) for t in (1, 128, 256, 512, 4096)] == [16, 16, 16, 32, 64]


GLM5 = dict(D=6144, N=2048, k=8)


@pytest.mark.parametrize("target,cc", [("sm_80", 80), ("sm_90", 90), ("sm_120", 120)])
@pytest.mark.parametrize(
    "t,e,dtype,splits",
    [
        (1, 256, jnp.bfloat16, 1),
        (1, 256, jnp.bfloat16, 4),
        (32, 256, jnp.bfloat16, 1),
        (4096, 256, jnp.bfloat16, 1),
        (256, 128, jnp.float32, 1),
    ],
    ids=["T1", "T1-K-split", "T32", "T4096", "T256-E128-f32"],  # the last: float32 prefill at TP = 2
)
def test_lowers_for_cuda_at_glm5_shapes(target, cc, t, e, dtype, splits):
    d, n, k = GLM5["D"], GLM5["N"], GLM5["k"]
    experts = {
        "gate_up": jax.ShapeDtypeStruct((e, d, 2 * n), dtype),
        "down": jax.ShapeDtypeStruct((e, n, d), dtype),
    }
    text = lower_for_cuda(
        kernel.moe_experts,
        jax.ShapeDtypeStruct((t, d), dtype),
        jax.ShapeDtypeStruct((t, k), jnp.int32),
        jax.ShapeDtypeStruct((t, k), jnp.float32),
        experts,
        target=target,
        config=dataclasses.replace(
            tuning.choose(t * k, e, itemsize=jnp.dtype(dtype).itemsize, cc=cc), splits=splits
        ),
        swiglu_limit=7.0,
    )
    assert text.count("__gpu$xla.gpu.triton") == (3 if splits > 1 else 2)
    if splits > 1:  # the partial sums are added by a kernel of their own: XLA reduces only the combine
        assert text.count("stablehlo.reduce") == 1
