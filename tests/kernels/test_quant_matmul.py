"""Quantized weights: the layout's packers and dequantizer, the in-kernel decoders, and the
``quant_matmul`` kernels (tensor-core and GEMV) vs their reference (CPU, interpret mode) on fresh
random codes, scales and zero points. The decoders and the dequantizer are held to the NumPy format
decoders of ``jaxdsa.checkpoints.quant`` (written from the formats' bit layouts) bit for bit.
"""

from __future__ import annotations

import functools
import itertools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jaxdsa import ops
from jaxdsa.checkpoints import quant as formats
from pallas_kernels._triton import compute_capability
from pallas_kernels.quant import decode, layout
from pallas_kernels.quant_matmul import kernel, ref, tuning

BF16 = ml_dtypes.bfloat16


def _same_bits(got, want) -> None:
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    nan = np.isnan(want)
    np.testing.assert_array_equal(np.isnan(got), nan)
    np.testing.assert_array_equal(got[~nan].view(np.uint32), want[~nan].view(np.uint32))


def _same_leaves(a, b) -> None:
    """Two weights hold identical arrays (compared as bytes: float8 NaN codes included)."""
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        x, y = np.ascontiguousarray(x), np.ascontiguousarray(y)
        assert x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_array_equal(x.view(np.uint8), y.view(np.uint8))


def _rel(got, want) -> float:
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


# ---- random weights in the checkpoints' own (HF [out, in]) form ----------------------------------


