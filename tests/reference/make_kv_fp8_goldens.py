#!/usr/bin/env python3
"""Goldens for the FP8 KV cache (``golden_kv_fp8.npz``): HF transformers with the cache quantized as the
released engines store it (not part of CI).

Run with the reference venv ``<venv>``: a Python 3.11 venv with torch==2.13.0 (CPU) transformers==5.23.0
compressed-tensors (README.md here sets it up):

    <venv>/bin/python tests/reference/make_kv_fp8_goldens.py [--only NAME ...] [--out DIR]

Independent of jaxdsa (no JAX, nothing imported from the repository): the formats are re-implemented here in
torch / numpy from their definitions (FlashMLA's ``fp8_ds_mla`` latent rows, vLLM's
``DeepseekV32IndexerCache`` index keys, DeepSeek's ``act_quant`` with ue8m0 scales):

* MLA latent rows: the normed latent c (``kv_a_layernorm`` output, kv_lora_rank values) in tiles of 128; per
  tile ``amax = max(max|c_tile|, 1e-4)``, ``s = amax / 448`` rounded *up* to a power of two (frexp, exact),
  ``q = e4m3fn(c_tile / s)`` (round to nearest even), read back as ``f32(q) * s``; the rope part k_pe (after
  RoPE) is stored in bf16 and read back as ``f32(bf16(k_pe))``. Attention uses the read-back values for every
  cached token, the current one included (the engines write the row, then read it).
* Index keys: k (after the indexer's LayerNorm and RoPE, in the engines' layout: GLM's interleaved RoPE
  rotates pairs in place while HF writes them de-interleaved, so HF's key is permuted back first) is rotated
  by the normalized Sylvester Hadamard matrix H (natural order), ``k_rot = k @ H``, quantized with one scale
  per key as above; the queries are rotated by the same H and not quantized, so a score is
  ``(q @ H) . deq(k_rot)`` = ``q . (deq(k_rot) @ H^T)`` (exact arithmetic); HF's indexer gets the keys
  ``deq(k_rot) @ H^T`` (permuted back to HF's layout).

How HF is patched (transformers 5.23 ``glm_moe_dsa`` / ``deepseek_v32``, identical structure): every attention
module's ``expand_kv(kv_nope, k_rot)`` (called once per forward with all the rows attention reads: the fresh
rows without a cache, cache + new rows with one) gets the read-back rows instead; every indexer's
``forward`` gets a stand-in for ``past_key_values`` whose ``update_indexer`` (the only use the indexer makes
of it) returns the read-back keys (after the real cache's update when there is one). HF's caches keep the
unquantized rows; the quantization is a per-row function, so quantizing on every read equals quantizing once
on write.

For each fixture the committed checkpoint is loaded into HF (float32, eager; FP8 / INT4 files are first
dequantized independently / by compressed-tensors into a temporary float32 checkpoint), the plain goldens
are reproduced (sanity of the load), then with the patch the same prompts give logits_short / logits_long
(full forward, no cache) and greedy generation (KV cache), checked against an uncached forward over the same
tokens. Recorded margins: greedy top-1 minus top-2, the indexer's relative gap at the top-k cut-off under the
FP8 scores (float64, engine formula), the routers' cut-off gaps, and how close any rounding decision came to
flipping (quantized value to an e4m3 midpoint, amax / 448 to a power of two, k_pe to a bf16 midpoint); then
how far the logits move when every quantizer input x gets a deterministic perturbation a u(x) max|row|
(a = 1e-7, 1e-6, 1e-5; 1e-5 on each input kind alone): what last-bit differences between two correct
float32 implementations can do to these goldens. Informational: how far the FP8 cache moves the logits from
golden.npz, each read-back alone, and (GLM) the index keys quantized in HF's layout.
"""

from __future__ import annotations

import argparse
import inspect
import io
import json
import math
import re
import sys
import tempfile
import textwrap
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
import transformers

# same folder: HF runs and FP8 weight blocks as the plain goldens do them
from make_goldens import NEW, fp8_dequantize, full_logits
from make_goldens import greedy as hf_greedy
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures"

FIXTURE_NAMES = ["glm5", "glm52", "dsv32", "glm5_fp8", "dsv32_fp8", "glm5_int4", "dsv32_int4"]

TILE = 128  # latent values per scale
E4M3_MAX = 448.0
AMAX_FLOOR = 1e-4
JITTERS = (1e-7, 1e-6, 1e-5)
PARTS = ("latent", "kpe", "index")
FLIP_WARN = 1e-5  # a rounding decision closer than this (relative) is reported
MAX_CACHE_REL = 1e-5  # cached generate logits vs uncached forward over the same tokens
MAX_PLAIN_REL = 1e-5  # unpatched model vs golden.npz
README_BEGIN = "<!-- kv-fp8 goldens: begin (written by tests/reference/make_kv_fp8_goldens.py) -->"
README_END = "<!-- kv-fp8 goldens: end -->"


# ---------------------------------------------------------------------------------------------
# numpy reference of the roundings (independent of torch's casts; checked against them in self_test)


def e4m3_decode_np(codes: np.ndarray) -> np.ndarray:
    """float8_e4m3fn bytes -> float64: 1 sign, 4 exponent (bias 7), 3 mantissa bits; no infinities, S.1111.111
    is NaN; exponent 0 is subnormal (m / 8 * 2^-6)."""
    c = codes.astype(np.int64)
    sign = np.where(c >> 7, -1.0, 1.0)
    e, m = (c >> 3) & 15, c & 7
    val = np.where(e == 0, m / 8.0 * 2.0**-6, (1.0 + m / 8.0) * np.exp2(e - 7.0))
    return np.where((e == 15) & (m == 7), np.nan, sign * val)


E4M3_POS = e4m3_decode_np(np.arange(0x7F))  # codes 0..126: every finite value >= 0, increasing
E4M3_MID = (E4M3_POS[:-1] + E4M3_POS[1:]) / 2  # rounding boundaries


def e4m3_rne_np(v: np.ndarray) -> np.ndarray:
    """Round float64 values with |v| <= 448 to e4m3fn, to nearest, ties to the even code."""
    a = np.abs(v)
    if not np.all(a <= E4M3_MAX):
        raise ValueError("e4m3_rne_np: |v| > 448")
    hi = np.clip(np.searchsorted(E4M3_POS, a, side="left"), 0, len(E4M3_POS) - 1)
    lo = np.clip(hi - 1, 0, None)
    d_lo, d_hi = a - E4M3_POS[lo], E4M3_POS[hi] - a
    pick = np.where(d_lo < d_hi, lo, np.where(d_hi < d_lo, hi, np.where(lo % 2 == 0, lo, hi)))
    return np.copysign(E4M3_POS[pick], v)


