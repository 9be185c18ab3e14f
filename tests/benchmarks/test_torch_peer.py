"""The torch peer of benchmarks/quant.py against the layout's own dequantizer and the MoE reference
(runs where torch is installed; the benchmark skips its torch rows otherwise)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from pallas_kernels.moe import ref
from pallas_kernels.quant import layout

torch = pytest.importorskip("torch")
torch_peer = pytest.importorskip("benchmarks.torch_peer")


def _weights(rng, fmt, e, n, k):
    if fmt == "int4":
        q, zp = rng.integers(-8, 8, size=(e, n, k)), rng.integers(-8, 8, size=(e, n, k // 32))
        s = (rng.uniform(0.5, 1.5, size=(e, n, k // 32)) / 64).astype(ml_dtypes.bfloat16)
        return layout.pack_int4(q, s, zp, group_size=32)
    codes = rng.integers(0, 256, size=(e, n, k)).astype(np.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0
    s = rng.uniform(1e-3, 1e-2, size=(e, -(-n // 128), -(-k // 128))).astype(np.float32)
    return layout.pack_fp8(codes.view(ml_dtypes.float8_e4m3fn), s, block=(128, 128))


def _tensor(a) -> torch.Tensor:
    a = np.asarray(a)
    if a.dtype == ml_dtypes.bfloat16:
        return torch.from_numpy(a.astype(np.float32)).to(torch.bfloat16)
    return torch.from_numpy(np.ascontiguousarray(a.view(np.uint8) if a.dtype.itemsize == 1 else a))


def _to_torch(w: layout.QuantizedWeight):
    zeros = None if w.zeros is None else _tensor(w.zeros)
    return torch_peer.TorchWeight(_tensor(w.codes), _tensor(w.scales), zeros, w.format, w.group, w.kpack)


@pytest.mark.parametrize("fmt", ["int4", "fp8"])
def test_peer_matches_the_layout_and_the_reference(fmt):
    rng = np.random.default_rng(0)
    e, d, n, t, k = 8, 128, 64, 5, 2
    ex = ref.pack_experts(
        _weights(rng, fmt, e, n, d), _weights(rng, fmt, e, n, d), _weights(rng, fmt, e, d, n)
    )
    for w in ex.values():
        got = torch_peer.dequantize(_to_torch(w), torch.float32).numpy()
        np.testing.assert_array_equal(got, np.asarray(layout.dequantize(jax.tree.map(jnp.asarray, w))))
    x = rng.standard_normal((t, d)).astype(np.float32)
    ids = np.stack([rng.permutation(e)[:k] for _ in range(t)])
    w = rng.random((t, k)).astype(np.float32)
    want = ref.moe_experts(
        jnp.asarray(x, jnp.bfloat16),
        jnp.asarray(ids, jnp.int32),
        jnp.asarray(w),
        jax.tree.map(jnp.asarray, ex),
    )
    got = torch_peer.moe(
        torch.from_numpy(x).to(torch.bfloat16),
        torch.from_numpy(ids),
        torch.from_numpy(w),
        *map(_to_torch, ex.values()),
    )
    want = np.asarray(want, np.float32)
    assert np.linalg.norm(got.float().numpy() - want) / np.linalg.norm(want) < 1e-2
