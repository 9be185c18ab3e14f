"""The tuning tables' choices fit the shared memory of each GPU family, for bf16 and float32.

Checked with the estimate in :func:`pallas_kernels._triton.shared_memory_bytes` (an upper bound of
Triton's allocation: ``max(resident + num_stages * stage, epilogue)``) over every shape a
GLM-5-sized model hands a kernel under tensor parallelism 1/2/4/8: 64 attention heads -> H in
{8, ..., 64} (plus 128 for DeepSeek-V3.2), 32 indexer heads -> Hi in {4, ..., 32} (plus 64),
256 experts -> 32..256 local experts. No GPU needed: the tables are pure functions of the
compute capability.
"""

from __future__ import annotations

import pytest

from pallas_kernels import _triton
from pallas_kernels._triton import SHARED_MEMORY, shared_memory_budget, sm_count
from pallas_kernels.indexer_logits import tuning as indexer_tuning
from pallas_kernels.moe import tuning as moe_tuning
from pallas_kernels.moe.tuning import Tile
from pallas_kernels.sparse_mla import tuning as mla_tuning
from pallas_kernels.sparse_mla.tuning import MlaConfig

TARGETS = {"sm_80": 80, "sm_90": 90, "sm_120": 120}
ITEMSIZE = {"bf16": 2, "float32": 4}
TOKENS = (1, 8, 32, 256, 512, 4096)  # decode batches and prefill chunks
MLA_HEADS = (8, 16, 32, 64, 128)
INDEXER_HEADS = (4, 8, 16, 32, 64)
EXPERTS = (32, 64, 128, 256)


def test_estimate_bounds_observed_allocations():
    """The two requests Triton reported when a config did not fit, against the estimate."""
    # H200, float32 GLM-5 at TP = 2 (128 local experts), 256-token prefill: block_m 32 with the
    # then-table's 64x128 gate|up tile and 4 stages asked for 245760 bytes.
    moe = moe_tuning.smem_bytes(Tile(64, 128, 4, 4), block_m=32, weight_tiles=2, itemsize=4)
    assert 245760 <= moe and moe > SHARED_MEMORY[90]
    # H100 sweep, bf16: all 128 heads in one program (16-row steps, 2 stages) asked for 262144.
    mla = mla_tuning.smem_bytes(MlaConfig(128, 16, 16, 2, 2), d_v=512, d_r=64, itemsize=2)
    assert 262144 <= mla and mla > SHARED_MEMORY[90]


def test_h100_configs_that_ran_fit():
    """The estimate does not reject bf16 configs that compiled and ran on H100 (the measured winners)."""
    for cfg in mla_tuning.TUNED.values():
        assert mla_tuning.smem_bytes(cfg, d_v=512, d_r=64, itemsize=2) <= SHARED_MEMORY[90]
    for block_m, tile in [(16, Tile(64, 128, 4, 4)), (32, Tile(128, 64, 4, 4)), (128, Tile(128, 64, 8, 3))]:
        assert moe_tuning.smem_bytes(tile, block_m=block_m, weight_tiles=2, itemsize=2) <= SHARED_MEMORY[90]
    row, tile = indexer_tuning.RowConfig(128, 4, 3, 4), indexer_tuning.TileConfig(64, 128, 4, 3)
    for cfg in (row, tile):
        assert indexer_tuning.smem_bytes(cfg, num_heads=64, head_dim=128, itemsize=2) <= SHARED_MEMORY[90]


@pytest.mark.parametrize("dtype", list(ITEMSIZE))
@pytest.mark.parametrize("target", list(TARGETS))
def test_sparse_mla_fits(target, dtype, monkeypatch):
    cc, itemsize = TARGETS[target], ITEMSIZE[dtype]
    monkeypatch.setattr(mla_tuning, "compute_capability", lambda: cc)
    for h in MLA_HEADS:
        for t in TOKENS:
            cfg = mla_tuning.choose(t, h, 2048, d_v=512, d_r=64, itemsize=itemsize)
            assert cfg.block_h <= 64, (h, t, cfg)  # 128-head blocks failed on H100 (smem, registers)
            nbytes = mla_tuning.smem_bytes(cfg, d_v=512, d_r=64, itemsize=itemsize)
            assert nbytes <= shared_memory_budget(cc), (h, t, cfg)