def bf16_rne_np(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 (returned as float32), round to nearest even on the bits (finite inputs)."""
    b = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
    r = (b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000
    return r.astype(np.uint32).view(np.float32)


def e4m3_midpoint_dist(v: np.ndarray) -> np.ndarray:
    """|v - m| for the e4m3 rounding boundary m nearest to each value (|v| <= 448), float64, v's shape."""
    a = np.abs(v.astype(np.float64))
    j = np.searchsorted(E4M3_MID, a)
    below = np.abs(a - E4M3_MID[np.clip(j - 1, 0, None)])
    above = np.abs(E4M3_MID[np.clip(j, None, len(E4M3_MID) - 1)] - a)
    return np.minimum(below, above)


def bf16_midpoint_dist(x: np.ndarray) -> np.ndarray:
    """|x - m| for the bf16 rounding boundary m nearest to each finite float32 value, float64, x's shape."""
    bits = np.abs(np.asarray(x, np.float32)).view(np.uint32)
    lo = (bits & np.uint32(0xFFFF0000)).view(np.float32).astype(np.float64)
    hi = ((bits & np.uint32(0xFFFF0000)) + np.uint32(0x10000)).view(np.float32).astype(np.float64)
    return np.abs(np.abs(x.astype(np.float64)) - (lo + hi) / 2)


def rel_to_pow2(a: np.ndarray) -> np.ndarray:
    """Relative distance of each positive value to the nearest power of two (0 when it is one)."""
    a = a.astype(np.float64)
    m, e = np.frexp(a)  # a = m 2^e, m in [0.5, 1)
    return np.minimum(a - np.ldexp(0.5, e), np.ldexp(1.0, e) - a) / a


def safe_div(d: np.ndarray, x: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(x > 0, d / np.where(x > 0, x, 1.0), np.inf)


def hadamard(n: int) -> np.ndarray:
    """Sylvester's Hadamard matrix of order n (natural order: H_2n = [[H, H], [H, -H]]) / sqrt(n)."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"{n} is not a power of two")
    h = np.ones((1, 1))
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return h / math.sqrt(n)


# ---------------------------------------------------------------------------------------------
# The quantizers (torch; what the goldens use)


def pow2_ceil(a: torch.Tensor) -> torch.Tensor:
    """Smallest power of two >= a (a > 0, float32), exactly: frexp gives a = m 2^e with m in [0.5, 1)."""
    mant, expo = torch.frexp(a)
    expo = torch.where(mant == 0.5, expo - 1, expo)
    return torch.ldexp(torch.ones_like(a), expo)


def qdq_tiles(x: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x float32 [..., n * width] -> (read-back values float32 [..., n * width], x / s [..., n, width],
    amax [..., n]) with one ue8m0 scale per tile of ``width`` values."""
    if x.dtype != torch.float32 or x.shape[-1] % width:
        raise ValueError(f"qdq_tiles: {x.dtype} {tuple(x.shape)} / {width}")
    t = x.reshape(*x.shape[:-1], x.shape[-1] // width, width)
    amax = t.abs().amax(-1).clamp_min(AMAX_FLOOR)
    s = pow2_ceil(amax / E4M3_MAX)
    v = t / s[..., None]  # exact: s is a power of two
    q = v.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return (q.to(torch.float32) * s[..., None]).reshape(x.shape), v, amax


def jitter(x: torch.Tensor, amp: float, width: int) -> torch.Tensor:
    """x + amp * u(x) * max|row| over rows of ``width`` values (a tile, a key, a k_pe vector), u in [-1, 1) a
    hash of x's bits: float32 noise of the size two correct implementations of the same dot products and norms
    can differ by (relative to the row, not to the value, which may be small after cancellation), and a
    deterministic function of the row, so that a cached row gets the same noise at every read."""
    if amp == 0.0:
        return x
    bits = x.detach().contiguous().numpy().view(np.uint32).astype(np.uint64)
    u = ((bits * np.uint64(2654435761)) % np.uint64(2**32)).astype(np.float64) / 2**32 * 2.0 - 1.0
    rows = x.double().reshape(*x.shape[:-1], x.shape[-1] // width, width)
    scale = rows.abs().amax(-1, keepdim=True).expand_as(rows).reshape(x.shape)
    return (x.double() + amp * torch.from_numpy(u) * scale).to(x.dtype)


# ---------------------------------------------------------------------------------------------
# Self-test of the roundings: torch's casts against the numpy reference


def self_test() -> dict[str, Any]:
    out: dict[str, Any] = {}
    # all 256 codes: torch's decode = the numpy decode; re-encoding every finite value gives its code back
    codes = np.arange(256, dtype=np.uint8)
    tdec = torch.from_numpy(codes).view(torch.float8_e4m3fn).to(torch.float64).numpy()
    ndec = e4m3_decode_np(codes)
    if not np.array_equal(np.isnan(tdec), np.isnan(ndec)) or not np.array_equal(
        tdec[~np.isnan(tdec)], ndec[~np.isnan(ndec)]
    ):
        raise AssertionError("e4m3 decode: torch differs from the bit-level definition")
    finite = codes[~np.isnan(ndec)]
    back = torch.from_numpy(ndec[finite].astype(np.float32)).to(torch.float8_e4m3fn).view(torch.uint8).numpy()
    same = (back == finite) | ((finite == 0x80) & (back == 0x80))
    if not same.all() or E4M3_POS[-1] != 448.0 or len(np.unique(ndec[finite])) != 253:
        raise AssertionError("e4m3 round trip of the 254 finite codes failed")
    out["e4m3_codes_checked"] = 256

    # random values (log-uniform magnitudes over the whole range incl. subnormals, both signs), every midpoint
    # exactly (ties to even), and the float32 neighbours of every midpoint
    g = np.random.default_rng(12345)
    mags = np.exp2(g.uniform(-12.0, math.log2(E4M3_MAX), 400_000))
    rnd = (mags * g.choice([-1.0, 1.0], mags.size)).astype(np.float32)
    mids = E4M3_MID.astype(np.float32)
    if not np.array_equal(mids.astype(np.float64), E4M3_MID):
        raise AssertionError("an e4m3 midpoint is not a float32")
    near = np.concatenate(
        [
            mids,
            np.nextafter(mids, np.float32(0)),
            np.nextafter(mids, np.float32(np.inf)),
            E4M3_POS.astype(np.float32),
        ]
    )
    vals = np.concatenate([rnd, near, -near, np.float32([0.0, E4M3_MAX, -E4M3_MAX, 1e-30, -1e-30])])
    t = torch.from_numpy(vals).to(torch.float8_e4m3fn).to(torch.float64).numpy()
    n = e4m3_rne_np(vals.astype(np.float64))
    if not np.array_equal(t, n):
        bad = np.flatnonzero(t != n)[:5]
        raise AssertionError(f"torch e4m3 cast differs from RNE at {vals[bad]}: {t[bad]} vs {n[bad]}")
    out["e4m3_values_checked"] = int(vals.size)
    # the ties really go to even: 0.5 * (1 + 1.125) = 1.0625 -> 1.0 (code 0x38), 1.1875 -> 1.25 (0x3A)
    tie = torch.tensor([1.0625, 1.1875]).to(torch.float8_e4m3fn).view(torch.uint8).tolist()
    if tie != [0x38, 0x3A]:
        raise AssertionError(f"e4m3 ties: {tie}")

    # bf16: torch's cast vs RNE on the bits (random + exact midpoints and their neighbours)
    xb = (g.standard_normal(400_000) * np.exp2(g.uniform(-20, 20, 400_000))).astype(np.float32)
    xb_bits = xb.view(np.uint32)
    midb = ((xb_bits & np.uint32(0xFFFF0000)) | np.uint32(0x8000)).view(np.float32)
    xb = np.concatenate([xb, midb, np.nextafter(midb, np.float32(0)), np.nextafter(midb, np.float32(np.inf))])
    tb = torch.from_numpy(xb).to(torch.bfloat16).to(torch.float32).numpy()
    if not np.array_equal(tb, bf16_rne_np(xb)):
        raise AssertionError("torch bf16 cast differs from RNE")
    out["bf16_values_checked"] = int(xb.size)

    # pow2_ceil: exact powers of two, their float32 neighbours, random values
    p = np.exp2(np.arange(-40, 20)).astype(np.float32)
    a = np.concatenate(
        [
            p,
            np.nextafter(p, np.float32(0)),
            np.nextafter(p, np.float32(np.inf)),
            np.abs(rnd[:100_000]) + 1e-30,
        ]
    ).astype(np.float32)
    s = pow2_ceil(torch.from_numpy(a)).numpy().astype(np.float64)
    a64 = a.astype(np.float64)
    if not (np.all(s >= a64) and np.all(s / 2 < a64) and np.all(np.frexp(s)[0] == 0.5)):
        raise AssertionError("pow2_ceil is not the smallest power of two >= a")
    out["pow2_values_checked"] = int(a.size)

    # the whole tile quantizer against numpy on random tiles (scales differ by tile)
    x = torch.from_numpy(
        (
            g.standard_normal((64, 4 * TILE))
            * np.exp2(g.uniform(-8, 8, (64, 4, 1))).repeat(TILE, -1).reshape(64, -1)
        ).astype(np.float32)
    )
    deq, v, amax = qdq_tiles(x, TILE)
    xt = x.numpy().reshape(64, 4, TILE).astype(np.float64)
    amax_np = np.maximum(np.abs(xt).max(-1), np.float64(np.float32(AMAX_FLOOR)))
    q_s = (amax_np.astype(np.float32) / np.float32(E4M3_MAX)).astype(np.float64)
    s_np = np.ldexp(1.0, np.ceil(np.log2(q_s)).astype(int))
    deq_np = e4m3_rne_np(xt / s_np[..., None]) * s_np[..., None]
    if not np.array_equal(deq.numpy().astype(np.float64), deq_np.reshape(64, -1)):
        raise AssertionError("qdq_tiles differs from the numpy quantizer")

    # the boundary distances used for the margins: moving a value by 0.999 d never changes its rounding,
    # by 1.001 d towards its nearest boundary always does
    v = g.uniform(-E4M3_MAX * 0.95, E4M3_MAX * 0.95, 20_000) * np.exp2(-g.integers(0, 14, 20_000))
    d = e4m3_midpoint_dist(v)
    r0 = e4m3_rne_np(v)
    if not (
        np.array_equal(e4m3_rne_np(v + 0.999 * d), r0) and np.array_equal(e4m3_rne_np(v - 0.999 * d), r0)
    ):
        raise AssertionError("e4m3_midpoint_dist too large")
    if not np.all((e4m3_rne_np(v + 1.001 * d) != r0) | (e4m3_rne_np(v - 1.001 * d) != r0)):
        raise AssertionError("e4m3_midpoint_dist too small")
    if not (np.all(bf16_midpoint_dist(midb) == 0) and np.all(e4m3_midpoint_dist(E4M3_MID) == 0)):
        raise AssertionError("a boundary is not at distance 0")

    # Hadamard: Sylvester recursion = (-1)^popcount(i & j) / sqrt(n), orthogonal
    for n_ in (1, 2, 32, 128):
        h = hadamard(n_)
        i = np.arange(n_)
        pc = np.vectorize(lambda z: bin(z).count("1"))(i[:, None] & i[None, :])
        if not np.array_equal(h, (-1.0) ** pc / math.sqrt(n_)) or not np.allclose(
            h @ h.T, np.eye(n_), atol=1e-12
        ):
            raise AssertionError(f"Hadamard {n_}")
    return out


# ---------------------------------------------------------------------------------------------
# Recording how close each rounding came to a boundary


class Recorder:
    """The smallest distance of any rounding decision to its boundary, per kind: relative to the value
    (``min``) and relative to the largest magnitude of its row (``min_row``: tile / key / k_pe vector)."""

    KINDS = ("latent_e4m3", "latent_scale", "kpe_bf16", "index_e4m3", "index_scale")

    def __init__(self):
        self.on = False
        self.where = ""
        self.min = {k: (math.inf, "") for k in self.KINDS}
        self.min_row = {k: (math.inf, "") for k in self.KINDS}
        self.count = {k: 0 for k in self.KINDS}
        self.below = {k: 0 for k in self.KINDS}  # values closer than FLIP_WARN (relative to the value)

    def add(self, kind: str, rel: np.ndarray, rel_row: np.ndarray, layer: int, pos0: int) -> None:
        """rel, rel_row [positions, ...] of the rows one forward wrote, starting at position pos0."""
        if not self.on or rel.size == 0:
            return
        self.count[kind] += rel.size
        self.below[kind] += int((rel < FLIP_WARN).sum())
        for store, r in ((self.min, rel), (self.min_row, rel_row)):
            i = np.unravel_index(int(np.argmin(r)), r.shape)
            if r[i] < store[kind][0]:
                store[kind] = (float(r[i]), f"{self.where} layer {layer} position {pos0 + int(i[0])}")


REC = Recorder()


# ---------------------------------------------------------------------------------------------
# The patch


class KvFp8Patch:
    """Installs the FP8 read-back on every attention (``expand_kv``) and indexer (``forward``) of a model.
    ``mode`` "off" leaves HF's computation untouched; "fp8" quantizes; ``amp`` perturbs the quantizer
    inputs."""

    def __init__(self, model, model_type: str):
        self.mode = "off"
        self.amp = 0.0
        self.parts = PARTS  # which of the three read-backs apply (all for the goldens)
        self.flips = dict.fromkeys(PARTS, 0)
        self.jparts = PARTS  # which quantizer inputs get the noise
        self.calls = {"expand_kv": 0, "attention": 0, "update_indexer": 0, "indexer": 0}
        self.gap = math.inf  # indexer relative gap at the top-k cut-off (fp8 scores, float64)
        self.gap_rows = 0
        self.router_gap = math.inf  # last selected minus first unselected biased score
        self.group_gap = math.inf  # topk_group-th minus next group score
        mod = sys.modules[type(model).__module__]
        interleaved = model_type == "glm_moe_dsa"  # HF hard-codes the indexer's RoPE layout per class
        self.rope = mod.apply_rotary_pos_emb_interleave if interleaved else mod.apply_rotary_pos_emb
        # HF writes an interleaved RoPE's result de-interleaved ([rotated even dims, rotated odd dims]); the
        # engines rotate in place, so their key is HF's with the first r dims permuted: e[2i] = h[i],
        # e[2i + 1] = h[r/2 + i]. Scores do not care (q and k permuted alike), but k @ H and so its FP8
        # rounding do: the key is rotated and quantized in the engines' layout.
        r, d = model.config.qk_rope_head_dim, model.config.index_head_dim
        pairs = [j for i in range(r // 2) for j in (i, r // 2 + i)]
        self.key_perm = torch.tensor(pairs + list(range(r, d))) if interleaved else torch.arange(d)
        self.key_layout = "engine"  # "hf": quantize HF's layout instead (sensitivity only)
        self._check_layout(r, interleaved)
        for _name, m in model.named_modules():
            cls = type(m).__name__
            if cls.endswith("Attention") and hasattr(m, "expand_kv"):
                self._wrap_attention(m)
            elif cls.endswith("Indexer"):
                self._wrap_indexer(m)
            elif cls.endswith("TopkRouter"):
                m.register_forward_hook(self._router_hook)
        self.n_attn = sum(1 for m in model.modules() if hasattr(m, "_kvfp8_attn"))
        self.n_index = sum(1 for m in model.modules() if hasattr(m, "_kvfp8_index"))

    # -- MLA latent rows
    def read_back_latent(self, kv_nope: torch.Tensor, k_rot: torch.Tensor, layer: int, new: int):
        """kv_nope [B, 1, T, C], k_rot [B, 1, T, Pr] (all rows attention reads; the last ``new`` were written
        by this forward) -> the rows as read back from the cache."""
        c = jitter(kv_nope, self.amp if "latent" in self.jparts else 0.0, TILE)
        deq, v, amax = qdq_tiles(c, TILE)
        pe = jitter(k_rot, self.amp if "kpe" in self.jparts else 0.0, k_rot.shape[-1])
        pe_back = pe.to(torch.bfloat16).to(pe.dtype)
        T = kv_nope.shape[-2]
        fresh = slice(T - new, T)
        if self.amp:  # how many stored values the noise changed (rows of this forward)
            clean = qdq_tiles(kv_nope, TILE)[0]
            self.flips["latent"] += int((deq[..., fresh, :] != clean[..., fresh, :]).sum())
            clean_pe = k_rot.to(torch.bfloat16).to(k_rot.dtype)
            self.flips["kpe"] += int((pe_back[..., fresh, :] != clean_pe[..., fresh, :]).sum())
        if REC.on:  # only the rows this forward wrote (the others were recorded when they were written)
            if kv_nope.shape[0] != 1:
                raise AssertionError("batch 1 only")
            vv = v[0, 0, fresh].numpy()  # [new, tiles, TILE]
            top = (amax[0, 0, fresh] / pow2_ceil(amax[0, 0, fresh] / E4M3_MAX)).numpy()[..., None]  # amax / s
            d = e4m3_midpoint_dist(vv)
            REC.add("latent_e4m3", safe_div(d, np.abs(vv)), d / top, layer, T - new)
            ps = rel_to_pow2(amax[0, 0, fresh].numpy() / E4M3_MAX)
            REC.add("latent_scale", ps, ps, layer, T - new)
            x = pe[0, 0, fresh].numpy()  # [new, Pr]
            d = bf16_midpoint_dist(x)
            REC.add(
                "kpe_bf16",
                safe_div(d, np.abs(x)),
                safe_div(d, np.abs(x).max(-1, keepdims=True)),
                layer,
                T - new,
            )
        return (
            deq if "latent" in self.parts else kv_nope,
            pe_back if "kpe" in self.parts else k_rot,
        )

    def _wrap_attention(self, m) -> None:
        orig_fwd, orig_expand = m.forward, m.expand_kv
        state = {"new": None}

        def forward(*args, **kwargs):
            hs = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
            state["new"] = hs.shape[1]
            self.calls["attention"] += 1
            try:
                return orig_fwd(*args, **kwargs)
            finally:
                state["new"] = None

        def expand_kv(kv_nope, k_rot):
            if state["new"] is None:
                raise AssertionError("expand_kv called outside the attention forward")
            self.calls["expand_kv"] += 1
            if self.mode == "fp8":
                if kv_nope.dim() != 4 or kv_nope.shape[1] != 1 or k_rot.shape[:3] != kv_nope.shape[:3]:
                    raise AssertionError(f"unexpected latent shapes {kv_nope.shape} {k_rot.shape}")
                kv_nope, k_rot = self.read_back_latent(kv_nope, k_rot, m.layer_idx, state["new"])
            return orig_expand(kv_nope, k_rot)

        m.forward, m.expand_kv = forward, expand_kv
        m._kvfp8_attn = True

    # -- index keys
    def _check_layout(self, r: int, interleaved: bool) -> None:
        """HF's RoPE output, permuted by key_perm, is the in-place rotation the engines compute."""
        g = torch.Generator().manual_seed(0)
        x = torch.randn(1, 1, 1, r, generator=g, dtype=torch.float64)
        theta = torch.rand(1, 1, r // 2, generator=g, dtype=torch.float64) * 6.0
        cos, sin = torch.cat([theta.cos(), theta.cos()], -1), torch.cat([theta.sin(), theta.sin()], -1)
        hf, _ = self.rope(x, x, cos, sin, unsqueeze_dim=2)
        c, s_ = theta.cos()[:, :, None], theta.sin()[:, :, None]
        if interleaved:  # pairs (2i, 2i + 1)
            a, b = x[..., 0::2], x[..., 1::2]
            eng = torch.stack([a * c - b * s_, b * c + a * s_], -1).reshape(x.shape)
        else:  # pairs (i, i + r/2)
            a, b = x[..., : r // 2], x[..., r // 2 :]
            eng = torch.cat([a * c - b * s_, b * c + a * s_], -1)
        if not torch.allclose(hf[..., self.key_perm[:r]], eng, rtol=0, atol=1e-12):
            raise AssertionError("the index-key layout permutation does not match HF's RoPE")

    def engine_layout(self, x: torch.Tensor) -> torch.Tensor:
        """HF's index-key / index-query layout -> the engines' (identity for half-split RoPE)."""
        return x if self.key_layout == "hf" else x[..., self.key_perm]

    def hf_layout(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.key_layout == "hf" else x[..., torch.argsort(self.key_perm)]

    def read_back_keys(self, k: torch.Tensor, layer: int, new: int) -> tuple[torch.Tensor, torch.Tensor]:
        """k [B, T, D] (HF's layout) -> (keys for HF = deq(k_e @ H) @ H^T in HF's layout, deq(k_e @ H)),
        float32; k_e = k in the engines' layout."""
        h = torch.from_numpy(hadamard(k.shape[-1]))
        exact = (self.engine_layout(k).double() @ h).to(torch.float32)
        k_rot = jitter(exact, self.amp if "index" in self.jparts else 0.0, k.shape[-1])
        deq, v, amax = qdq_tiles(k_rot, k.shape[-1])
        T = k.shape[1]
        fresh = slice(T - new, T)
        if self.amp:
            self.flips["index"] += int((deq[:, fresh] != qdq_tiles(exact, k.shape[-1])[0][:, fresh]).sum())
        if REC.on:
            if k.shape[0] != 1:
                raise AssertionError("batch 1 only")
            vv = v[0, fresh].numpy()  # [new, 1, D]
            top = (amax[0, fresh] / pow2_ceil(amax[0, fresh] / E4M3_MAX)).numpy()[..., None]
            d = e4m3_midpoint_dist(vv)
            REC.add("index_e4m3", safe_div(d, np.abs(vv)), d / top, layer, T - new)
            ps = rel_to_pow2(amax[0, fresh].numpy() / E4M3_MAX)
            REC.add("index_scale", ps, ps, layer, T - new)
        if "index" not in self.parts:
            return k, exact
        return self.hf_layout((deq.double() @ h.T).to(torch.float32)), deq

    def _wrap_indexer(self, m) -> None:
        orig = m.forward
        sig = inspect.signature(orig)
        patch = self

        class KeyCache:
            """Stands in for past_key_values inside the indexer: update_indexer is all the indexer uses."""

            def __init__(self, real, new):
                self.real, self.new, self.deq = real, new, None

            def update_indexer(self, k, layer_idx):
                patch.calls["update_indexer"] += 1
                keys = k if self.real is None else self.real.update_indexer(k, layer_idx)
                hf_keys, self.deq = patch.read_back_keys(keys, layer_idx, self.new)
                return hf_keys

            def __getattr__(self, name):
                raise AssertionError(f"the indexer used past_key_values.{name}: HF changed, review the patch")

        def forward(*args, **kwargs):
            self.calls["indexer"] += 1
            if self.mode != "fp8":
                return orig(*args, **kwargs)
            a = sig.bind(*args, **kwargs)
            a.apply_defaults()
            hs = a.arguments["hidden_states"]
            stand_in = KeyCache(a.arguments["past_key_values"], hs.shape[1])
            a.arguments["past_key_values"] = stand_in
            out = orig(*a.args, **a.kwargs)
            if stand_in.deq is None:
                raise AssertionError("the indexer did not read its keys through update_indexer")
            self._probe(m, a.arguments, stand_in.deq, out)
            return out

        m.forward = forward
        m._kvfp8_index = True

    @torch.no_grad()
    def _probe(self, m, a: dict[str, Any], deq_rot: torch.Tensor, chosen: torch.Tensor) -> None:
        """Index scores as the engines compute them, (q @ H) . deq(k @ H), in float64; the top-k must be HF's
        and the relative gap at the cut-off is recorded."""
        hs, q_resid, (cos, sin), mask = (
            a["hidden_states"],
            a["q_resid"],
            a["position_embeddings"],
            a["attention_mask"],
        )
        bsz, seq, _ = hs.shape
        r = m.qk_rope_head_dim
        q = m.wq_b(q_resid).view(bsz, seq, m.n_heads, m.head_dim)
        dummy = torch.zeros(bsz, seq, 1, r, dtype=q.dtype)
        q_rot, _ = self.rope(q[..., :r], dummy, cos, sin, unsqueeze_dim=2)
        q = torch.cat([q_rot, q[..., r:]], -1)
        h = torch.from_numpy(hadamard(m.head_dim))
        q_h = self.engine_layout(q).double() @ h
        scores = F.relu(torch.einsum("bshd,btd->bsht", q_h, deq_rot.double())) * m.softmax_scale
        w = m.weights_proj(hs.to(m.weights_proj.weight.dtype)).float().double() * m.n_heads**-0.5
        idx = torch.einsum("bsh,bsht->bst", w, scores)
        valid = (mask if mask.dtype == torch.bool else mask > torch.finfo(mask.dtype).min / 2).expand_as(idx)
        k = m.index_topk
        for b in range(bsz):
            for s in range(seq):
                row = idx[b, s][valid[b, s]]
                if row.numel() <= k:
                    continue
                vals, order = row.sort(descending=True)
                gap = (vals[k - 1] - vals[k]).item() / max(row.abs().max().item(), 1e-30)
                self.gap = min(self.gap, gap)
                self.gap_rows += 1
                keys = torch.nonzero(valid[b, s]).squeeze(-1)
                if set(keys[order[:k]].tolist()) != set(chosen[b, s].long().tolist()):
                    raise AssertionError(f"fp8 index scores select other keys than HF at layer {m.layer_idx}")

    @torch.no_grad()
    def _router_hook(self, module, args, output) -> None:
        """The routers see hidden states the FP8 cache has changed: their cut-off gaps (as make_goldens.py
        measures them) are margins of these goldens too."""
        if self.mode != "fp8":
            return
        hs = args[0].reshape(-1, module.hidden_dim)
        sc = F.linear(hs.float(), module.weight.float()).sigmoid() + module.e_score_correction_bias
        n_g, per = module.num_group, module.num_experts // module.num_group
        grp = sc.view(-1, n_g, per).topk(2, dim=-1).values.sum(-1)
        if module.topk_group < n_g:
            gs = grp.sort(dim=-1, descending=True).values
            self.group_gap = min(
                self.group_gap, (gs[:, module.topk_group - 1] - gs[:, module.topk_group]).min().item()
            )
        keep = torch.zeros_like(grp, dtype=torch.bool)
        keep.scatter_(1, grp.topk(module.topk_group, dim=-1).indices, True)
        masked = sc.masked_fill(~keep.repeat_interleave(per, dim=1), float("-inf"))
        es = masked.sort(dim=-1, descending=True).values
        self.router_gap = min(self.router_gap, (es[:, module.top_k - 1] - es[:, module.top_k]).min().item())
        if not torch.equal(
            masked.topk(module.top_k, dim=-1).indices.sort(-1).values, output[2].sort(-1).values
        ):
            raise AssertionError("router probe disagrees with HF")


# ---------------------------------------------------------------------------------------------
# Loading the committed fixtures


def read_tensors(directory: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(directory.glob("*.safetensors")):
        with safe_open(f, "pt") as fh:
            for k in fh.keys():
                out[k] = fh.get_tensor(k)
    return out


def float_checkpoint(src: Path, dst: Path) -> str:
    """A float32 copy of a quantized fixture: FP8 weights dequantized here, INT4 ones by
    compressed-tensors."""
    conf = json.loads((src / "config.json").read_text())
    qc = conf.pop("quantization_config")
    n = conf["num_hidden_layers"]
    files = {k: v for k, v in read_tensors(src).items() if not k.startswith(f"model.layers.{n}.")}  # no MTP
    out = {}
    if qc["quant_method"] == "fp8":
        block = tuple(qc["weight_block_size"])
        for k, v in files.items():
            if k.endswith("_scale_inv"):
                continue
            out[k] = (
                fp8_dequantize(v, files[k + "_scale_inv"], block) if v.dtype == torch.float8_e4m3fn else v
            )
        how = f"FP8 {block[0]}x{block[1]} blocks dequantized"
    elif qc["quant_method"] == "compressed-tensors":
        from compressed_tensors.compressors import PackedQuantizationCompressor
        from compressed_tensors.quantization import QuantizationConfig

        (scheme,) = QuantizationConfig.model_validate(qc).config_groups.values()
        packed = {k[: -len(".weight_packed")] for k in files if k.endswith(".weight_packed")}
        parts = ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape")
        for module in packed:
            d = {p: files.pop(f"{module}.{p}") for p in parts if f"{module}.{p}" in files}
            out[f"{module}.weight"] = PackedQuantizationCompressor.decompress(d, scheme)["weight"].to(
                torch.float32
            )
        for k, v in files.items():
            out[k] = v.to(torch.float32)
        how = f"INT4 decompressed by compressed-tensors ({len(packed)} modules)"
    else:
        raise ValueError(qc["quant_method"])
    dst.mkdir(parents=True, exist_ok=True)
    save_file(
        {k: v.contiguous() for k, v in sorted(out.items())},
        str(dst / "model.safetensors"),
        metadata={"format": "pt"},
    )
    (dst / "config.json").write_text(json.dumps(conf, indent=2))
    (dst / "generation_config.json").write_text((src / "generation_config.json").read_text())
    return how


def load_fixture(name: str, tmp: Path):
    src = FIXTURES / name
    conf = json.loads((src / "config.json").read_text())
    how = "HF checkpoint"
    if "quantization_config" in conf:
        how = float_checkpoint(src, tmp / name)
        src = tmp / name
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32, attn_implementation="eager")
    model.eval()
    if model.generation_config.eos_token_id is not None:
        raise AssertionError("generation_config must have eos_token_id null")
    return model, conf["model_type"], how


# ---------------------------------------------------------------------------------------------
# Running HF


def greedy(model, prompt: np.ndarray, new: int) -> tuple[np.ndarray, np.ndarray]:
    """make_goldens.py's greedy generation (its checks included), for goldens of ``new`` tokens."""
    if new != NEW:
        raise AssertionError(f"golden.npz holds {new} greedy tokens, make_goldens.py makes {NEW}")
    return hf_greedy(model, prompt)


def rel_l2_rows(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.linalg.norm(a - b, axis=-1) / np.maximum(np.linalg.norm(b, axis=-1), 1e-30)


def margins(logits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(top1 - top2) / max(1, std) (golden.npz's greedy_min_margin) and top1 - top2, per row."""
    top2 = np.sort(logits, axis=-1)[:, -2:]
    d = top2[:, 1] - top2[:, 0]
    return d / np.maximum(1.0, logits.std(axis=-1)), d


def run_all(
    model, g: dict[str, np.ndarray], label: str, rec: Recorder, prompts: tuple[str, ...] = ("short", "long")
) -> dict[str, np.ndarray]:
    """Logits of ``prompts`` (uncached forwards), greedy generation with the cache, and the uncached
    recompute over the generated tokens; ``rec`` is told which run the patched reads belong to."""
    out = {}
    for k in prompts:
        rec.where = f"{label}/prompt_{k}"
        out[f"logits_{k}"] = full_logits(model, g[f"prompt_{k}"])
    rec.where = f"{label}/greedy (generate)"
    out["greedy_tokens"], out["greedy_logits"] = greedy(model, g["greedy_prompt"], len(g["greedy_tokens"]))
    rec.where = f"{label}/greedy (uncached recompute)"
    seq = np.concatenate([g["greedy_prompt"], out["greedy_tokens"][:-1]])
    out["recompute"] = full_logits(model, seq)[len(g["greedy_prompt"]) - 1 :]
    return out


def max_rel(
    a: dict[str, np.ndarray],
    b: dict[str, np.ndarray],
    keys: tuple[str, ...] = ("logits_short", "logits_long", "greedy_logits"),
) -> float:
    return float(max(rel_l2_rows(a[k], b[k]).max() for k in keys))


def make_one(name: str, out_root: Path, tmp: Path, log) -> dict[str, Any]:
    gold = dict(np.load(FIXTURES / name / "golden.npz"))
    model, model_type, how = load_fixture(name, tmp)
    patch = KvFp8Patch(model, model_type)
    cfg = model.config
    n_full = sum(
        1 for t in getattr(cfg, "indexer_types", None) or ["full"] * cfg.num_hidden_layers if t == "full"
    )
    if patch.n_attn != cfg.num_hidden_layers or patch.n_index != n_full:
        raise AssertionError(f"patched {patch.n_attn} attentions / {patch.n_index} indexers")

    # 1. unpatched: the load reproduces golden.npz (and the wrappers change nothing when off)
    plain = run_all(model, gold, name, REC)
    plain_rel = max_rel(plain, gold)
    if not (plain_rel <= MAX_PLAIN_REL and np.array_equal(plain["greedy_tokens"], gold["greedy_tokens"])):
        raise AssertionError(f"{name}: the loaded model does not reproduce golden.npz ({plain_rel:.3g})")

    # 2. FP8 KV cache
    patch.mode = "fp8"
    patch.calls = {k: 0 for k in patch.calls}
    REC.on = True
    fp8 = run_all(model, gold, name, REC)
    REC.on = False
    c = patch.calls
    if c["expand_kv"] != c["attention"] or c["update_indexer"] != c["indexer"] or c["indexer"] == 0:
        raise AssertionError(f"{name}: not every attention / indexer went through the patch: {c}")
    cache_rel = float(rel_l2_rows(fp8["greedy_logits"], fp8["recompute"]).max())
    if not cache_rel <= MAX_CACHE_REL:
        raise AssertionError(f"{name}: cached fp8 logits differ from the uncached forward: {cache_rel:.3g}")
    again = run_all(model, gold, name, REC)
    if any(not np.array_equal(again[k], fp8[k]) for k in fp8):
        raise AssertionError(f"{name}: the fp8 run is not deterministic")

    # 3. how far last-bit differences in the quantizer inputs move the goldens
    gap, gap_rows, router_gap, group_gap = patch.gap, patch.gap_rows, patch.router_gap, patch.group_gap
    if not (gap_rows > 0 and router_gap < math.inf and group_gap < math.inf):
        raise AssertionError("the probes saw nothing")
    jit = {}
    for amp in JITTERS:
        patch.amp, patch.flips = amp, dict.fromkeys(PARTS, 0)
        j = run_all(model, gold, name, REC)
        jit[amp] = (
            max_rel(j, fp8),
            int((j["greedy_tokens"] == fp8["greedy_tokens"]).sum()),
            dict(patch.flips),
        )
    for part in PARTS:  # the largest noise on one quantizer input only
        patch.jparts, patch.flips = (part,), dict.fromkeys(PARTS, 0)
        j = run_all(model, gold, name, REC)
        jit[part] = (
            max_rel(j, fp8),
            int((j["greedy_tokens"] == fp8["greedy_tokens"]).sum()),
            dict(patch.flips),
        )
    patch.amp, patch.jparts = 0.0, PARTS
    # informational: each read-back alone, logits_long vs golden.npz
    alone = {}
    for part in PARTS:
        patch.parts = (part,)
        alone[part] = float(rel_l2_rows(full_logits(model, gold["prompt_long"]), gold["logits_long"]).max())
    patch.parts = PARTS
    if model_type == "glm_moe_dsa":  # the index keys rotated and quantized in HF's de-interleaved layout
        patch.key_layout = "hf"
        alone["hf_key_layout"] = float(
            rel_l2_rows(full_logits(model, gold["prompt_long"]), fp8["logits_long"]).max()
        )
        patch.key_layout = "engine"
    patch.mode = "off"
    off = run_all(model, gold, name, REC)
    if any(not np.array_equal(off[k], plain[k]) for k in plain):
        raise AssertionError("switching the patch off does not restore HF")

    m_norm, m_abs = margins(fp8["greedy_logits"])
    long_norm, _ = margins(fp8["logits_long"])
    same = fp8["greedy_tokens"] == gold["greedy_tokens"]
    first_diff = int(np.argmin(same)) if not same.all() else len(same)
    comparable = min(first_diff + 1, len(same))  # rows whose context (prompt + earlier tokens) agrees
    vs = {
        k: rel_l2_rows(fp8[k], gold[k])[: comparable if k == "greedy_logits" else None]
        for k in ("logits_short", "logits_long", "greedy_logits")
    }
    arrays = {
        "prompt_short": gold["prompt_short"].astype(np.int32),
        "logits_short": fp8["logits_short"].astype(np.float32),
        "prompt_long": gold["prompt_long"].astype(np.int32),
        "logits_long": fp8["logits_long"].astype(np.float32),
        "greedy_prompt": gold["greedy_prompt"].astype(np.int32),
        "greedy_tokens": fp8["greedy_tokens"].astype(np.int32),
        "greedy_logits": fp8["greedy_logits"].astype(np.float32),
        "hf_version": np.array(transformers.__version__),
        "torch_version": np.array(torch.__version__),
        "greedy_min_margin": np.float64(m_norm.min()),
        "greedy_min_margin_abs": np.float64(m_abs.min()),
        "long_argmax_min_margin": np.float64(long_norm.min()),
        "indexer_min_rel_gap": np.float64(gap),
        "indexer_rows": np.int64(gap_rows),
        "router_min_expert_gap": np.float64(router_gap),
        "router_min_group_gap": np.float64(group_gap),
        "cache_vs_recompute_rel": np.float64(cache_rel),
    }
    for kind in Recorder.KINDS:
        arrays[f"{kind}_min_rel_dist"] = np.float64(REC.min[kind][0])
        if not kind.endswith("_scale"):
            arrays[f"{kind}_min_row_dist"] = np.float64(REC.min_row[kind][0])
            arrays[f"{kind}_n_below_1e-5"] = np.int64(REC.below[kind])
    for amp in JITTERS:
        arrays[f"jitter_{amp:.0e}_max_rel"] = np.float64(jit[amp][0])
    for k, v in vs.items():
        arrays[f"vs_golden_{k}_max_rel"] = np.float64(v.max())
        arrays[f"vs_golden_{k}_mean_rel"] = np.float64(v.mean())
    arrays["vs_golden_greedy_same_tokens"] = np.int64(same.sum())
    arrays["vs_golden_greedy_first_diff"] = np.int64(first_diff)

    directory = out_root / name
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "golden_kv_fp8.npz"
    save_npz(path, arrays)
    path.chmod(0o644)
    return {
        "name": name,
        "how": how,
        "plain_rel": plain_rel,
        "arrays": arrays,
        "where": dict(REC.min),
        "where_row": dict(REC.min_row),
        "below": dict(REC.below),
        "count": dict(REC.count),
        "jitter": jit,
        "alone": alone,
        "bytes": path.stat().st_size,
    }


def save_npz(path: Path, arrays: dict[str, np.ndarray]) -> None:
    """np.savez_compressed with fixed zip timestamps, so that a rerun rewrites byte-identical files."""
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        for key, value in arrays.items():
            buf = io.BytesIO()
            np.lib.format.write_array(buf, np.asanyarray(value), allow_pickle=False)
            info = zipfile.ZipInfo(key + ".npy", date_time=(1980, 1, 1, 0, 0, 0))
            info.external_attr = 0o644 << 16
            info.compress_type = zipfile.ZIP_DEFLATED
            zf.writestr(info, buf.getvalue())


# ---------------------------------------------------------------------------------------------
# Report / README section


def fmt(x: float) -> str:
    return "inf" if x == math.inf else f"{x:.3g}"


def prose(text: str) -> list[str]:
    """A paragraph for the README, wrapped at 105 columns (never inside a `code span`)."""
    text = re.sub(r"`[^`]*`", lambda m: m.group(0).replace(" ", "\0"), " ".join(text.split()))
    wrapped = textwrap.wrap(text, 105, break_on_hyphens=False, break_long_words=False)
    return [line.replace("\0", " ") for line in wrapped] + [""]


def readme_section(results: list[dict[str, Any]], selftest: dict[str, Any]) -> str:
    lines = [README_BEGIN, "## FP8 KV cache goldens (`golden_kv_fp8.npz`)", ""]
    lines += prose(
        f"""Made by `tests/reference/make_kv_fp8_goldens.py` (transformers {transformers.__version__}, torch
        {torch.__version__}, CPU, float32, eager; see `tests/reference/README.md`) from the committed
        checkpoints: HF with every MLA latent row and index key it reads passed through the FP8 cache formats
        of the released engines. Latent c (`kv_a_layernorm` output): tiles of 128, `amax = max(max|c|, 1e-4)`,
        `s` = the power of two at or above amax / 448, `q = e4m3fn(c / s)` (nearest even), read as
        `f32(q) * s`; k_pe (after RoPE) stored in bf16. Index key k (after LayerNorm and RoPE, in the
        engines' layout: GLM's interleaved RoPE rotates pairs in place, where HF writes them de-interleaved,
        so HF's key is permuted back first): `k @ H` (normalized Sylvester Hadamard), one such scale per key,
        e4m3; queries rotated, not quantized: score `(q H) . deq(k H)`. Every cached row is read back
        quantized, the current token's included. The FP8 / INT4 fixtures run on the same dequantized weights
        as `golden.npz`."""
    )
    lines += prose(
        """Keys: `prompt_short`, `logits_short`, `prompt_long`, `logits_long` (full forward, no cache),
        `greedy_prompt`, `greedy_tokens`, `greedy_logits` (`generate`, KV cache), same prompts and shapes as
        `golden.npz`; float64 margins `greedy_min_margin` ((top1 - top2) / max(1, std); `_abs`: top1 - top2),
        `indexer_min_rel_gap` (FP8 scores in float64, rows with more valid keys than index_topk),
        `router_min_expert_gap`, `router_min_group_gap`, `cache_vs_recompute_rel`; for each rounding kind
        (`latent_e4m3`, `index_e4m3`: c / s, kH / s to an e4m3 midpoint; `kpe_bf16`: k_pe to a bf16 midpoint;
        `latent_scale`, `index_scale`: amax / 448 to a power of two) `<kind>_min_rel_dist` (distance /
        |value|) and, for the value kinds, `<kind>_min_row_dist` (distance / max |value| of its tile, key or
        k_pe vector) and `<kind>_n_below_1e-5`; `jitter_<a>_max_rel` (below); `vs_golden_*` (last table)."""
    )
    lines += [
        "| name | greedy margin (abs) | indexer rel gap (rows) | router expert / group gap "
        "| cache vs recompute |",
        "|---|---|---|---|---|",
    ]
    for r in results:
        a = r["arrays"]
        lines.append(
            f"| {r['name']} | {fmt(a['greedy_min_margin'])} ({fmt(a['greedy_min_margin_abs'])}) | "
            f"{fmt(a['indexer_min_rel_gap'])} ({int(a['indexer_rows'])}) | "
            f"{fmt(a['router_min_expert_gap'])} / {fmt(a['router_min_group_gap'])} | "
            f"{fmt(a['cache_vs_recompute_rel'])} |"
        )
    lines += [""] + prose(
        """Closest rounding decisions, relative to the value (relative to its row's max |value|), and how many
        of all rounded values lie closer than 1e-5 (relative to the value) to their boundary:"""
    )
    lines += [
        "| name | latent e4m3 | index e4m3 | k_pe bf16 | amax/448 to 2^k: latent / index "
        "| < 1e-5: latent / index / k_pe |",
        "|---|---|---|---|---|---|",
    ]
    for r in results:
        a, b, n = r["arrays"], r["below"], r["count"]
        dist = lambda k, a=a: f"{fmt(a[f'{k}_min_rel_dist'])} ({fmt(a[f'{k}_min_row_dist'])})"
        lines.append(
            f"| {r['name']} | {dist('latent_e4m3')} | {dist('index_e4m3')} | {dist('kpe_bf16')} | "
            f"{fmt(a['latent_scale_min_rel_dist'])} / {fmt(a['index_scale_min_rel_dist'])} | "
            f"{b['latent_e4m3']} / {b['index_e4m3']} / {b['kpe_bf16']} of {n['latent_e4m3']} / "
            f"{n['index_e4m3']} / {n['kpe_bf16']} |"
        )
    lines += [""] + prose(
        """Where the closest one (relative to the value) is (run: prompt_short, prompt_long, greedy =
        `generate`, recompute = its uncached forward; layer; position from 0):"""
    )
    short = lambda w: (
        w.split("/", 1)[1]
        .replace("greedy (generate)", "greedy")
        .replace("greedy (uncached recompute)", "recompute")
    )
    for r in results:
        kinds = (("latent_e4m3", "latent"), ("index_e4m3", "index"), ("kpe_bf16", "k_pe"))
        lines.append(
            f"- {r['name']}: "
            + "; ".join(f"{lab} {fmt(r['where'][k][0])} at {short(r['where'][k][1])}" for k, lab in kinds)
        )
    lines += [""] + prose(
        """Every golden thus has rounding decisions within float32 noise of a flip, so a last-bit difference
        in the quantizer inputs can change a stored value. What that does: the logits (max rel L2 per row over
        logits_short, logits_long, greedy_logits) when every quantizer input x gets `x + a u(x) max|row|`
        (|u| <= 1, a hash of x's bits, so a cached row is perturbed the same way at every read; rows = tile /
        key / k_pe vector); the number of stored values that changed (latent / k_pe / index) at a = 1e-6; and
        a = 1e-5 on one input kind only:"""
    )
    lines += [
        "| name | a = 1e-7 | a = 1e-6 | a = 1e-5 | flips at 1e-6 | 1e-5 latent / k_pe / index only |",
        "|---|---|---|---|---|---|",
    ]
    for r in results:
        j = r["jitter"]
        f6 = j[1e-6][2]
        lines.append(
            f"| {r['name']} | {fmt(j[1e-7][0])} | {fmt(j[1e-6][0])} | {fmt(j[1e-5][0])} | "
            f"{f6['latent']} / {f6['kpe']} / {f6['index']} | "
            f"{fmt(j['latent'][0])} / {fmt(j['kpe'][0])} / {fmt(j['index'][0])} |"
        )
    lines += [""] + prose(
        """The large numbers are router and indexer top-k decisions flipping downstream of a changed value
        (their gaps, above, are ~1e-4): an implementation whose latents / index keys differ from HF's by more
        than about one float32 ulp can legitimately miss these goldens by far more than a parity tolerance."""
    )
    lines += prose(
        """How far the FP8 cache moves the logits from `golden.npz` (informational): rel L2 per row, max /
        mean; greedy rows up to the first differing token (later rows have other contexts); logits_long with
        one read-back alone (latent e4m3 / k_pe bf16 / index keys) vs `golden.npz`; and, for GLM, logits_long
        with the index keys rotated and quantized in HF's de-interleaved layout instead, vs these goldens:"""
    )
    lines += [
        "| name | logits_short | logits_long | greedy_logits | greedy tokens equal "
        "| one alone: latent / k_pe / index | HF key layout |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        a, al = r["arrays"], r["alone"]
        pair = lambda k, a=a: f"{fmt(a[f'vs_golden_{k}_max_rel'])} / {fmt(a[f'vs_golden_{k}_mean_rel'])}"
        lines.append(
            f"| {r['name']} | {pair('logits_short')} | {pair('logits_long')} | {pair('greedy_logits')} | "
            f"{int(a['vs_golden_greedy_same_tokens'])} / {len(a['greedy_tokens'])} | "
            f"{fmt(al['latent'])} / {fmt(al['kpe'])} / {fmt(al['index'])} | "
            f"{fmt(al['hf_key_layout']) if 'hf_key_layout' in al else '-'} |"
        )
    lines += [""] + prose(
        """(The random tiny models are chaotic at this scale: the 2-3 % (rel L2) that e4m3 changes the latents
        by flips router and indexer choices downstream, so these numbers do not measure FP8 accuracy on real
        weights.)"""
    )
    lines += prose(
        f"""The script first checks its quantizer against numpy: the 256 e4m3 codes decode and re-encode;
        torch's e4m3 cast equals a numpy round-to-nearest-even on {selftest["e4m3_values_checked"]} values
        (every midpoint and its float32 neighbours included) and its bf16 cast on
        {selftest["bf16_values_checked"]}; the power-of-two scale, the tile quantizer, the boundary distances,
        the Hadamard matrix (Sylvester = (-1)^popcount(i & j) / sqrt(n)) and the key-layout permutation
        (against an in-place RoPE) are checked too. Before patching, each loaded model reproduces `golden.npz`
        (rel L2 <= 1e-5, same tokens)."""
    )
    return "\n".join(lines[:-1] + [README_END]) + "\n"


def write_readme_section(
    section: str, readme: Path, begin: str = README_BEGIN, end: str = README_END
) -> None:
    """Put ``section`` (which starts with ``begin`` and ends with ``end``) in place of the README's
    section between those markers, or at its end."""
    text = readme.read_text()
    if begin in text:
        head, rest = text.split(begin, 1)
        tail = rest.split(end, 1)[1].lstrip("\n")
        text = head + section + ("\n" + tail if tail else "")
    else:
        text = text.rstrip("\n") + "\n\n" + section
    readme.write_text(text)


# ---------------------------------------------------------------------------------------------


def start_run(fixture_names: list[str]) -> argparse.Namespace:
    """The command line (``--only``, ``--out``) of a goldens script, and torch / transformers set up
    for a deterministic single-threaded CPU run (a warning if the versions are not the pinned ones)."""
    ap = argparse.ArgumentParser(description=sys.modules["__main__"].__doc__.splitlines()[0])
    ap.add_argument(
        "--only", nargs="*", help="fixture names (default: all of " + ", ".join(fixture_names) + ")"
    )
    ap.add_argument(
        "--out", type=Path, default=FIXTURES, help="where golden_kv_fp8.npz go (README only if default)"
    )
    args = ap.parse_args()
    if transformers.__version__ != "5.23.0" or not torch.__version__.startswith("2.13.0"):
        print(
            "WARNING: expected transformers 5.23.0 / torch 2.13.0, got "
            f"{transformers.__version__} / {torch.__version__}"
        )
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    return args


def log_checks(log, r: dict[str, Any], kinds: tuple[str, ...], width: int, logits: tuple[str, ...]) -> None:
    """The log lines of one fixture's checks that both KV-FP8 scripts print (this one and
    make_kv_fp8_goldens_v4.py): per row kind (``kinds``, names padded to ``width``) the nearest
    rounding boundary, the jitter runs, each read-back alone, and the ``logits`` entries and greedy
    tokens against golden.npz."""
    a = r["arrays"]
    for kind in kinds:
        v, where = r["where"][kind]
        w, where_w = r["where_row"][kind]
        log(
            f"  {kind:{width}s} min dist rel to value {fmt(v)} at {where}; {r['below'][kind]} of "
            f"{r['count'][kind]} < {FLIP_WARN}"
            + ("" if kind.endswith("_scale") else f"; rel to row max {fmt(w)} at {where_w}")
        )
    log(
        "  jitter "
        + "; ".join(
            f"{amp}: rel {fmt(v)}, {n} tokens equal, flips {f}" for amp, (v, n, f) in r["jitter"].items()
        )
    )
    log(
        "  each read-back alone, logits_long vs golden.npz: "
        + json.dumps({k: float(fmt(v)) for k, v in r["alone"].items()})
    )
    log(
        "  vs golden.npz (max / mean rel): "
        + ", ".join(
            f"{k} {fmt(a[f'vs_golden_{k}_max_rel'])} / {fmt(a[f'vs_golden_{k}_mean_rel'])}" for k in logits
        )
        + f"; greedy tokens equal {int(a['vs_golden_greedy_same_tokens'])} / "
        f"{len(a['greedy_tokens'])} (first diff {int(a['vs_golden_greedy_first_diff'])})"
    )


def run_fixtures(
    args: argparse.Namespace,
    fixture_names: list[str],
    new_recorder: Callable[[], None],
    make: Callable[..., dict[str, Any]],
    report: Callable[[Callable[[str], None], dict[str, Any]], None],
) -> tuple[list[dict[str, Any]], dict[str, Any], Callable[[str], None]]:
    """A goldens script's run: the self-test, then per fixture a fresh recorder (``new_recorder``
    sets the script's ``REC``), ``make(name, out, tmp, log)`` and ``report(log, result)`` (its log
    lines); -> (results, self-test, log)."""
    log = lambda s: print(s, flush=True)  # noqa: E731
    st = self_test()
    log(f"self-test: {json.dumps(st)}")
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.only or fixture_names:
            new_recorder()
            log(f"== {name}")
            r = make(name, args.out, Path(tmp), log)
            report(log, r)
            results.append(r)
    return results, st, log


def _new_recorder() -> None:
    global REC
    REC = Recorder()


def _report(log: Callable[[str], None], r: dict[str, Any]) -> None:
    a = r["arrays"]
    log(f"  {r['how']}; unpatched vs golden.npz {fmt(r['plain_rel'])}; {r['bytes'] / 1e3:.1f} kB")
    log(
        f"  greedy margin {fmt(a['greedy_min_margin'])} (abs {fmt(a['greedy_min_margin_abs'])})  "
        f"indexer gap {fmt(a['indexer_min_rel_gap'])} ({int(a['indexer_rows'])} rows)  router gaps "
        f"{fmt(a['router_min_expert_gap'])} / {fmt(a['router_min_group_gap'])}  "
        f"cache vs recompute {fmt(a['cache_vs_recompute_rel'])}"
    )
    log_checks(log, r, Recorder.KINDS, 12, ("logits_short", "logits_long", "greedy_logits"))


def main() -> None:
    args = start_run(FIXTURE_NAMES)
    results, st, log = run_fixtures(args, FIXTURE_NAMES, _new_recorder, make_one, _report)
    if not args.only and args.out == FIXTURES:
        write_readme_section(readme_section(results, st), FIXTURES / "README.md")
        log("README section written")


if __name__ == "__main__":
    main()