def random_int4(rng, lead, n, k, group, *, symmetric, scale_dtype=BF16, kpack=None):
    """(packed weight, float32 [..., K, N] reference values by the NumPy decoder); int32 words when
    K is a multiple of 256, unless ``kpack`` asks for bytes."""
    q = rng.integers(-8, 8, size=(*lead, n, k))
    zp = None if symmetric else rng.integers(-8, 8, size=(*lead, n, k // group))
    scale = (rng.uniform(0.5, 1.5, size=(*lead, n, k // group)) / (8 * np.sqrt(k))).astype(scale_dtype)
    want = formats.dequantize_int4_values(q, scale, zp, group).astype(np.float32)
    return layout.pack_int4(q, scale, zp, group_size=group, kpack=kpack), np.swapaxes(want, -1, -2)


def random_fp8(rng, lead, n, k, block=(128, 128), *, e8m0=False, nan=False):
    codes = rng.integers(0, 256, size=(*lead, n, k)).astype(np.uint8)
    if not nan:
        codes[(codes & 0x7F) == 0x7F] = 0x7E
    q = codes.view(ml_dtypes.float8_e4m3fn)
    grid = (*lead, -(-n // block[0]), -(-k // block[1]))
    if e8m0:
        scale = rng.integers(110, 124, size=grid).astype(np.uint8).view(ml_dtypes.float8_e8m0fnu)
    else:
        scale = (rng.uniform(0.5, 2, size=grid) / (64 * np.sqrt(k))).astype(np.float32)
    want = np.stack(
        [
            formats.dequantize_fp8_block(a, s, block)
            for a, s in zip(q.reshape(-1, n, k), scale.reshape(-1, *grid[-2:]))
        ]
    )
    return layout.pack_fp8(q, scale, block=block), np.swapaxes(want.reshape(*lead, n, k), -1, -2)


def random_fp4(rng, lead, n, k):
    codes = rng.integers(0, 16, size=(*lead, n, k)).astype(np.uint8)
    e = rng.integers(118, 125, size=(*lead, n, k // 32)).astype(np.uint8).view(ml_dtypes.float8_e8m0fnu)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)  # the V4 checkpoint bytes
    want = formats.dequantize_fp4(packed, e)
    return layout.pack_fp4(formats.unpack_fp4(packed), e), np.swapaxes(want, -1, -2)


def _device(w):
    return jax.tree.map(jnp.asarray, w)


# ---- element decoders ----------------------------------------------------------------------------


@pytest.mark.parametrize("mode", decode.MODES)
def test_e4m3_decoders_every_code(mode):
    codes = jnp.arange(256, dtype=jnp.int32)
    _same_bits(jax.jit(lambda c: decode.e4m3_to_f32(c, mode))(codes), formats.decode_e4m3(np.arange(256)))


def test_e2m1_and_e8m0_decoders_every_code():
    _same_bits(jax.jit(decode.e2m1_to_f32)(jnp.arange(16)), formats.decode_e2m1(np.arange(16)))
    _same_bits(jax.jit(decode.e8m0_to_f32)(jnp.arange(256)), formats.decode_e8m0(np.arange(256)))


def test_e8m0_to_bf16_every_code():
    """FP4's packed-register decode multiplies by the ue8m0 scales as bf16: every byte is exact there
    (0 the subnormal 2^-127, 255 NaN), compared as bits so no float arithmetic can flush them."""
    got = np.asarray(jax.jit(decode.e8m0_to_bf16)(jnp.arange(256))).view(np.uint16)
    want = formats.decode_e8m0(np.arange(256)).astype(BF16).view(np.uint16)
    np.testing.assert_array_equal(got[:255], want[:255])
    assert np.isnan(np.asarray(got[255:]).view(BF16).astype(np.float32)).all()


def _fp4_decode_kernel(words: bool):
    """A Pallas kernel writing :func:`decode.fp4_ptx`'s (``fp4_word_ptx``'s) tiles as they are: the
    decode alone, no tensor-core product that could treat subnormals its own way."""
    from pallas_kernels._triton import pl

    def body(codes_ref, scale_ref, *out_refs):
        codes, scale = codes_ref[...], scale_ref[...]
        for part, out in enumerate(out_refs):
            if words:
                out[...] = decode.fp4_word_ptx(codes, scale, part)
            else:
                out[...] = decode.fp4_ptx(codes, scale, high=bool(part))

    def run(codes, scale):
        out = jax.ShapeDtypeStruct(codes.shape, jnp.bfloat16)
        return pl.pallas_call(body, out_shape=[out] * (8 if words else 2))(codes, scale)

    return jax.jit(run)


@pytest.mark.parametrize("words", [False, True])
def test_fp4_ptx_decode_every_code_and_scale_on_gpu(words):
    """On a GPU: the packed-register FP4 decode gives, for all 16 e2m1 codes in every nibble position
    under every ue8m0 scale (NaN included; subnormal products too), the bits of the format's
    float32 definition rounded to bf16."""
    if compute_capability() < 80:  # asked at run time: JAX must not start at collection
        pytest.skip("inline PTX runs only on a GPU")
    rng = np.random.default_rng(11)
    rows, cols = 32, 256
    dtype = np.uint32 if words else np.uint8
    codes = rng.integers(0, np.iinfo(dtype).max, size=(rows, cols), dtype=dtype, endpoint=True)
    codes[0] = (np.arange(cols) % 16) * (0x11111111 if words else 0x11)  # every code in every nibble
    exps = (np.arange(rows * cols) % 256).reshape(rows, cols).astype(np.uint8)
    scale = jax.jit(decode.e8m0_to_bf16)(jnp.asarray(exps))
    got = _fp4_decode_kernel(words)(jnp.asarray(codes.view(np.int32) if words else codes), scale)
    for part, tile in enumerate(got):
        nibbles = (codes.astype(np.int64) >> (4 * part)) & 0xF
        want = (formats.decode_e2m1(nibbles) * formats.decode_e8m0(exps)).astype(BF16)
        _same_bits(np.asarray(tile).astype(np.float32), want.astype(np.float32))


def test_decode_switch(monkeypatch):
    monkeypatch.delenv(decode.ENV, raising=False)
    assert [decode.fp_decode(cc=cc) for cc in (0, 80, 86, 89, 90, 120)] == ["software"] * 3 + ["native"] * 3
    monkeypatch.setenv(decode.ENV, "software")
    assert decode.fp_decode(cc=90) == "software" and decode.fp_decode("native", cc=80) == "native"
    monkeypatch.setenv(decode.ENV, "fast")
    with pytest.raises(ValueError, match="JAXDSA_FP_DECODE"):
        decode.fp_decode()


# ---- layout ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "make",
    [
        functools.partial(random_int4, lead=(), n=48, k=128, group=32, symmetric=False),
        functools.partial(random_int4, lead=(3,), n=32, k=256, group=128, symmetric=True),
        functools.partial(
            random_int4, lead=(), n=16, k=96, group=32, symmetric=False, scale_dtype=np.float16
        ),
        functools.partial(random_fp8, lead=(), n=576, k=320, nan=True),  # partial blocks both ways
        functools.partial(random_fp8, lead=(2,), n=80, k=64, block=(32, 64), e8m0=True),
        functools.partial(random_fp4, lead=(2,), n=32, k=128),
    ],
    ids=["int4-asym-g32", "int4-sym-g128-E3", "int4-f16-K96", "fp8-576x320-nan", "fp8-e8m0-E2", "fp4-E2"],
)
def test_dequantize_is_the_format_definition(make):
    """NumPy- and jnp-packed leaves agree, and dequantize() reproduces jaxdsa.checkpoints.quant bit for
    bit."""
    w, want = make(np.random.default_rng(0))
    wj = _device(w)
    assert w.shape == want.shape
    _same_leaves(w, wj)
    _same_bits(layout.dequantize(wj), want)


def test_from_checkpoint_tensors():
    """The loader's path: compressed-tensors int32 words -> jaxdsa.checkpoints.quant.int4_values ->
    layout.pack_int4 dequantizes exactly as jaxdsa.checkpoints.quant.dequantize_int4_packed."""
    rng = np.random.default_rng(6)
    n, k, g = 40, 256, 128
    q, zp = rng.integers(-8, 8, size=(n, k)), rng.integers(-8, 8, size=(n, k // g))
    scale = rng.uniform(0.01, 0.1, size=(n, k // g)).astype(BF16)

    def words(v, axis):  # eight 4-bit fields per int32, element i at bits 4i, offset +8
        v = np.moveaxis(v + 8, axis, -1).astype(np.uint32)
        v = v.reshape(*v.shape[:-1], -1, 8) << (4 * np.arange(8, dtype=np.uint32))
        return np.moveaxis(np.bitwise_or.reduce(v, axis=-1).view(np.int32), -1, axis)

    packed, zeros = words(q, 1), words(zp, 0)
    qs, zps = formats.int4_values(packed, scale, zeros, (n, k), g)
    w = layout.pack_int4(qs, scale, zps, group_size=g)
    want = formats.dequantize_int4_packed(packed, scale, zeros, (n, k), g).astype(np.float32).T
    _same_bits(layout.dequantize(_device(w)), want)


def test_jnp_packers_match_numpy():
    rng = np.random.default_rng(1)
    q, zp = rng.integers(-8, 8, size=(2, 48, 128)), rng.integers(-8, 8, size=(2, 48, 4))
    s = rng.uniform(0.01, 0.1, size=(2, 48, 4)).astype(BF16)
    a = layout.pack_int4(q, s, zp, group_size=32)
    b = layout.pack_int4(*map(jnp.asarray, (q, s, zp)), group_size=32)
    _same_leaves(a, b)
    np.testing.assert_array_equal(layout.unpack_nibbles(a.codes, a.kpack), np.swapaxes(q + 8, -1, -2))


def test_concat_n_reblocks_partial_fp8_blocks():
    """gate | up of 96 columns each in 64-column blocks: the scale groups narrow to 32 columns."""
    rng = np.random.default_rng(2)
    (g, g_want), (u, u_want) = (random_fp8(rng, (2,), 96, 64, block=(64, 32)) for _ in range(2))
    both = layout.concat_n(g, u)
    assert both.group == (32, 32) and both.shape == (2, 64, 192)
    _same_bits(layout.dequantize(_device(both)), np.concatenate([g_want, u_want], axis=-1))


def test_padding_appends_zero_weights():
    """pad_n / pad_k (heads padded for tensor parallelism; NumPy, as the loader pads) append exact
    zeros in every format, FP8 inside a partial block too; a 4-bit K grows only by whole chunks."""
    rng = np.random.default_rng(5)
    made = (
        random_int4(rng, (), 24, 64, 32, symmetric=False),
        random_fp8(rng, (), 24, 40, block=(32, 32)),
        random_fp4(rng, (), 24, 64),
    )
    for w, want in made:
        padded = layout.pad_k(layout.pad_n(w, 40), 128)
        assert isinstance(padded.codes, np.ndarray) and padded.shape == (128, 40)
        _same_bits(layout.dequantize(_device(padded)), np.pad(want, ((0, 128 - want.shape[0]), (0, 16))))
    with pytest.raises(ValueError, match="whole 64-row packed chunks"):
        layout.pad_k(made[0][0], 96)


def test_pytree_and_split_checks():
    w, _ = random_int4(np.random.default_rng(3), (4,), 64, 256, 32, symmetric=False, kpack=64)
    leaves, tree = jax.tree.flatten(w)
    assert len(leaves) == 3 and jax.tree.unflatten(tree, leaves).format == "int4"
    assert jax.tree.map(lambda _: "spec", w).scales == "spec"  # one spec per leaf, same structure
    layout.check_split(w, "k", 4)  # 64 rows per shard: whole chunks and groups
    layout.check_split(w, "n", 4)
    with pytest.raises(ValueError, match="whole"):
        layout.check_split(w, "k", 8)  # 32-row shards would cut 64-row packed chunks
    words, _ = random_int4(np.random.default_rng(3), (4,), 64, 512, 32, symmetric=False)
    assert words.kpack == layout.WORD_KPACK and words.codes.shape == (4, 64, 64) and words.shape[-2] == 512
    layout.check_split(words, "k", 2)
    with pytest.raises(ValueError, match="whole 256-element"):
        layout.check_split(words, "k", 4)  # 128-row shards would cut 256-row word chunks
    fp8, _ = random_fp8(np.random.default_rng(4), (), 384, 256)
    layout.check_split(fp8, "n", 3)
    with pytest.raises(ValueError, match="whole 128-element"):
        layout.check_split(fp8, "n", 2)


# ---- the kernel ----------------------------------------------------------------------------------

_ref = jax.jit(ref.quant_matmul)


def _check(x, w, *, decode_mode=None, config=None, tol=None):
    got = kernel.quant_matmul(x, w, interpret=True, decode=decode_mode, config=config)
    want = _ref(x, w)
    assert got.shape == want.shape and got.dtype == x.dtype
    tol = tol or (1e-5 if x.dtype == jnp.float32 else 8e-3)
    assert _rel(got, want) <= tol, _rel(got, want)


CASES = [  # (format maker, M, activations dtype, decode mode)
    pytest.param(
        functools.partial(random_int4, n=64, k=128, group=32, symmetric=False),
        1,
        jnp.bfloat16,
        None,
        id="int4-g32-M1-bf16",
    ),
    pytest.param(
        functools.partial(random_int4, n=32, k=256, group=128, symmetric=True),
        37,
        jnp.float32,
        None,
        id="int4-g128-M37-f32",
    ),
    pytest.param(
        functools.partial(random_int4, n=32, k=64, group=32, symmetric=False),
        4096,
        jnp.bfloat16,
        None,
        id="int4-g32-M4096",
    ),
    pytest.param(functools.partial(random_fp8, n=576, k=128), 3, jnp.float32, "software", id="fp8-576-M3-sw"),
    pytest.param(
        functools.partial(random_fp8, n=576, k=128), 200, jnp.bfloat16, "native", id="fp8-576-M200-native"
    ),
    pytest.param(
        functools.partial(random_fp8, n=64, k=320, e8m0=True),
        16,
        jnp.bfloat16,
        "software",
        id="fp8-e8m0-K320-sw",
    ),
    pytest.param(  # a tiny V4's wq_b: K = 40 and N = 24 padded to multiples of 16 in the op
        functools.partial(random_fp8, n=24, k=40, block=(32, 32), e8m0=True),
        5,
        jnp.float32,
        "software",
        id="fp8-e8m0-K40-N24-padded",
    ),
    pytest.param(functools.partial(random_fp4, n=32, k=128), 9, jnp.float32, None, id="fp4-M9-f32"),
]


@pytest.mark.parametrize("make,m,dtype,mode", CASES)
def test_matches_reference(make, m, dtype, mode):
    rng = np.random.default_rng(m)
    w, _ = make(rng, ())
    x = jnp.asarray(rng.standard_normal((m, w.shape[0])), dtype)
    _check(x, _device(w), decode_mode=mode)


@pytest.mark.parametrize("mode", decode.MODES)
@pytest.mark.parametrize("fmt", ["int4", "fp8", "fp4"])
def test_kernel_dequantizes_bit_for_bit(fmt, mode):
    """x = I in float32 makes the kernel's output its dequantized weight, exactly (products with 0
    and 1 and sums of zeros are exact, but for the sign of zero): each format's values, through
    both e4m3 paths."""
    rng = np.random.default_rng(7)
    make = {
        "int4": functools.partial(random_int4, group=32, symmetric=False),
        "fp8": random_fp8,
        "fp4": random_fp4,
    }
    w, want = make[fmt](rng, (), 48, 64)
    got = kernel.quant_matmul(jnp.eye(64, dtype=jnp.float32), _device(w), interpret=True, decode=mode)
    _same_bits(got, want + np.float32(0))  # a sum turns -0 into +0; every other bit must agree


@pytest.mark.parametrize("int4_mode", decode.INT4_MODES)
@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("group", [32, 128])
def test_int4_bf16_activations_bit_for_bit(int4_mode, symmetric, group):
    """bf16 activations take the bf16-arithmetic INT4 decodes when asked ('bf16': 128 + q and 128 + zp
    as bf16 bit patterns, one rounding of the product; 'ptx': the same on packed registers, GPU
    only): the same bits as the float32 path and as the format's definition, with and without zero
    points, one or two scale groups per packed chunk."""
    if (
        int4_mode == "ptx" and compute_capability() < 80
    ):  # asked at run time: JAX must not start at collection
        pytest.skip("inline PTX runs only on a GPU")
    rng = np.random.default_rng(8)
    w, want = random_int4(rng, (), 48, 256, group, symmetric=symmetric)
    eye = jnp.eye(256, dtype=jnp.bfloat16)
    got = kernel.quant_matmul(eye, _device(w), interpret=int4_mode != "ptx", int4_decode=int4_mode)
    assert got.dtype == jnp.bfloat16
    _same_bits(got, want + np.float32(0))


def test_int4_decode_switch(monkeypatch):
    """'ptx' on GPUs, 'bf16' in the interpreter (no inline assembly there); the variable and an
    explicit mode win; 'ptx' in the interpreter is an error, not a silent switch."""
    monkeypatch.delenv(decode.INT4_ENV, raising=False)
    assert decode.int4_decode(cc=90) == "ptx" and decode.int4_decode(cc=80) == "ptx"
    assert decode.int4_decode(cc=0) == "bf16" and decode.int4_decode(cc=90, interpret=True) == "bf16"
    assert decode.int4_decode("f32", cc=90) == "f32"
    monkeypatch.setenv(decode.INT4_ENV, "bf16")
    assert decode.int4_decode(cc=90) == "bf16" and decode.int4_decode("f32") == "f32"
    with pytest.raises(ValueError, match="interpreter"):
        decode.int4_decode("ptx", interpret=True)
    monkeypatch.setenv(decode.INT4_ENV, "fp16")
    with pytest.raises(ValueError, match="int4 decode mode"):
        decode.int4_decode()


def test_tiles_spanning_several_scale_groups():
    """64-row x 32-column FP8 blocks under 128 x 64 tiles: scales broadcast over rows and columns."""
    rng = np.random.default_rng(5)
    w, _ = random_fp8(rng, (), 128, 256, block=(32, 64), e8m0=True)
    x = jnp.asarray(rng.standard_normal((24, 256)), jnp.float32)
    _check(x, _device(w), decode_mode="software", config=tuning.QmmConfig(32, 64, 128, 1, 4, 2))


@pytest.mark.parametrize(
    "splits,block_m,k,kpack", [(4, 16, 512, 64), (2, 64, 512, None), (4, 16, 1024, None)]
)
def test_k_splits(splits, block_m, k, kpack):
    """K splits over byte chunks and word chunks (a 128-row step asked of words takes 256)."""
    rng = np.random.default_rng(splits)
    w, _ = random_int4(rng, (), 32, k, 128, symmetric=False, kpack=kpack)
    x = jnp.asarray(rng.standard_normal((20, k)), jnp.float32)
    _check(x, _device(w), config=tuning.QmmConfig(block_m, 32, 128, splits, 4, 2))


@pytest.mark.parametrize("make,m,dtype,mode", CASES)
def test_layer_stack_read_in_place(make, m, dtype, mode):
    """A weight stacked over 3 layers (``[L, K, N]`` codes, scales, zero points) with a traced layer
    index: exactly the result on that layer's weight, for every layer and format (the padded
    K = 40, N = 24 case slices the layer first), in the kernel and in the reference."""
    rng = np.random.default_rng(m + 1)
    per_layer = [_device(make(rng, ())[0]) for _ in range(3)]
    stack = jax.tree.map(lambda *a: jnp.stack(a), *per_layer)
    assert stack.shape == (3, *per_layer[0].shape)
    x = jnp.asarray(rng.standard_normal((m, stack.shape[1])), dtype)
    run = jax.jit(lambda layer: kernel.quant_matmul(x, stack, layer=layer, interpret=True, decode=mode))
    run_ref = jax.jit(lambda layer: ref.quant_matmul(x, stack, layer=layer))
    for i, w in enumerate(per_layer):
        want = jax.jit(lambda w: kernel.quant_matmul(x, w, interpret=True, decode=mode))(w)
        np.testing.assert_array_equal(run(jnp.int32(i)), want)
        np.testing.assert_array_equal(run_ref(jnp.int32(i)), _ref(x, w))


def test_ops_dispatch_interpret():
    rng = np.random.default_rng(11)
    w, want = random_fp8(rng, (), 32, 128)
    x = jnp.asarray(rng.standard_normal((4, 128)), jnp.float32)
    previous = ops.get_kernels()
    try:
        ops.set_kernels("interpret")
        got = jax.jit(ops.quant_matmul)(x, _device(w))
    finally:
        ops.set_kernels(previous)
    np.testing.assert_allclose(got, np.asarray(x) @ want, rtol=1e-5, atol=1e-5)


def test_tuning_regimes_and_budgets():
    """Every part, row count and code width (4-bit bytes and 256-row words; float32 activations too)
    gets a config within the shared memory that steps in whole packed chunks."""
    for cc, m, itemsize in itertools.product((80, 90, 120), (1, 8, 32, 128, 512, 4096), (2, 4)):
        for bits, floor in ((4, 64), (4, 256), (8, 16)):
            cfg = tuning.choose(m, 6144, 2048, itemsize=itemsize, weight_bits=bits, min_block_k=floor, cc=cc)
            assert cfg.block_m >= min(m, 16) and 6144 % (cfg.block_k * cfg.splits) == 0
            assert cfg.block_k >= floor
            nbytes = tuning.smem_bytes(cfg, itemsize=itemsize, weight_bits=bits)
            assert nbytes <= tuning.shared_memory_budget(cc), (cc, m, cfg)
    decode_cfg = tuning.choose(1, 6144, 2048, itemsize=2, weight_bits=4, min_block_k=64, cc=90)
    assert decode_cfg.splits > 1 and decode_cfg.block_m == 16  # 32 N tiles alone would leave SMs idle
    # 4-bit stream tiles: 3 stages on sm_90 (H100, H200; measured on H100); B200 and FP8 keep 4 until measured
    assert decode_cfg.num_stages == 3
    # ... stepping 64 weight rows (measured on H100); other parts and 8-bit codes keep their steps
    assert decode_cfg.block_k == 64 and 6144 // 64 // decode_cfg.splits >= 2
    assert tuning.choose(1, 6144, 2048, itemsize=2, weight_bits=4, min_block_k=256, cc=90).block_k == 256
    assert tuning.choose(1, 6144, 2048, itemsize=2, weight_bits=4, min_block_k=64, cc=80).block_k == 256
    assert tuning.choose(64, 6144, 2048, itemsize=2, weight_bits=4, min_block_k=64, cc=90).block_k == 128
    assert tuning.choose(1, 6144, 2048, itemsize=2, weight_bits=4, min_block_k=64, cc=100).num_stages == 4
    assert tuning.choose(1, 6144, 2048, itemsize=2, weight_bits=8, min_block_k=16, cc=90).num_stages == 4


@pytest.mark.parametrize("fmt", ["int4", "fp8", "fp4"])
def test_dequantize_first_matches_the_kernel(fmt):
    """Prefill-sized products may dequantize the weight in XLA and use XLA's dot: the same weights
    (the format's definition), so the same result as the kernel up to summation order."""
    rng = np.random.default_rng(11)
    make = {"int4": functools.partial(random_int4, group=32, symmetric=False), "fp8": random_fp8}
    w, want = make.get(fmt, random_fp4)(rng, (), 96, 128)
    x = jnp.asarray(rng.standard_normal((40, 128)), jnp.float32)
    first = kernel.quant_matmul(x, _device(w), dequantize_first=True)
    kern = kernel.quant_matmul(x, _device(w), interpret=True, dequantize_first=False)
    np.testing.assert_allclose(np.asarray(first), np.asarray(x) @ want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(first), np.asarray(kern), rtol=1e-5, atol=1e-5)


def test_dequantize_first_threshold():
    """Only a part whose table names a row count dequantizes first, and only from that count on."""
    for cc, entry in tuning.TABLE.items():
        if entry.dequantize_min_m is None:
            assert not tuning.dequantize_first(1 << 20, cc=cc)
        else:
            m = entry.dequantize_min_m
            assert tuning.dequantize_first(m, cc=cc) and not tuning.dequantize_first(m - 1, cc=cc)
    assert not tuning.dequantize_first(1 << 20, cc=0)  # the interpreter always runs the kernel


def test_dequantize_first_reads_the_stacks_layer():
    """Dequantizing first from a layer stack dequantizes that layer only: each layer's product."""
    rng = np.random.default_rng(12)
    made = [random_int4(rng, (), 64, 128, 32, symmetric=False) for _ in range(3)]
    stack = jax.tree.map(lambda *a: jnp.stack(a), *[_device(w) for w, _ in made])
    x = jnp.asarray(rng.standard_normal((8, 128)), jnp.float32)
    for layer, (_, want) in enumerate(made):
        got = kernel.quant_matmul(x, stack, layer=jnp.int32(layer), dequantize_first=True)
        np.testing.assert_allclose(np.asarray(got), np.asarray(x) @ want, rtol=1e-5, atol=1e-5)


GROUPS = [  # (maker of one weight given N, widths, M, dtype)
    pytest.param(
        lambda rng, lead, n: random_int4(rng, lead, n, 256, 32, symmetric=False),
        (64, 48, 16),
        1,
        jnp.bfloat16,
        id="int4-words-3",
    ),
    pytest.param(
        lambda rng, lead, n: random_int4(rng, lead, n, 128, 32, symmetric=True, kpack=64),
        (32, 96),
        7,
        jnp.float32,
        id="int4-bytes-2",
    ),
    pytest.param(lambda rng, lead, n: random_fp8(rng, lead, n, 256), (128, 64), 20, jnp.float32, id="fp8-2"),
    pytest.param(lambda rng, lead, n: random_fp4(rng, lead, n, 128), (32, 32), 3, jnp.bfloat16, id="fp4-2"),
]


@pytest.mark.parametrize("make,widths,m,dtype", GROUPS)
def test_many_weights_in_one_launch(make, widths, m, dtype):
    """quant_matmul_many: each output is that weight's product (against the reference), in one
    pallas_call whose programs cover every weight's tiles; stacked weights read at a traced layer."""
    rng = np.random.default_rng(m)
    ws = tuple(_device(make(rng, (), n)[0]) for n in widths)
    x = jnp.asarray(rng.standard_normal((m, ws[0].shape[0])), dtype)
    assert kernel.groupable(m, x.shape[1], ws)
    got = kernel.quant_matmul_many(x, ws, interpret=True, decode="software")
    tol = 1e-5 if dtype == jnp.float32 else 8e-3
    for y, w in zip(got, ws):
        assert y.shape == (m, w.shape[1]) and y.dtype == dtype
        assert _rel(y, _ref(x, w)) <= tol

    stacks = tuple(
        jax.tree.map(lambda *a: jnp.stack(a), *(_device(make(rng, (), n)[0]) for _ in range(2)))
        for n in widths
    )
    run = jax.jit(
        lambda layer: kernel.quant_matmul_many(x, stacks, layer=layer, interpret=True, decode="software")
    )
    for i in range(2):
        for y, s in zip(run(jnp.int32(i)), stacks):
            assert _rel(y, _ref(x, layout.take_layer(s, i))) <= tol


def test_many_weights_fall_back_one_by_one():
    """Weights of different formats are not grouped (nor prefill-sized M, where the parts dequantize
    first): each computed alone, the same results."""
    rng = np.random.default_rng(3)
    int4 = _device(random_int4(rng, (), 64, 256, 32, symmetric=False)[0])
    fp8 = _device(random_fp8(rng, (), 64, 256)[0])
    x = jnp.asarray(rng.standard_normal((4, 256)), jnp.float32)
    assert not kernel.groupable(4, 256, (int4, fp8)) and kernel.groupable(4, 256, (int4, int4))
    got = kernel.quant_matmul_many(x, (int4, fp8), interpret=True, decode="software")
    for y, w in zip(got, (int4, fp8)):
        np.testing.assert_array_equal(y, kernel.quant_matmul(x, w, interpret=True, decode="software"))


def test_group_config_covers_every_weight():
    """One block_n dividing each width; K splits counted over all the weights' tiles."""
    rng = np.random.default_rng(4)
    ws = tuple(_device(random_int4(rng, (), n, 6144, 32, symmetric=True)[0]) for n in (2048, 576))
    cfg = kernel.group_config(1, ws, jnp.bfloat16)
    assert 2048 % cfg.block_n == 0 and 576 % cfg.block_n == 0
    assert 6144 % (cfg.block_k * cfg.splits) == 0


# ---- the GEMV kernel (decode-sized M, no tl.dot) --------------------------------------------------


def _gemv(m: int, splits: int = 1) -> tuning.QmmConfig:
    """A GEMV config asking 64 columns and 64 8-bit rows a step (4-bit: at least one packed chunk);
    quant_matmul fits both to the weight."""
    return tuning.QmmConfig(m, 64, 64, splits, 4, 3, gemv=True)


def _grids(fn, *args) -> list[tuple[int, ...]]:
    """The grids of the pallas_calls in ``fn``'s jaxpr (a GEMV launch's has two axes: N tiles, K splits)."""

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "pallas_call":
                yield tuple(eqn.params["grid_mapping"].grid)
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                yield from walk(sub)

    return list(walk(jax.make_jaxpr(fn)(*args).jaxpr))


GEMV_CASES = [  # (format maker, M, activations dtype, decode mode, K splits)
    pytest.param(
        functools.partial(random_int4, n=64, k=512, group=32, symmetric=False),
        1,
        jnp.bfloat16,
        None,
        2,
        id="int4-words-asym-M1-bf16-split2",
    ),
    pytest.param(  # N = 48: 16-column tiles
        functools.partial(random_int4, n=48, k=1024, group=128, symmetric=True),
        2,
        jnp.float32,
        None,
        4,
        id="int4-words-sym-N48-M2-f32-split4",
    ),
    pytest.param(
        functools.partial(random_int4, n=96, k=256, group=32, symmetric=False, kpack=64),
        3,
        jnp.bfloat16,
        None,
        2,
        id="int4-bytes-asym-M3-bf16-split2",
    ),
    pytest.param(  # K = 96: 32-row byte chunks, 16-row pieces
        functools.partial(random_int4, n=32, k=96, group=32, symmetric=True),
        2,
        jnp.float32,
        None,
        1,
        id="int4-bytes32-sym-M2-f32",
    ),
    pytest.param(
        functools.partial(random_fp8, n=576, k=256), 3, jnp.float32, "software", 2, id="fp8-576-M3-f32-split2"
    ),
    pytest.param(
        functools.partial(random_fp8, n=64, k=320, block=(32, 64), e8m0=True),
        1,
        jnp.bfloat16,
        "native",
        1,
        id="fp8-e8m0-K320-M1-bf16",
    ),
    pytest.param(  # K = 40 and N = 24 padded to multiples of 16 in the op
        functools.partial(random_fp8, n=24, k=40, block=(32, 32), e8m0=True),
        2,
        jnp.float32,
        "software",
        1,
        id="fp8-K40-N24-padded-M2-f32",
    ),
    pytest.param(functools.partial(random_fp4, n=32, k=128), 3, jnp.float32, None, 2, id="fp4-M3-f32-split2"),
    pytest.param(functools.partial(random_fp4, n=80, k=256), 1, jnp.bfloat16, None, 1, id="fp4-N80-M1-bf16"),
]


@pytest.mark.parametrize("make,m,dtype,mode,splits", GEMV_CASES)
def test_gemv_matches_reference(make, m, dtype, mode, splits):
    """The GEMV kernel against the reference, with the same tolerances as the tensor-core kernel, in
    one launch of two grid axes (N tiles x K splits)."""
    rng = np.random.default_rng(100 + m)
    w, _ = make(rng, ())
    w = _device(w)
    x = jnp.asarray(rng.standard_normal((m, w.shape[0])), dtype)
    _check(x, w, decode_mode=mode, config=_gemv(m, splits))
    run = lambda x: kernel.quant_matmul(x, w, interpret=True, decode=mode, config=_gemv(m, splits))  # noqa: E731
    [grid] = _grids(run, x)
    assert len(grid) == 2 and grid[1] == splits


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize(
    "fmt", ["int4-words-asym", "int4-words-sym", "int4-bytes-asym", "fp8-native", "fp8-software", "fp4"]
)
def test_gemv_dequantizes_bit_for_bit(fmt, dtype):
    """Three rows of the identity pick three weight rows (in different pieces and chunks) through
    the GEMV kernel, over two K splits: exactly the format's values (bf16 activations: those
    values in bf16, which INT4's are already), but for the sign of zero."""
    rng = np.random.default_rng(9)
    k, rows = 512, np.array([5, 300, 511])
    make = {
        "int4-words-asym": functools.partial(random_int4, group=32, symmetric=False),
        "int4-words-sym": functools.partial(random_int4, group=128, symmetric=True),
        "int4-bytes-asym": functools.partial(random_int4, group=32, symmetric=False, kpack=64),
        "fp8-native": random_fp8,
        "fp8-software": random_fp8,
        "fp4": random_fp4,
    }[fmt]
    w, want = make(rng, (), 48, k)
    x = jnp.asarray(np.eye(k, dtype=np.float32)[rows], dtype)
    mode = fmt.removeprefix("fp8-") if fmt.startswith("fp8") else None
    got = kernel.quant_matmul(x, _device(w), interpret=True, decode=mode, config=_gemv(3, 2))
    assert got.dtype == dtype
    want = want[rows].astype(np.dtype(dtype)).astype(np.float32)
    _same_bits(got, want + np.float32(0))


@pytest.mark.parametrize("make,m,dtype,mode,splits", [GEMV_CASES[i] for i in (0, 2, 4, 7)])
def test_gemv_layer_stack_read_in_place(make, m, dtype, mode, splits):
    """A weight stacked over 3 layers (INT4 words and bytes, FP8, FP4), read in place at a traced
    layer by the GEMV kernel: exactly that layer's own product."""
    rng = np.random.default_rng(m + 7)
    per_layer = [_device(make(rng, ())[0]) for _ in range(3)]
    stack = jax.tree.map(lambda *a: jnp.stack(a), *per_layer)
    x = jnp.asarray(rng.standard_normal((m, stack.shape[1])), dtype)
    cfg = _gemv(m, splits)
    run = jax.jit(
        lambda layer: kernel.quant_matmul(x, stack, layer=layer, interpret=True, decode=mode, config=cfg)
    )
    for i, w in enumerate(per_layer):
        want = jax.jit(lambda w: kernel.quant_matmul(x, w, interpret=True, decode=mode, config=cfg))(w)
        np.testing.assert_array_equal(run(jnp.int32(i)), want)
        assert _rel(want, _ref(x, w)) <= (1e-5 if dtype == jnp.float32 else 8e-3)


GEMV_GROUPS = [  # (maker of one weight given N, widths, M, dtype)
    pytest.param(
        lambda rng, lead, n: random_int4(rng, lead, n, 512, 32, symmetric=False),
        (64, 48, 16),
        2,
        jnp.bfloat16,
        id="int4-words-3",
    ),
    pytest.param(
        lambda rng, lead, n: random_int4(rng, lead, n, 128, 32, symmetric=True, kpack=64),
        (32, 96),
        3,
        jnp.float32,
        id="int4-bytes-2",
    ),
    pytest.param(lambda rng, lead, n: random_fp8(rng, lead, n, 256), (128, 64), 1, jnp.float32, id="fp8-2"),
    pytest.param(
        lambda rng, lead, n: random_fp4(rng, lead, n, 128), (32, 32, 64), 3, jnp.bfloat16, id="fp4-3"
    ),
]


@pytest.mark.parametrize("make,widths,m,dtype", GEMV_GROUPS)
def test_gemv_many_weights_in_one_launch(make, widths, m, dtype, monkeypatch):
    """quant_matmul_many on the GEMV kernel (turned on by the environment): one two-axis launch over
    every weight's tiles, each output that weight's product; stacked weights at a traced layer."""
    monkeypatch.setenv(tuning.GEMV_ENV, "3")
    rng = np.random.default_rng(20 + m)
    ws = tuple(_device(make(rng, (), n)[0]) for n in widths)
    x = jnp.asarray(rng.standard_normal((m, ws[0].shape[0])), dtype)
    many = lambda x: kernel.quant_matmul_many(x, ws, interpret=True, decode="software")  # noqa: E731
    [grid] = _grids(many, x)
    cfg = kernel.group_config(m, ws, dtype)
    assert cfg.gemv and grid == (sum(widths) // cfg.block_n, cfg.splits)
    tol = 1e-5 if dtype == jnp.float32 else 8e-3
    for y, w in zip(many(x), ws):
        assert y.shape == (m, w.shape[1]) and y.dtype == dtype
        assert _rel(y, _ref(x, w)) <= tol

    stacks = tuple(
        jax.tree.map(lambda *a: jnp.stack(a), *(_device(make(rng, (), n)[0]) for _ in range(2)))
        for n in widths
    )
    run = jax.jit(
        lambda layer: kernel.quant_matmul_many(x, stacks, layer=layer, interpret=True, decode="software")
    )
    for i in range(2):
        for y, s in zip(run(jnp.int32(i)), stacks):
            assert _rel(y, _ref(x, layout.take_layer(s, i))) <= tol


def test_gemv_switch(monkeypatch):
    """The table keeps the GEMV path off on every part; ``JAXDSA_QMM_GEMV_MAX_M`` turns it on up to
    that many rows for quant_matmul and quant_matmul_many alike (their launches have two grid axes
    then), 0 turns it off again; ``gemv=`` asks for either config at any M."""
    monkeypatch.delenv(tuning.GEMV_ENV, raising=False)
    rng = np.random.default_rng(13)
    w = _device(random_int4(rng, (), 64, 256, 32, symmetric=False)[0])
    choose = functools.partial(tuning.choose, k=6144, n=2048, itemsize=2, weight_bits=4, min_block_k=256)
    assert tuning.DEFAULT.gemv_max_m == 0 and tuning.gemv_max_m() == 0
    for cc in (*tuning.TABLE, 0):
        assert tuning.gemv_max_m(cc) == 0 and not choose(1, cc=cc).gemv
    assert not kernel.default_config(1, w, jnp.bfloat16).gemv

    def launch_axes(m: int) -> tuple[int, int]:
        x = jnp.ones((m, 256), jnp.bfloat16)
        one = lambda x: kernel.quant_matmul(x, w, interpret=True)  # noqa: E731
        many = lambda x: kernel.quant_matmul_many(x, (w, w), interpret=True)  # noqa: E731
        [a], [b] = _grids(one, x), _grids(many, x)
        return len(a), len(b)

    assert launch_axes(2) == (3, 3)
    monkeypatch.setenv(tuning.GEMV_ENV, "2")
    assert tuning.gemv_max_m(90) == 2 and choose(2, cc=90).gemv and not choose(3, cc=90).gemv
    cfg = kernel.default_config(2, w, jnp.bfloat16)
    assert cfg.gemv and cfg.block_m == 2 and cfg.block_k == 256  # one word chunk a step
    assert launch_axes(2) == (2, 2) and launch_axes(3) == (3, 3)
    assert not kernel.default_config(1, w, jnp.bfloat16, gemv=False).gemv
    monkeypatch.setenv(tuning.GEMV_ENV, "0")
    assert not kernel.default_config(1, w, jnp.bfloat16).gemv and launch_axes(1) == (3, 3)
    forced = kernel.default_config(40, w, jnp.float32, gemv=True)
    assert forced.gemv and forced.block_m == 40
    monkeypatch.setenv(tuning.GEMV_ENV, "one")
    with pytest.raises(ValueError, match=tuning.GEMV_ENV):
        kernel.default_config(1, w, jnp.bfloat16)


def test_gemv_tiles_fit():
    """GEMV configs at decode sizes on every part: within the shared memory, whole packed chunks a
    step (INT4 words: one 256-row chunk), K splits that divide the steps and fill the GPU."""
    for cc, m, itemsize in itertools.product((80, 90, 120), (1, 2, 4, 8), (2, 4)):
        for bits, floor in ((4, 64), (4, 256), (8, 16)):
            cfg = tuning.choose(
                m, 6144, 2048, itemsize=itemsize, weight_bits=bits, min_block_k=floor, cc=cc, gemv=True
            )
            assert cfg.gemv and cfg.block_m == m and cfg.block_k >= floor
            assert 6144 % (cfg.block_k * cfg.splits) == 0 and cfg.splits > 1
            assert tuning.smem_bytes(cfg, itemsize=itemsize, weight_bits=bits) <= tuning.shared_memory_budget(
                cc
            )
    words = tuning.choose(1, 6144, 2048, itemsize=2, weight_bits=4, min_block_k=256, cc=90, gemv=True)
    assert words.block_k == 256
