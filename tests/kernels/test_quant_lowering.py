"""Quantized kernels lowered for CUDA on the CPU (Pallas -> verified Triton IR) at GLM-5 shapes, for
sm_80, sm_90 and sm_120 (the GEMV path too, at decode shapes), with the decode path each part gets
by default; sm_80 refuses the native e4m3 cast (FP8 codes, NVFP4 scales), which is why the software
path exists. Plus the
quantized MoE tiles' shared-memory fit.
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from pallas_kernels._triton import lower_for_cuda, shared_memory_budget
from pallas_kernels.moe import kernel as moe_kernel
from pallas_kernels.moe import tuning as moe_tuning
from pallas_kernels.quant import layout
from pallas_kernels.quant_matmul import kernel, tuning

TARGETS = {"sm_80": 80, "sm_90": 90, "sm_120": 120}
D, N, E, TOP_K = 6144, 2048, 256, 8  # GLM-5: hidden, expert width, routed experts, experts per token


def _abstract(
    fmt: str, lead: tuple, k: int, n: int, *, group: int = 32, zeros: bool = True, kpack: int | None = None
):
    """A QuantizedWeight of ShapeDtypeStructs in the kernels' layout ([..., K, N]); ``kpack``: a 4-bit
    weight's packed chunk (None: the layout's default)."""
    s = jax.ShapeDtypeStruct
    if fmt == "nvfp4":  # NVFP4's global scales over the largest power-of-two blocks, as pack_nvfp4
        gk, gn, kpack = k & -k, n & -n, layout.default_kpack(k, fmt)
        return layout.QuantizedWeight(
            s((*lead, k // 2, n), jnp.uint8), s((*lead, k // 16, n), jnp.float8_e4m3fn), None, fmt, (16, 1),
            kpack, s((*lead, k // gk, n // gn), jnp.float32), (gk, gn),
        )  # fmt: skip
    if fmt == "fp8":
        return layout.QuantizedWeight(
            s((*lead, k, n), jnp.float8_e4m3fn), s((*lead, -(-k // 128), -(-n // 128)), jnp.float32),
            None, "fp8", (128, 128), 0,
        )  # fmt: skip
    scale_dtype, g = (jnp.bfloat16, group) if fmt == "int4" else (ml_dtypes.float8_e8m0fnu, 32)
    z = s((*lead, k // g, n), jnp.uint8) if fmt == "int4" and zeros else None
    kpack = kpack or layout.default_kpack(k, fmt)  # INT4 at these shapes: int32 words; FP4: bytes
    codes = s((*lead, k // layout.codes_per_element(kpack), n), layout.codes_dtype(kpack))
    return layout.QuantizedWeight(codes, s((*lead, k // g, n), scale_dtype), z, fmt, (g, 1), kpack)


LINEARS = [  # (format, T, K, N, group, zero points)
    pytest.param("int4", 1, D, N, 32, True, id="int4-g32-asym-T1-q_a"),
    pytest.param("int4", 4096, 16384, D, 128, False, id="int4-g128-sym-T4096-o_proj"),
    pytest.param("fp8", 8, D, 576, 128, False, id="fp8-T8-kv_a-576"),
    pytest.param("fp4", 512, D, N, 32, False, id="fp4-T512"),
    pytest.param("nvfp4", 1, D, N, 16, False, id="nvfp4-T1"),
    pytest.param("nvfp4", 64, 16384, D, 16, False, id="nvfp4-T64-o_proj"),
]


@pytest.mark.parametrize("target", list(TARGETS))
@pytest.mark.parametrize("fmt,t,k,n,group,zeros", LINEARS)
def test_quant_matmul_lowers(target, fmt, t, k, n, group, zeros):
    """The kernel at every size (prefill sizes forced onto it: by default they dequantize first)."""
    w = _abstract(fmt, (), k, n, group=group, zeros=zeros)
    x = jax.ShapeDtypeStruct((t, k), jnp.bfloat16)
    text = lower_for_cuda(kernel.quant_matmul, x, w, target=target, dequantize_first=False)
    assert text.count("__gpu$xla.gpu.triton") == 1


@pytest.mark.parametrize("target", list(TARGETS))
@pytest.mark.parametrize("gemv", [False, True])
@pytest.mark.parametrize("fmt", ["int4", "fp8", "fp4", "nvfp4"])
def test_projections_of_one_input_lower_as_one_kernel(target, fmt, gemv, monkeypatch):
    """GLM-5's q_a and kv_a (2048 + 576 columns) at decode, stacked over scanned layers: one launch,
    also on the GEMV kernel (turned on by the environment: a grid of 2624 / 64 N tiles)."""
    monkeypatch.setenv(tuning.GEMV_ENV, "1" if gemv else "0")
    ws = tuple(_abstract(fmt, (3,), D, n) for n in (N, 576))
    x = jax.ShapeDtypeStruct((1, D), jnp.bfloat16)
    layer = jax.ShapeDtypeStruct((), jnp.int32)
    text = lower_for_cuda(
        lambda x, ws, layer: kernel.quant_matmul_many(x, ws, layer=layer), x, ws, layer, target=target
    )
    assert text.count("__gpu$xla.gpu.triton") == 1
    assert ("grid_x = 41 : i32" in text) == gemv  # the tensor-core kernel's grid_x is its one M tile


GEMV_LINEARS = [  # (format, T, K, N, activations dtype): decode shapes, GLM-5 and a TP-4 share
    pytest.param("int4", 1, D, N + 576, jnp.bfloat16, id="int4-T1-q_a|kv_a"),
    pytest.param("int4", 3, 8192, D, jnp.bfloat16, id="int4-T3-K8192"),
    pytest.param("int4", 2, 16384 // 4, D, jnp.float32, id="int4-T2-f32-o_proj-tp4"),
    pytest.param("fp8", 1, D, N + 576, jnp.bfloat16, id="fp8-T1-q_a|kv_a"),
    pytest.param("fp8", 2, 8192, D, jnp.bfloat16, id="fp8-T2-K8192"),
    pytest.param("fp4", 1, D, N + 576, jnp.bfloat16, id="fp4-T1-q_a|kv_a"),
    pytest.param("fp4", 3, 8192, D, jnp.float32, id="fp4-T3-f32-K8192"),
    pytest.param("nvfp4", 1, D, N + 576, jnp.bfloat16, id="nvfp4-T1-q_a|kv_a"),
]


@pytest.mark.parametrize("target", list(TARGETS))
@pytest.mark.parametrize("fmt,t,k,n,dtype", GEMV_LINEARS)
def test_gemv_lowers(target, fmt, t, k, n, dtype, monkeypatch):
    """The GEMV kernel with the part's GEMV tile (turned on by the environment) at decode shapes, INT4
    in int32 words, FP8 and FP4 in bytes, the part's default decodes: one launch whose grid is the
    tile's N tiles x K splits."""
    monkeypatch.setenv(tuning.GEMV_ENV, str(t))
    w = _abstract(fmt, (), k, n)
    x = jax.ShapeDtypeStruct((t, k), dtype)
    text = lower_for_cuda(kernel.quant_matmul, x, w, target=target)
    assert text.count("__gpu$xla.gpu.triton") == 1
    cfg = tuning.choose(
        t,
        k,
        n,
        itemsize=jnp.dtype(dtype).itemsize,
        weight_bits=8 if fmt == "fp8" else 4,
        min_block_k=max(w.kpack, 16),
        cc=TARGETS[target],
    )
    assert cfg.gemv and f"grid_x = {n // cfg.block_n} : i32, grid_y = {cfg.splits} : i32, grid_z = 1" in text


