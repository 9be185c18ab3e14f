"""The host experts' CPU kernel against the reference computation, every weight format.

Fresh random experts in each format's layout (INT4 words and bytes, symmetric and asymmetric,
bf16 and float32 scales; FP8 with float32 and ue8m0 block scales, blocks of a height the kernel's
four-row passes do not divide; FP4; NVFP4 in 64- and 32-row chunks under several global scales
along K and N; dense float32 and bf16),
random routing with ragged counts per expert, slots that belong to the device (ids below the
device's count) or to nobody (-1, past the end), experts nobody chose, and float32 or bf16
activations, as :class:`jaxdsa.offload.host_experts.HostExperts` receives them.
"""

import jax
import ml_dtypes
import numpy as np
import pytest

from jaxdsa.offload.host_experts import HostExperts
from pallas_kernels.quant import layout

D, N, E, GPU = 512, 256, 6, 3  # K = 512: two INT4 word chunks (gate_up), one (down)


def int4(rng, k, n, *, group, symmetric, scale_dtype, kpack):
    q = rng.integers(-8, 8, size=(E, n, k)).astype(np.int8)
    s = (rng.random((E, n, k // group)) * 0.05 + 0.01).astype(scale_dtype)
    zp = None if symmetric else rng.integers(-8, 8, size=(E, n, k // group)).astype(np.int8)
    return layout.pack_int4(q, s, zp, group_size=group, kpack=kpack)


def fp8(rng, k, n, *, block, e8m0):
    codes = (rng.standard_normal((E, k, n)) * 2).astype(ml_dtypes.float8_e4m3fn)
    shape = (E, -(-k // block[0]), -(-n // block[1]))
    if e8m0:
        scales = rng.integers(120, 125, size=shape).astype(np.uint8).view(ml_dtypes.float8_e8m0fnu)
    else:
        scales = (rng.random(shape) * 0.05).astype(np.float32)
    return layout.QuantizedWeight(codes, scales, None, "fp8", block, 0)


def fp4(rng, k, n):
    codes = rng.integers(0, 16, size=(E, k, n)).astype(np.uint8)
    packed = layout.pack_nibbles(codes, 64)
    scales = rng.integers(118, 126, size=(E, k // 32, n)).astype(np.uint8).view(ml_dtypes.float8_e8m0fnu)
    return layout.QuantizedWeight(packed, scales, None, "fp4", (32, 1), 64)


# e4m3 scale bytes: subnormals (1..7), zero, normals up to 448 (0x7E; 0x7F is NaN)
E4M3_SCALES = np.concatenate([np.arange(0, 8), np.arange(0x30, 0x48), [0x7E]]).astype(np.uint8)


def nvfp4(rng, k, n, *, kpack, global_group, scale_bytes=np.arange(0x28, 0x40, dtype=np.uint8)):
    """Every e2m1 code; e4m3 scales from ``scale_bytes``; a random global scale per ``global_group``
    block (not one per matrix: the kernel must take each block's own)."""
    codes = rng.integers(0, 16, size=(E, n, k)).astype(np.uint8)
    scales = rng.choice(scale_bytes, size=(E, n, k // 16)).view(ml_dtypes.float8_e4m3fn)
    w = layout.pack_nvfp4(codes, scales, np.ones(E, np.float32), kpack=kpack, global_group=global_group)
    g = (rng.random(w.global_scales.shape) * 2e-3 + 1e-4).astype(np.float32)
    return w.replace(global_scales=g)


def dense(rng, k, n, dtype):
    return (rng.standard_normal((E, k, n)) * k**-0.5).astype(dtype)


FORMATS = {
    "int4-words-asym-bf16": lambda r, k, n: int4(
        r, k, n, group=32, symmetric=False, scale_dtype=ml_dtypes.bfloat16, kpack=256
    ),
    "int4-bytes-sym-f32": lambda r, k, n: int4(
        r, k, n, group=64, symmetric=True, scale_dtype=np.float32, kpack=64
    ),
    "fp8-f32-blocks": lambda r, k, n: fp8(r, k, n, block=(32, 32), e8m0=False),
    "fp8-e8m0-blocks": lambda r, k, n: fp8(r, k, n, block=(128, 128), e8m0=True),
    "fp8-f32-ragged-blocks": lambda r, k, n: fp8(r, k, n, block=(6, 64), e8m0=False),  # 6 rows: a tail
    "fp4": fp4,
    "nvfp4-kpack64": lambda r, k, n: nvfp4(r, k, n, kpack=64, global_group=(128, 128)),
    "nvfp4-kpack32": lambda r, k, n: nvfp4(r, k, n, kpack=32, global_group=(256, 64)),
    "dense-f32": lambda r, k, n: dense(r, k, n, np.float32),
    "dense-bf16": lambda r, k, n: dense(r, k, n, ml_dtypes.bfloat16),
}


def host_experts(fmt, rng, *, stacked, swiglu_limit=None):
    def one():
        gate, up = FORMATS[fmt](rng, D, N), FORMATS[fmt](rng, D, N)
        if isinstance(gate, np.ndarray):
            return np.concatenate([gate, up], axis=-1), FORMATS[fmt](rng, N, D)
        return layout.concat_n(gate, up), FORMATS[fmt](rng, N, D)

    layers = [one() for _ in range(2 if stacked else 1)]
    pack = lambda *xs: np.stack(xs) if stacked else xs[0]  # noqa: E731
    gate_up = jax.tree.map(pack, *[g for g, _ in layers])
    down = jax.tree.map(pack, *[d for _, d in layers])
    # (the CPU device is asked for here, not at import: collection must not start JAX's backends)
    experts = jax.device_put({"gate_up": gate_up, "down": down}, jax.devices("cpu")[0])
    return HostExperts(experts, gpu=GPU, stacked=stacked, swiglu_limit=swiglu_limit)


def routing(rng, tokens, k=4):
    """Slots over the device's experts, the host's, and none (-1, past the end); one host expert
    nobody picks."""
    total = GPU + E
    slots = rng.integers(0, total + 1, size=(tokens, k)).astype(np.int32)
    slots[slots == GPU + 1] = GPU  # host expert 1 is never chosen
    slots[rng.random(slots.shape) < 0.1] = -1
    return slots, rng.random((tokens, k)).astype(np.float32)


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("tokens", [1, 5])
def test_kernel_matches_reference(fmt, tokens):
    rng = np.random.default_rng(abs(hash((fmt, tokens))) % 2**32)
    stacked = tokens == 5
    host = host_experts(fmt, rng, stacked=stacked, swiglu_limit=0.8 if fmt == "fp4" else None)
    for act in (np.float32, ml_dtypes.bfloat16):
        x = rng.standard_normal((tokens, D)).astype(act)
        slots, weights = routing(rng, tokens)
        layer = 1 if stacked else 0
        got, want = host.compute(x, slots, weights, layer), host.reference(x, slots, weights, layer)
        assert got.dtype == np.float32 and got.shape == (tokens, D)
        scale = np.abs(want).max() + 1e-30
        bound = 1e-5 if act == np.float32 else 1e-2  # bf16: a product rounds differently once in a while
        assert np.abs(got - want).max() <= bound * scale, (fmt, act)


@pytest.mark.parametrize("kpack", [64, 32])
@pytest.mark.parametrize("tokens", ["one", "many"])
def test_nvfp4_weights_are_the_formats_exactly(kpack, tokens):
    """One-hot activations read the decoded weights back: every e2m1 code under subnormal, zero and
    normal e4m3 scales and global scales (2 along K, 3 along N) is ``e2m1(q) * fl32(fp32(s) * g)``
    to the bit (layout.dequantize), for float32 activations and rounded to bf16 for bf16 ones, in
    the one-token loop (a group per row) and the many-token one."""
    from jaxdsa.offload import cpu_moe

    rng = np.random.default_rng(kpack)
    k, n = 128, 96
    w = nvfp4(rng, k, n, kpack=kpack, global_group=(64, 32), scale_bytes=E4M3_SCALES)
    weight, e = cpu_moe.HostWeight.of(w, None), 2
    if tokens == "one":
        offsets, experts = np.arange(k + 1), np.full(k, e)
    else:
        offsets, experts = np.array([0, k]), np.array([e])
    eye = np.eye(k, dtype=np.float32)
    for dtype, bf16 in ((np.float32, False), (ml_dtypes.bfloat16, True)):
        got = cpu_moe.expert_matmul(eye, offsets, experts, weight, bf16, n, block=64)
        want = np.asarray(layout.dequantize(jax.tree.map(lambda a: a[e], w), dtype)).astype(np.float32)
        np.testing.assert_array_equal(got, want)


def test_no_host_slot_gives_zeros():
    rng = np.random.default_rng(0)
    host = host_experts("int4-words-asym-bf16", rng, stacked=False)
    x = rng.standard_normal((3, D)).astype(np.float32)
    slots = np.array([[0, 1], [2, -1], [GPU + E, 1]], np.int32)  # device experts, none, past the end
    out = host.compute(x, slots, np.ones((3, 2), np.float32), 0)
    assert not out.any()


def test_bf16_rounding_matches_ml_dtypes():
    """The kernel's branch-free rounding (Veltkamp's split) is bf16's round-to-nearest-even on
    every INT4 product (ties included) and on random floats; with a zero constant it is the identity."""
    import numba

    from jaxdsa.offload import cpu_moe

    @numba.njit
    def rounded(w, split):
        out = np.empty_like(w)
        for i in range(w.shape[0]):
            out[i] = cpu_moe._round(w[i], split)
        return out

    significands = np.arange(128, 256, dtype=np.float32)
    products = [
        (d[:, None] * significands[None, :] * np.float32(2.0**e)).ravel()
        for d in [np.arange(-15, 16, dtype=np.float32)]
        for e in (-40, -12, 0, 20)
    ]
    w = np.concatenate(products + [np.random.default_rng(0).standard_normal(100_000).astype(np.float32)])
    want = w.astype(ml_dtypes.bfloat16).astype(np.float32)
    np.testing.assert_array_equal(rounded(w, cpu_moe.SPLIT_BF16), want)
    np.testing.assert_array_equal(rounded(w, np.float32(0)), w)


WORD_DOT_ASM = """
import re, numpy as np
from jaxdsa.offload import cpu_moe
x, codes = np.zeros(256, np.float32), np.zeros((32, 64), np.int32)
rows, acc = np.zeros((8, 64), np.float32), np.zeros(64, np.float32)
cpu_moe._word_dot(x, 0, codes, 0, 32, 0, rows, rows, cpu_moe.SPLIT_BF16, acc)
print(len(re.findall("zmm", next(iter(cpu_moe._word_dot.inspect_asm().values())))))
"""


@pytest.mark.skipif(
    not __import__("llvmlite.binding").binding.get_host_cpu_features().get("avx512f"), reason="no AVX-512"
)
def test_word_kernel_runs_in_512_bit_vectors(tmp_path):
    """On an AVX-512 host the INT4 word loop is compiled for 512-bit registers (zmm), not the 256-bit
    ones LLVM's tuning for these cores prefers; a fresh process, so that nothing compiled before
    the kernel module's import has started Numba's CPU target with the default features."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith("NUMBA_CPU_")}
    env["NUMBA_CACHE_DIR"] = str(tmp_path)
    out = subprocess.run(
        [sys.executable, "-c", WORD_DOT_ASM], env=env, capture_output=True, text=True, check=True
    )
    assert int(out.stdout.split()[-1]) > 0
