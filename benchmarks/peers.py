"""Torch peers measured in the same process and on the same inputs as the JAX kernels.

The anchors (``docs/anchors.md``) timed torch in separate runs with CUDA events; here each peer
gets the very buffers our kernel read (JAX arrays handed over through DLPack, no copy) and is timed
by :func:`benchmarks.timing.median_seconds`, as ours are: its R calls over R input sets are
captured in one CUDA graph (XLA runs ours from command buffers, i.e. CUDA graphs, too), and a
replay enqueues several graph launches and waits once. An op that cannot be captured runs eagerly
(``how`` says which).

Both frameworks share the GPU: the benchmark process sets ``XLA_PYTHON_CLIENT_PREALLOCATE=false``
(and caps JAX at ``XLA_PYTHON_CLIENT_MEM_FRACTION``) so torch's caching allocator finds memory.

Peers: ``torch.topk`` (unsorted, as our top-k), ``torch._grouped_mm`` MoE (routing on the device:
stable argsort of the slots, counts, two grouped GEMMs, SwiGLU, weighted sum), SDPA through cuDNN
(dense causal prefill), ``copy_`` and ``sum`` (memory ceilings) and a bf16 matmul.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from benchmarks import timing


def to_torch(x: jax.Array) -> torch.Tensor:
    """The same device buffer as a torch tensor (DLPack; JAX keeps ownership, so keep ``x``)."""
    return torch.from_dlpack(jax.block_until_ready(x))


def to_jax(x: torch.Tensor) -> jax.Array:
    return jax.dlpack.from_dlpack(x.contiguous())


def _graphed(fn: Callable[[], Any]) -> tuple[Callable[[], Any], str]:
    """``fn`` captured in a CUDA graph (warmed up on a side stream first, as torch requires); the
    replay, or ``fn`` itself where capture fails."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            fn()
    except RuntimeError:
        torch.cuda.synchronize()
        return fn, "eager"
    return graph.replay, "graph"


def time_torch(
    fn: Callable[..., Any], input_sets: Sequence[tuple], *, replays: int = 20
) -> tuple[float, str]:
    """Median seconds per ``fn(*inputs)`` over the R sets (one graph of R calls), and how it ran."""
    sets = list(input_sets)
    run, how = _graphed(lambda: [fn(*s) for s in sets])
    sec = timing.median_seconds(run, len(sets), replays, wait=lambda _: torch.cuda.synchronize())
    return sec, how


def torch_ceilings(nbytes: int = 1 << 30, n: int = 8192) -> tuple[dict[str, float], dict[str, float]]:
    """torch ``dst.copy_(src)`` (read + write) and ``src.sum()`` over 1 GiB of float32, GB/s; and a
    bf16 n^3 matmul, TFLOP/s."""
    copy, read = _streams(nbytes)
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    mm, _ = time_torch(lambda: a @ b, [()], replays=10)
    streams = {"torch copy_ (1 GiB)": 2 * nbytes / copy / 1e9, "torch sum (read, 1 GiB)": nbytes / read / 1e9}
    return streams, {"torch bf16 8192^3": 2 * n**3 / mm / 1e12}


def _streams(nbytes: int) -> tuple[float, float]:
    """Seconds of one copy and one read-only sum of ``nbytes`` (buffers freed on return)."""
    src = torch.randn(nbytes // 4, device="cuda")
    dst = torch.empty_like(src)
    copy, _ = time_torch(lambda: dst.copy_(src), [()], replays=10)
    read, _ = time_torch(lambda: src.sum(), [()], replays=10)
    return copy, read


def topk(x: torch.Tensor, k: int) -> torch.Tensor:
    return torch.topk(x, k, dim=-1, sorted=False).indices


def grouped_moe(
    x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor
) -> torch.Tensor:
    """Routed experts with ``torch._grouped_mm`` (the anchors' recipe): slots sorted by expert,
    int32 group ends, gate|up GEMM, SwiGLU, down GEMM, weighted sum back in token order.
    gate_up [E, D, 2N] and down [E, N, D], as :func:`pallas_kernels.moe.ref.pack_experts` packs them."""
    t, k = ids.shape
    n_experts, _, two_n = gate_up.shape
    flat = ids.reshape(-1).long()
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(n_experts, dtype=torch.int32, device=x.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    xs = x[order // k]
    h = torch._grouped_mm(xs, gate_up, offs=offs)
    act = F.silu(h[:, : two_n // 2]) * h[:, two_n // 2 :]
    y = torch._grouped_mm(act, down, offs=offs)
    out = torch.empty_like(y)
    out[order] = y
    weighted = out.view(t, k, -1).float() * w.float()[..., None]
    return weighted.sum(1).to(x.dtype)


def sdpa_cudnn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention through cuDNN; q/k/v [B, T, H, D] (JAX's layout), returned in that layout."""
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, scale=scale
        )
    return out.transpose(1, 2)