@pytest.mark.parametrize("target", list(TARGETS))
def test_prefill_sizes_dequantize_first(target):
    """From 512 rows on the weight is dequantized in XLA and multiplied by XLA's dot: no kernel."""
    w = _abstract("int4", (), D, N)
    for t, kernels in ((511, 1), (512, 0)):
        text = lower_for_cuda(
            kernel.quant_matmul, jax.ShapeDtypeStruct((t, D), jnp.bfloat16), w, target=target
        )
        assert text.count("__gpu$xla.gpu.triton") == kernels, t


@pytest.mark.parametrize("target", list(TARGETS))
def test_scale_groups_smaller_than_tiles_lower(target):
    """Tiles spanning several scale groups: 64-row x 128-column FP8 blocks under 128 x 256 tiles
    (scale rows and columns broadcast by reshapes)."""
    w = _abstract("fp8", (), D, N).replace(
        scales=jax.ShapeDtypeStruct((D // 64, N // 128), jnp.float32), group=(64, 128)
    )
    cfg = kernel.tuning.QmmConfig(64, 256, 128, 1, 8, 2)
    x = jax.ShapeDtypeStruct((64, D), jnp.bfloat16)
    assert "__gpu$xla.gpu.triton" in lower_for_cuda(kernel.quant_matmul, x, w, target=target, config=cfg)


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4"])
def test_native_e4m3_does_not_lower_on_sm80(fmt):
    """FP8 codes and NVFP4's e4m3 scales alike: sm_80 refuses the cast, the integer decode lowers."""
    w = _abstract(fmt, (), D, 576)
    x = jax.ShapeDtypeStruct((8, D), jnp.bfloat16)
    with pytest.raises(NotImplementedError, match="float8_e4m3fn"):
        lower_for_cuda(kernel.quant_matmul, x, w, target="sm_80", decode="native")
    lower_for_cuda(kernel.quant_matmul, x, w, target="sm_80", decode="software")
    lower_for_cuda(kernel.quant_matmul, x, w, target="sm_90", decode="software")  # forced sm_80 path


EXPERTS = [  # (format, T, activations dtype)
    pytest.param("int4", 1, jnp.bfloat16, id="int4-T1"),
    pytest.param("fp8", 4096, jnp.bfloat16, id="fp8-T4096"),
    pytest.param("fp4", 32, jnp.float32, id="fp4-T32-f32"),
    pytest.param("nvfp4", 1, jnp.bfloat16, id="nvfp4-T1"),
    pytest.param("nvfp4", 512, jnp.bfloat16, id="nvfp4-T512"),
]


@pytest.mark.parametrize("target", list(TARGETS))
@pytest.mark.parametrize("fmt,t,dtype", EXPERTS)
def test_quantized_moe_lowers(target, fmt, t, dtype):
    experts = {"gate_up": _abstract(fmt, (E,), D, 2 * N), "down": _abstract(fmt, (E,), N, D)}
    text = lower_for_cuda(
        moe_kernel.moe_experts,
        jax.ShapeDtypeStruct((t, D), dtype),
        jax.ShapeDtypeStruct((t, TOP_K), jnp.int32),
        jax.ShapeDtypeStruct((t, TOP_K), jnp.float32),
        experts,
        target=target,
        swiglu_limit=7.0,
    )
    split = "moe_sum_splits" in text  # a K-split gate|up (decode, by the part's SM count) adds its partials
    assert text.count("__gpu$xla.gpu.triton") == 2 + split and (t == 1 or not split)


@pytest.mark.parametrize("target", list(TARGETS))
@pytest.mark.parametrize("zeros", [True, False])
@pytest.mark.parametrize("mode", ["bf16", "ptx"])
def test_int4_bf16_decode_lowers(target, zeros, mode):
    """The bf16-arithmetic INT4 decodes (bf16 bit patterns, fma.rn.bf16; the inline-PTX one on packed
    registers, carried into the Triton IR) in both kernels at GLM-5 shapes."""
    w = _abstract("int4", (), D, N, zeros=zeros)
    x = jax.ShapeDtypeStruct((8, D), jnp.bfloat16)
    text = lower_for_cuda(kernel.quant_matmul, x, w, target=target, int4_decode=mode)
    assert "__gpu$xla.gpu.triton" in text and ("lop3.b32" in text) == (mode == "ptx")
    experts = {"gate_up": _abstract("int4", (E,), D, 2 * N), "down": _abstract("int4", (E,), N, D)}
    text = lower_for_cuda(
        moe_kernel.moe_experts,
        jax.ShapeDtypeStruct((1, D), jnp.bfloat16),
        jax.ShapeDtypeStruct((1, TOP_K), jnp.int32),
        jax.ShapeDtypeStruct((1, TOP_K), jnp.float32),
        experts,
        target=target,
        int4_decode=mode,
    )
    split = "moe_sum_splits" in text  # the K-split partial sums' own kernel, by the part's SM count
    assert text.count("__gpu$xla.gpu.triton") == 2 + split and ("lop3.b32" in text) == (mode == "ptx")


@pytest.mark.parametrize("target", list(TARGETS))
@pytest.mark.parametrize("fmt,kpack", [("fp4", 64), ("fp4", layout.WORD_KPACK), ("nvfp4", None)])
@pytest.mark.parametrize("mode", ["f32", "ptx"])
def test_e2m1_experts_decode_lowers(target, fmt, kpack, mode):
    """FP4 routed experts at GLM-5 shapes with bf16 activations, in bytes and in int32 words, and
    NVFP4 ones: the packed-register e2m1 decode ('ptx', carried into the Triton IR) where asked, the
    integer one else."""
    experts = {
        "gate_up": _abstract(fmt, (E,), D, 2 * N, kpack=kpack),
        "down": _abstract(fmt, (E,), N, D, kpack=kpack),
    }
    text = lower_for_cuda(
        moe_kernel.moe_experts,
        jax.ShapeDtypeStruct((8, D), jnp.bfloat16),
        jax.ShapeDtypeStruct((8, TOP_K), jnp.int32),
        jax.ShapeDtypeStruct((8, TOP_K), jnp.float32),
        experts,
        target=target,
        swiglu_limit=7.0,
        int4_decode=mode,
    )
    split = "moe_sum_splits" in text
    assert text.count("__gpu$xla.gpu.triton") == 2 + split and ("lop3.b32" in text) == (mode == "ptx")


@pytest.mark.parametrize("target", list(TARGETS))
@pytest.mark.parametrize("fmt", ["int4", "fp8", "nvfp4"])
def test_layer_stacks_lower(target, fmt):
    """Weights stacked over GLM-5's 78 layers, read in place at a traced layer index (how scanned
    layers call the kernels): the stacks go into the Triton calls as they are, with no slice (a
    ``dynamic_slice`` before a custom call is a copy of the layer's weights)."""
    layers, i32 = 78, jax.ShapeDtypeStruct((), jnp.int32)
    w = _abstract(fmt, (layers,), D, N)
    x = jax.ShapeDtypeStruct((8, D), jnp.bfloat16)
    qmm = lambda x, w, layer: kernel.quant_matmul(x, w, layer=layer)  # noqa: E731
    text = lower_for_cuda(qmm, x, w, i32, target=target)
    assert text.count("__gpu$xla.gpu.triton") == 1 and "dynamic_slice" not in text
    experts = {"gate_up": _abstract(fmt, (layers, E), D, 2 * N), "down": _abstract(fmt, (layers, E), N, D)}
    moe = lambda x, ids, weights, experts, layer: moe_kernel.moe_experts(
        x, ids, weights, experts, layer=layer
    )  # noqa: E731
    text = lower_for_cuda(
        moe,
        x,
        jax.ShapeDtypeStruct((8, TOP_K), jnp.int32),
        jax.ShapeDtypeStruct((8, TOP_K), jnp.float32),
        experts,
        i32,
        target=target,
    )
    assert text.count("__gpu$xla.gpu.triton") == 2 and "dynamic_slice" not in text
    for leaf in jax.tree.leaves(experts):  # the whole stacks are the kernels' operands
        assert f"tensor<{'x'.join(map(str, leaf.shape))}x" in text


@pytest.mark.parametrize("itemsize", [2, 4])
@pytest.mark.parametrize("bits", [4, 8])
def test_quantized_moe_tiles_fit(bits, itemsize):
    for cc, experts, t, kpack in itertools.product(
        TARGETS.values(), (32, 256), (1, 32, 512, 4096), (64, 256)
    ):
        kpack = kpack if bits == 4 else 0
        cfg = moe_tuning.choose(t * TOP_K, experts, itemsize=itemsize, cc=cc, weight_bits=bits, kpack=kpack)
        for tile, n_tiles in ((cfg.gate_up, 2), (cfg.down, 1)):
            nbytes = moe_tuning.smem_bytes(
                tile, block_m=cfg.block_m, weight_tiles=n_tiles, itemsize=itemsize, weight_bits=bits
            )
            assert nbytes <= shared_memory_budget(cc), (cc, experts, t, cfg)
            assert tile.block_k >= kpack  # whole packed chunks
    bf16 = moe_tuning.choose(8 * TOP_K, E, itemsize=2, cc=90)
    assert moe_tuning.choose(8 * TOP_K, E, itemsize=2, cc=90, weight_bits=8).gate_up == bf16.gate_up
    assert np.all(moe_tuning.choose(8 * TOP_K, E, itemsize=2, cc=90, weight_bits=4).gate_up.block_k == 128)