@pytest.mark.parametrize("dtype", list(ITEMSIZE))
@pytest.mark.parametrize("target", list(TARGETS))
def test_moe_fits(target, dtype):
    cc, itemsize, budget = TARGETS[target], ITEMSIZE[dtype], shared_memory_budget(TARGETS[target])
    for e in EXPERTS:
        for t in TOKENS:
            cfg = moe_tuning.choose(t * 8, e, itemsize=itemsize, cc=cc)
            for tile, weight_tiles in ((cfg.gate_up, 2), (cfg.down, 1)):
                nbytes = moe_tuning.smem_bytes(
                    tile, block_m=cfg.block_m, weight_tiles=weight_tiles, itemsize=itemsize
                )
                assert nbytes <= budget, (e, t, cfg)


@pytest.mark.parametrize("dtype", list(ITEMSIZE))
@pytest.mark.parametrize("target", list(TARGETS))
def test_indexer_fits(target, dtype):
    cc, itemsize = TARGETS[target], ITEMSIZE[dtype]
    for hi in INDEXER_HEADS:
        cfg = indexer_tuning.choose(num_heads=hi, head_dim=128, itemsize=itemsize, cc=cc)
        for kernel_cfg in (cfg.row, cfg.tile):
            nbytes = indexer_tuning.smem_bytes(kernel_cfg, num_heads=hi, head_dim=128, itemsize=itemsize)
            assert nbytes <= shared_memory_budget(cc), (hi, kernel_cfg)


def test_bf16_tables_are_not_shrunk(monkeypatch):
    """Every table fits its part in bf16, so bf16 gets the table's tiles and stages as they are
    (measured TUNED entries, checked above, aside)."""
    for cc in SHARED_MEMORY:
        monkeypatch.setattr(mla_tuning, "compute_capability", lambda cc=cc: cc)
        e = mla_tuning.TABLE[cc]
        for h in MLA_HEADS:
            for t in TOKENS:
                if (cc, h, t) in mla_tuning.TUNED:
                    continue
                cfg = mla_tuning.choose(t, h, 2048, d_v=512, d_r=64, itemsize=2)
                assert cfg.num_stages == e.num_stages and cfg.block_n in (e.block_n, e.wide_block_n), (
                    cc,
                    h,
                    t,
                )
        table = indexer_tuning.config_for(cc)
        for hi in INDEXER_HEADS:
            assert indexer_tuning.choose(num_heads=hi, head_dim=128, itemsize=2, cc=cc) == table
        for e in EXPERTS:
            for t in TOKENS:
                entry = moe_tuning.TABLE[cc]
                cfg = moe_tuning.choose(t * 8, e, itemsize=2, cc=cc)
                assert (cfg.gate_up, cfg.down) in (entry.few, entry.stream, entry.compute)


class _FakeGpu:
    """What ``jax.devices("gpu")`` reports about a GPU that is not in the tables' form."""

    compute_capability = "9.0"
    core_count = 114  # an H100 PCIe: the tables' sm_90 row is the SXM's 132


def test_sm_count_one_table_and_the_local_gpu_wins(monkeypatch):
    """Every tuning rule that fills the GPU asks one place: the table for a part lowered without it,
    the local GPU's own count for its own part (the tables had disagreed: sm_100 132 against 148,
    sm_89 / sm_120 84 against 128 / 188)."""
    assert (sm_count(80), sm_count(90), sm_count(100), sm_count(120)) == (108, 132, 148, 188)
    assert sm_count(75) == 108  # an unknown part
    monkeypatch.setattr(_triton.jax, "devices", lambda kind=None: [_FakeGpu()])
    assert sm_count(90) == 114 and sm_count(80) == 108
    # the rules follow it: with 114 SMs 64 output tiles over 32 K steps take 4 splits, not 8
    from pallas_kernels.quant_matmul import tuning as qmm_tuning

    assert qmm_tuning.splits_for(64, 32, cc=90) == 4
    monkeypatch.setattr(_triton.jax, "devices", lambda kind=None: [])
    assert qmm_tuning.splits_for(64, 32, cc=90) == 8
