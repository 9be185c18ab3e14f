"""Quantized weights on a mesh of 8 CPU devices: one PartitionSpec shards codes, scales and zero
points alike (every leaf is [..., K', N']), a split along K or N hands each device matching slices,
and quant_matmul run per shard (column- or row-parallel) reproduces the single-device product."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from pallas_kernels.quant import layout
from pallas_kernels.quant_matmul import kernel, ref


def _int4(rng, lead, n, k, group=32, kpack=None):
    """A packed INT4 weight; split along K, it needs chunks that fit a shard, as the loader picks them
    from the shard's K (``kpack``; words by default where K allows)."""
    q = rng.integers(-8, 8, size=(*lead, n, k))
    zp = rng.integers(-8, 8, size=(*lead, n, k // group))
    s = (rng.uniform(0.5, 1.5, size=(*lead, n, k // group)) / 64).astype(ml_dtypes.bfloat16)
    return layout.pack_int4(q, s, zp, group_size=group, kpack=kpack)


def _place(w, mesh, spec):
    return jax.tree.map(lambda a: jax.device_put(a, NamedSharding(mesh, spec)), w)


def test_every_leaf_gets_the_same_slice():
    """Experts over 4 devices, their K (rows) over 2: each device's codes, scales and zero points
    cover the same experts and the same K rows (whole 64-row chunks and 32-row groups)."""
    mesh = jax.make_mesh((4, 2), ("ep", "tp"))
    w = _int4(np.random.default_rng(0), (8,), 96, 256, kpack=64)
    layout.check_split(w, "k", 2)
    placed = _place(w, mesh, P("ep", "tp", None))
    for codes, scales, zeros in zip(
        *(a.addressable_shards for a in (placed.codes, placed.scales, placed.zeros))
    ):
        assert codes.device == scales.device == zeros.device
        assert codes.data.shape == (2, 64, 96) and scales.data.shape == zeros.data.shape == (2, 4, 96)
        experts, rows = codes.index[0], codes.index[1]
        assert scales.index[0] == experts and scales.index[1] == slice(rows.start // 16, rows.stop // 16)
        np.testing.assert_array_equal(scales.data, np.asarray(w.scales)[experts, scales.index[1]])


@pytest.mark.parametrize("split", ["n", "k"])
def test_quant_matmul_per_shard(split):
    """Column-parallel (W split along N, outputs concatenated) and row-parallel (W and x split along
    K, partial products summed): the interpreted kernel on each shard equals the whole product."""
    mesh = jax.make_mesh((8,), ("tp",))
    rng = np.random.default_rng(1)
    w = _int4(rng, (), 256 if split == "n" else 64, 512, kpack=None if split == "n" else 64)
    x = jnp.asarray(rng.standard_normal((3, 512)), jnp.float32)
    want = ref.quant_matmul(x, jax.tree.map(jnp.asarray, w))
    layout.check_split(w, split, 8)
    qmm = functools.partial(kernel.quant_matmul, interpret=True)
    if split == "n":
        f = jax.shard_map(
            qmm, mesh=mesh, in_specs=(P(), P(None, "tp")), out_specs=P(None, "tp"), check_vma=False
        )
        got = f(x, _place(w, mesh, P(None, "tp")))
    else:
        psum = lambda a, b: jax.lax.psum(qmm(a, b), "tp")  # noqa: E731
        f = jax.shard_map(
            psum, mesh=mesh, in_specs=(P(None, "tp"), P("tp", None)), out_specs=P(), check_vma=False
        )
        got = f(jax.device_put(x, NamedSharding(mesh, P(None, "tp"))), _place(w, mesh, P("tp", None)))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
