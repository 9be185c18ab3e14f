"""The torch peer of ``benchmarks/quant.py``: what an engine without fused dequant kernels does.

Weights kept quantized in the kernels' layout (:mod:`pallas_kernels.quant.layout`, shared
with the JAX arrays through DLPack) are dequantized to bf16 for the batch, then multiplied:
``torch._grouped_mm`` for the routed experts (only the experts the batch touches are dequantized;
bf16 experts are passed whole, with empty groups, as HF transformers does) and ``torch.matmul``
for linears. Imports torch only; no JAX, so it runs wherever torch does.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from pallas_kernels.quant.layout import codes_per_element

_E2M1 = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6])


@dataclasses.dataclass(frozen=True)
class TorchWeight:
    """A :class:`~pallas_kernels.quant.layout.QuantizedWeight` as torch tensors (fp8 codes as
    uint8 bytes)."""

    codes: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor | None
    format: str
    group: tuple[int, int]
    kpack: int

    def take(self, index: torch.Tensor) -> TorchWeight:
        """The stacked matrices at ``index`` (leading dim)."""
        pick = lambda t: None if t is None else t.index_select(0, index)  # noqa: E731
        return dataclasses.replace(
            self, codes=pick(self.codes), scales=pick(self.scales), zeros=pick(self.zeros)
        )


def _per_element(a: torch.Tensor, w: TorchWeight, k: int, n: int) -> torch.Tensor:
    gk, gn = w.group
    return a.repeat_interleave(gk, -2)[..., :k, :].repeat_interleave(gn, -1)[..., :n]


def dequantize(w: TorchWeight, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``[..., K, N]`` in ``dtype``, by each format's definition (INT4 rounded to its scale dtype)."""
    if w.format == "fp8":
        k, n = w.codes.shape[-2:]
        s = _per_element(w.scales.float(), w, k, n)
        return (w.codes.view(torch.float8_e4m3fn).float() * s).to(dtype)
    *lead, rows, n = w.codes.shape
    per = codes_per_element(w.kpack)  # 4-bit codes per int32 word or byte (layout.pack_nibbles)
    chunks = w.codes.int().reshape(*lead, per * rows // w.kpack, 1, w.kpack // per, n)
    codes = torch.cat([(chunks >> (4 * j)) & 0xF for j in range(per)], dim=-3).reshape(*lead, per * rows, n)
    s = _per_element(w.scales.float(), w, per * rows, n)
    if w.format == "fp4":
        return (_E2M1.to(codes.device)[codes.long()] * s).to(dtype)
    zero = 8 if w.zeros is None else _per_element(w.zeros.int(), w, per * rows, n)
    return ((codes.int() - zero).float() * s).to(w.scales.dtype).to(dtype)


def dequantize_experts(
    w: TorchWeight, index: torch.Tensor, dtype: torch.dtype, chunk: int = 16
) -> torch.Tensor:
    """The experts at ``index`` dequantized into one ``[len(index), K, N]`` tensor, ``chunk`` experts at
    a time: the float32 temporaries of :func:`dequantize` stay a chunk large (for all 256 GLM-5
    experts at once they would need ~80 GB)."""
    first = dequantize(w.take(index[:chunk]), dtype)
    if index.numel() <= chunk:
        return first
    out = torch.empty((index.numel(), *first.shape[1:]), dtype=dtype, device=first.device)
    out[:chunk] = first
    for i in range(chunk, index.numel(), chunk):
        out[i : i + chunk] = dequantize(w.take(index[i : i + chunk]), dtype)
    return out


def linear(x: torch.Tensor, w: TorchWeight | torch.Tensor) -> torch.Tensor:
    return x @ (w if isinstance(w, torch.Tensor) else dequantize(w, x.dtype))


def moe(
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    gate_up: TorchWeight | torch.Tensor,
    down: TorchWeight | torch.Tensor,
) -> torch.Tensor:
    """out[t] = sum_j w[t,j] * down_e(silu(gate_e x_t) * up_e x_t) with slots sorted by expert and two
    ``torch._grouped_mm`` calls. Quantized experts: the touched ones are dequantized for the batch
    (:func:`dequantize_experts`)."""
    t, k = ids.shape
    flat = ids.reshape(-1)
    if isinstance(gate_up, torch.Tensor):
        groups = flat
        counts = torch.bincount(flat, minlength=gate_up.shape[0])
    else:
        touched, groups = torch.unique(flat, return_inverse=True)
        counts = torch.bincount(groups, minlength=touched.numel())
        gate_up, down = (
            dequantize_experts(gate_up, touched, x.dtype),
            dequantize_experts(down, touched, x.dtype),
        )
    order = torch.argsort(groups, stable=True)
    offs = torch.cumsum(counts, 0).to(torch.int32)
    h = torch._grouped_mm(x[order // k], gate_up, offs=offs)
    n = h.shape[1] // 2
    act = (F.silu(h[:, :n].float()) * h[:, n:].float()).to(x.dtype)
    y = torch._grouped_mm(act, down, offs=offs).float() * weights.reshape(-1)[order, None].float()
    out = torch.zeros(t * k, y.shape[1], dtype=torch.float32, device=x.device)
    out[order] = y
    return out.view(t, k, -1).sum(1).to(x.dtype)


def median_seconds(
    fn: Callable, input_sets: Sequence[tuple], *, replays: int = 20, calls: int = 4, row_s: float = 1.5
) -> float:
    """benchmarks.harness's method for torch: each replay runs ``calls`` x all input sets back to back,
    synchronizes once; median seconds per call. After the warm-up one timed pass sizes the rest: a
    replay lasts ~20 ms or one pass, and slow rows (dequantizing all 256 experts takes ~0.1-0.4 s)
    get fewer replays, at least 3, so a row costs about ``row_s``."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    for inputs in input_sets:  # warm-up
        fn(*inputs)
    sync()
    t0 = time.perf_counter()
    for inputs in input_sets:
        fn(*inputs)
    sync()
    one = max(time.perf_counter() - t0, 1e-6)  # one pass over the sets
    calls = max(1, min(calls, round(0.02 / one)))
    replays = max(3, min(replays, int(row_s / (one * calls))))
    times = []
    for _ in range(replays):
        t0 = time.perf_counter()
        for _ in range(calls):
            for inputs in input_sets:
                fn(*inputs)
        sync()
        times.append((time.perf_counter() - t0) / (calls * len(input_sets)))
    return statistics.median(times)
