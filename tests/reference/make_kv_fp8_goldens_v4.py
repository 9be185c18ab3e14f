#!/usr/bin/env python3
"""Goldens for DeepSeek-V4's FP8 KV cache (``golden_kv_fp8.npz`` of ``dsv4`` and ``dsv4_fp8``): HF
transformers with every cached row quantized as the released engines store it (not part of CI).

Run with the reference venv ``<venv>``: a Python 3.11 venv with torch==2.13.0 (CPU) transformers==5.23.0
compressed-tensors (README.md here sets it up):

    <venv>/bin/python tests/reference/make_kv_fp8_goldens_v4.py [--only NAME ...] [--out DIR]

Independent of jaxdsa (no JAX, nothing imported from the repository but the sibling scripts): the formats
are re-implemented in torch from their definitions (FlashMLA's V4 "MODEL1" rows, the engines' FP8 index
keys, DeepSeek's ``act_quant`` with ue8m0 scales); the roundings are the ones ``make_kv_fp8_goldens.py``
checks against numpy, imported from there.

* K = V rows (head_dim values, ``[nope | rope]``: HF's V4 RoPE rotates the trailing qk_rope_head_dim values,
  pairs (2i, 2i + 1) in place, as the engines do): the nope part in tiles of 64 (the whole nope part when it
  is narrower, as in the tiny fixtures: 24 values); per tile ``amax = max(max|x|, 1e-4)``, ``s = amax / 448``
  rounded *up* to a power of two (frexp, exact), ``q = e4m3fn(x / s)`` (nearest even), read back as
  ``f32(q) * s``; the rope part stored in bf16, read back as ``f32(bf16(rope))``. This is applied to (1) the
  sliding-window rows of every attention layer (kv after ``apply_rotary_pos_emb``; every cached token, the
  current step's rows included: the engines write, then read) and (2) the compressed entries of the CSA and
  HCA compressors (after their RoPE, before ``update_compressor_states``).
* CSA index keys (index_head_dim values, after the indexer compressor's RoPE): ``k_rot = k @ H`` (H the
  normalized Sylvester Hadamard matrix, natural order), one such scale for the whole key, e4m3; queries
  rotated by the same H, not quantized: score ``(q H) . deq(k H)`` = ``q . (deq(k H) H^T)`` (exact
  arithmetic); HF's scorer gets the keys ``deq(k H) @ H^T``.
* Not quantized: the compressors' running state (fp32 source rows in ``buffer_kv`` / ``overlap_kv``).

How HF is patched (transformers 5.23 ``deepseek_v4``): the source of ``DeepseekV4Attention.forward``,
``DeepseekV4HCACompressor.forward``, ``DeepseekV4CSACompressor.forward`` and ``DeepseekV4Indexer.forward``
gets one inserted line each (a call to this script's hook right after the kv RoPE, right before the
compressor's ``update_compressor_states``, right before the indexer's ``compressed_kv = ...``), recompiled in
the module's namespace. The rows are quantized once, when they are written: the cache (sliding window,
compressed entries, index keys) then holds the read-back rows and both the uncached forward and HF
``generate`` with V4's own cache read them (checked: the cache contents are fixed points of the quantizer;
chunked cached prefill + decode equals the uncached forward). The quantization is a per-row function, so
this equals quantizing on every read. With the hook off the patched code is HF's.

For each fixture the committed checkpoint is loaded into HF (float32, eager; ``dsv4_fp8``'s FP8 / FP4
weights decoded here with ``make_goldens_v4.py``'s reference decoders into a temporary float32 checkpoint
with release names, loaded with the HF config object built from the preset as that script does), the
plain goldens are reproduced (hook off), then with the hook on the same prompts give logits_short / _mid /
_long (full forward, no cache) and greedy generation (16 tokens, V4 cache), checked against an uncached
forward over the same tokens. Recorded margins: greedy top-1 minus top-2, the indexer's relative gap at the
top-k cut-off under the FP8 scores (float64, engine formula; HF's top-k must agree), the routers' cut-off
gap, how close any rounding decision came to flipping (value to an e4m3 midpoint, amax / 448 to a power of
two, rope value to a bf16 midpoint); then how far the logits move when every quantizer input x gets a
deterministic perturbation a u(x) max|row| (a = 1e-7, 1e-6, 1e-5; 1e-5 on each row kind alone).
Informational: how far the FP8 cache moves the logits from golden.npz, and each read-back alone.
"""

from __future__ import annotations

import inspect
import json
import math
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import torch
import transformers

# same folder: HF runs, the V4 fixtures' decoders / config / probes, and the FP8 roundings
from make_goldens import full_logits
from make_goldens_v4 import (
    FP8_BLOCK,
    MIN_GREEDY_MARGIN,
    MIN_INDEXER_REL_GAP,
    MIN_ROUTER_GAP,
    Probes,
    fp4_dequantize,
    fp8_dequantize,
    hf_config,
    load_hf,
    load_presets,
)
from make_kv_fp8_goldens import (
    E4M3_MAX,
    FLIP_WARN,
    JITTERS,
    MAX_CACHE_REL,
    MAX_PLAIN_REL,
    Recorder,
    bf16_midpoint_dist,
    e4m3_midpoint_dist,
    fmt,
    hadamard,
    jitter,
    log_checks,
    margins,
    max_rel,
    pow2_ceil,
    prose,
    qdq_tiles,
    read_tensors,
    rel_l2_rows,
    rel_to_pow2,
    run_all,
    run_fixtures,
    safe_div,
    save_npz,
    start_run,
    write_readme_section,
)
from safetensors.torch import save_file
from transformers.models.deepseek_v4 import modeling_deepseek_v4 as hf_v4

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures"

FIXTURE_NAMES = ["dsv4", "dsv4_fp8"]  # dsv4_sharded: same format as dsv4, other weights; not made

NOPE_TILE = 64  # nope values per scale (MODEL1: 448 = 7 x 64)
PARTS = ("window", "compressed", "index")
PROMPTS = ("short", "mid", "long")
LOGITS = ("logits_short", "logits_mid", "logits_long", "greedy_logits")
README_BEGIN = "<!-- kv-fp8 goldens v4: begin (written by tests/reference/make_kv_fp8_goldens_v4.py) -->"
README_END = "<!-- kv-fp8 goldens v4: end -->"


# ---------------------------------------------------------------------------------------------
# Recording how close each rounding came to a boundary


class RecorderV4(Recorder):
    """make_kv_fp8_goldens.Recorder with V4's row kinds; ``add`` names positions or compressed entries."""

    KINDS = (
        "window_e4m3",
        "window_scale",
        "window_bf16",
        "compressed_e4m3",
        "compressed_scale",
        "compressed_bf16",
        "index_e4m3",
        "index_scale",
    )

    def add(self, kind, rel, rel_row, layer, pos0, unit="position"):  # noqa: D102
        if not self.on or rel.size == 0:
            return
        self.count[kind] += rel.size
        self.below[kind] += int((rel < FLIP_WARN).sum())
        for store, r in ((self.min, rel), (self.min_row, rel_row)):
            i = np.unravel_index(int(np.argmin(r)), r.shape)
            if r[i] < store[kind][0]:
                store[kind] = (float(r[i]), f"{self.where} layer {layer} {unit} {pos0 + int(i[0])}")


REC = RecorderV4()


# ---------------------------------------------------------------------------------------------
# The patch: one hook call inserted into four of HF's forwards

# (class, anchor in its forward's source, line inserted, "after" / "before" the anchor); each anchor must
# occur exactly once
EDITS = (
    (
        "DeepseekV4Attention",
        "        kv = apply_rotary_pos_emb(kv, cos, sin)\n",
        "        kv = _kvfp8_hook('window', self, kv, self.layer_idx, position_ids, None)\n",
        "after",
    ),
    (
        "DeepseekV4HCACompressor",
        "        if cache_layer is not None:\n"
        '            compressed = cache_layer.update_compressor_states("compressor", compressed)\n',
        "        compressed = _kvfp8_hook('compressed', self, compressed, layer_idx, first_window_position, "
        "None)\n",
        "before",
    ),
    (
        "DeepseekV4CSACompressor",
        "        if cache_layer is not None:\n"
        '            compressed = cache_layer.update_compressor_states("compressor", compressed)\n',
        "        compressed = _kvfp8_hook('compressed', self, compressed, layer_idx, first_window_position, "
        "None)\n",
        "before",
    ),
    (
        "DeepseekV4Indexer",
        "        compressed_kv = (\n"
        '            compressed if cache_layer is None else cache_layer.update_compressor_states("indexer", '
        "compressed)\n",
        "        compressed = _kvfp8_hook('index', self, compressed, layer_idx, first_window_position, "
        "cache_layer)\n",
        "before",
    ),
)
ACTIVE: list[Any] = [None]  # the KvFp8PatchV4 the hook dispatches to


def _kvfp8_hook(kind, module, x, layer, where, cache_layer):
    """Called by the patched forwards: the rows as the cache stores them (x itself when no patch is on)."""
    patch = ACTIVE[0]
    return x if patch is None else patch.hook(kind, module, x, layer, where, cache_layer)


FORWARDS: dict[str, tuple[Any, Any]] = {}  # class name -> (HF's forward, patched forward)


def install_source_patch(on: bool = True) -> None:
    """Recompile the four forwards with the hook line inserted (once per process); ``on`` False puts HF's
    own functions back."""
    if not FORWARDS:
        for cls_name, anchor, line, side in EDITS:
            cls = getattr(hf_v4, cls_name)
            src = inspect.getsource(cls.forward)
            if not src.lstrip().startswith("def forward(") or "super(" in src or "__class__" in src:
                raise AssertionError(f"{cls_name}.forward: decorated or uses super(): review the patch")
            if src.count(anchor) != 1:
                raise AssertionError(
                    f"{cls_name}.forward: anchor found {src.count(anchor)} times: HF changed"
                )
            src = src.replace(anchor, anchor + line if side == "after" else line + anchor)
            ns = dict(vars(hf_v4))
            ns["_kvfp8_hook"] = _kvfp8_hook
            exec(compile(textwrap.dedent(src), f"<kvfp8 {cls_name}.forward>", "exec"), ns)
            fn = ns["forward"]
            fn.__qualname__ = f"{cls_name}.forward"
            FORWARDS[cls_name] = (cls.forward, fn)
    for cls_name, (orig, patched) in FORWARDS.items():
        getattr(hf_v4, cls_name).forward = patched if on else orig


def nope_tile(nope: int) -> int:
    """Values per scale of the nope part: 64, or the whole part when it is narrower."""
    tile = NOPE_TILE if nope >= NOPE_TILE else nope
    if nope % tile:
        raise ValueError(f"nope width {nope} is not a multiple of {NOPE_TILE}")
    return tile


def read_back_rows_clean(x: torch.Tensor, rope: int, tile: int) -> torch.Tensor:
    """x [..., D] float32 -> the MODEL1 read-back (no recording, no noise): the quantizer itself."""
    return torch.cat([qdq_tiles(x[..., :-rope], tile)[0], x[..., -rope:].to(torch.bfloat16).float()], -1)


class KvFp8PatchV4:
    """The FP8 read-back of every window row, compressed entry and index key (through ``_kvfp8_hook``), and
    the indexer probe. ``mode`` "off" leaves HF's computation untouched; "fp8" quantizes; ``amp`` perturbs
    the quantizer inputs; ``parts`` says which read-backs apply, ``jparts`` which inputs get the noise."""

    def __init__(self, model):
        cfg = model.config
        self.mode = "off"
        self.amp = 0.0
        self.parts = PARTS
        self.jparts = PARTS
        self.flips = dict.fromkeys(PARTS, 0)
        self.flip_where: list[str] = []  # where the noise changed a stored value
        self.probing = False  # the indexer probe records gaps / asserts HF's choice (golden run only)
        self.gap, self.gap_rows, self.gap_where = math.inf, 0, ""
        self.rope = cfg.qk_rope_head_dim
        self.head_dim = cfg.head_dim
        self.tile = nope_tile(self.head_dim - self.rope)
        self.h = torch.from_numpy(hadamard(cfg.index_head_dim))
        self._check_layout(model)
        self.calls = dict.fromkeys(PARTS, 0)  # hook calls
        self.forwards = dict.fromkeys(PARTS, 0)  # module forwards that must have called the hook
        self.n_modules = dict.fromkeys(PARTS, 0)
        for m in model.modules():
            if isinstance(m, hf_v4.DeepseekV4Attention):
                part = "window"
            elif isinstance(m, (hf_v4.DeepseekV4HCACompressor, hf_v4.DeepseekV4CSACompressor)):
                part = "compressed"
            elif isinstance(m, hf_v4.DeepseekV4Indexer):
                part = "index"
                m.scorer.register_forward_pre_hook(lambda mod, args, idx=m: self._scorer_probe(idx, args))
                m.register_forward_hook(self._indexer_probe)
            else:
                continue
            self.n_modules[part] += 1
            m.register_forward_pre_hook(lambda mod, args, part=part: self._count(part))
        install_source_patch()
        ACTIVE[0] = self

    def _count(self, part: str) -> None:
        self.forwards[part] += 1

    def _check_layout(self, model) -> None:
        """HF's V4 RoPE (apply_rotary_pos_emb) rotates the trailing ``rope`` values as consecutive pairs
        (2i, 2i + 1) in place and leaves the leading nope values alone: the engines' layout, so rows and
        index keys are quantized as HF holds them. The RoPE tables have rope / 2 entries."""
        g = torch.Generator().manual_seed(0)
        pos = torch.arange(5)[None]
        for layer_type in ("main", "compress"):
            cos, sin = model.model.rotary_emb(torch.zeros(1, dtype=torch.float32), pos, layer_type=layer_type)
            if cos.shape[-1] * 2 != self.rope:
                raise AssertionError(
                    f"{layer_type} RoPE has {cos.shape[-1]} frequencies, rope is {self.rope}"
                )
            x = torch.randn(1, 5, 1, self.head_dim, generator=g)
            hf = hf_v4.apply_rotary_pos_emb(x, cos, sin, unsqueeze_dim=2)
            z = torch.view_as_complex(x[..., -self.rope :].double().reshape(1, 5, 1, -1, 2).contiguous())
            w = torch.complex(cos.double(), sin.double())  # attention_scaling included
            eng = torch.view_as_real(z * w[:, :, None]).reshape(1, 5, 1, self.rope)
            if not torch.equal(hf[..., : -self.rope], x[..., : -self.rope]) or not torch.allclose(
                hf[..., -self.rope :].double(), eng, rtol=0, atol=1e-5
            ):
                raise AssertionError("HF's V4 RoPE is not the in-place pair rotation of the trailing values")

    # -- the hook
    def hook(self, kind, module, x, layer, where, cache_layer):
        self.calls[kind] += 1
        if self.mode != "fp8":
            return x
        if kind == "window":  # x [B, 1, S, D]; where = position_ids
            if x.dim() != 4 or x.shape[1] != 1 or x.shape[-1] != self.head_dim:
                raise AssertionError(f"unexpected window rows {tuple(x.shape)}")
            return self.read_back_rows(x, "window", layer, int(where[0, 0]), "position")
        if kind == "compressed":  # x [B, n, D]; where = first_window_position (a token position)
            if x.dim() != 3 or x.shape[-1] != self.head_dim:
                raise AssertionError(f"unexpected compressed entries {tuple(x.shape)}")
            return self.read_back_rows(x, "compressed", layer, where // module.compress_rate, "entry")
        if kind == "index":
            module._kvfp8_layer = layer
            return self.read_back_keys(module, x, layer, where // module.compress_rate, cache_layer)
        raise AssertionError(kind)

    def _flip_where(self, changed: torch.Tensor, what: str, pos0: int) -> None:
        if changed.numel() == 0:
            return
        rows = changed.reshape(-1, changed.shape[-2], changed.shape[-1]).any(-1).any(0)
        for i in torch.nonzero(rows).flatten().tolist():
            self.flip_where.append(f"{REC.where.split('/', 1)[1]} {what} {pos0 + i}")

    def read_back_rows(self, x: torch.Tensor, part: str, layer: int, pos0: int, unit: str) -> torch.Tensor:
        """x float32 [..., n, D] (the rows this forward writes) -> the rows as read back from the cache."""
        if part not in self.parts or x.shape[-2] == 0:
            return x
        if x.dtype != torch.float32:
            raise AssertionError(f"{part} rows are {x.dtype}")
        amp = self.amp if part in self.jparts else 0.0
        nope = jitter(x[..., : -self.rope].contiguous(), amp, self.tile)
        deq, v, amax = qdq_tiles(nope, self.tile)
        rope = jitter(x[..., -self.rope :].contiguous(), amp, self.rope)
        rope_back = rope.to(torch.bfloat16).to(torch.float32)
        out = torch.cat([deq, rope_back], -1)
        if self.amp:  # how many stored values the noise changed
            changed = out != read_back_rows_clean(x, self.rope, self.tile)
            self.flips[part] += int(changed.sum())
            self._flip_where(changed, f"{part} layer {layer} {unit}", pos0)
        if REC.on:
            if x.shape[0] != 1:
                raise AssertionError("batch 1 only")
            n = x.shape[-2]
            vv = v.reshape(n, -1, self.tile).numpy()  # [rows, tiles, tile]
            a = amax.reshape(n, -1)
            top = (a / pow2_ceil(a / E4M3_MAX)).numpy()[..., None]  # amax / s
            d = e4m3_midpoint_dist(vv)
            REC.add(f"{part}_e4m3", safe_div(d, np.abs(vv)), d / top, layer, pos0, unit)
            ps = rel_to_pow2(a.numpy() / E4M3_MAX)
            REC.add(f"{part}_scale", ps, ps, layer, pos0, unit)
            r = rope.reshape(n, self.rope).numpy()
            d = bf16_midpoint_dist(r)
            rel_row = safe_div(d, np.abs(r).max(-1, keepdims=True))
            REC.add(f"{part}_bf16", safe_div(d, np.abs(r)), rel_row, layer, pos0, unit)
        return out

    def read_back_keys(self, m, k: torch.Tensor, layer: int, entry0: int, cache_layer) -> torch.Tensor:
        """k float32 [B, n, Di] (the index keys this forward writes) -> the keys for HF's scorer,
        ``deq(k H) @ H^T``; keeps the exact ``deq(k H)`` of every key the scorer will see for the probe."""
        if k.dim() != 3 or k.shape[-1] != self.h.shape[0] or k.dtype != torch.float32:
            raise AssertionError(f"unexpected index keys {tuple(k.shape)} {k.dtype}")
        exact = (k.double() @ self.h).to(torch.float32)
        if "index" in self.parts:
            k_rot = jitter(exact, self.amp if "index" in self.jparts else 0.0, k.shape[-1])
            deq, v, amax = qdq_tiles(k_rot, k.shape[-1])
            if self.amp:
                changed = deq != qdq_tiles(exact, k.shape[-1])[0]
                self.flips["index"] += int(changed.sum())
                self._flip_where(changed, f"index layer {layer} entry", entry0)
            if REC.on and k.shape[1]:
                if k.shape[0] != 1:
                    raise AssertionError("batch 1 only")
                vv = v[0].numpy()  # [n, 1, Di]
                top = (amax[0] / pow2_ceil(amax[0] / E4M3_MAX)).numpy()[..., None]
                d = e4m3_midpoint_dist(vv)
                REC.add("index_e4m3", safe_div(d, np.abs(vv)), d / top, layer, entry0, "entry")
                ps = rel_to_pow2(amax[0].numpy() / E4M3_MAX)
                REC.add("index_scale", ps, ps, layer, entry0, "entry")
            out = (deq.double() @ self.h.T).to(torch.float32)
        else:
            deq, out = exact, k
        rot = deq
        if cache_layer is not None:  # the cache's keys: those of earlier forwards, then these
            prev = getattr(cache_layer, "_kvfp8_index_rot", None)
            rot = deq if prev is None else torch.cat([prev, deq], 1)
            cache_layer._kvfp8_index_rot = rot
        m._kvfp8_rot = rot
        return out

    # -- the indexer probe: FP8 scores as the engines compute them
    @torch.no_grad()
    def _scorer_probe(self, m, args) -> None:
        """Index scores (q H) . deq(k H) in float64 from the scorer's inputs; HF's keys must be exactly the
        read-back keys (so the cache holds them)."""
        if self.mode != "fp8":
            return
        q, keys, hs = args  # [B, S, H, Di] after RoPE, [B, T, Di], [B, S, hidden]
        rot = m._kvfp8_rot
        if rot.shape != keys.shape:
            raise AssertionError(f"indexer keys {tuple(keys.shape)} vs read-back {tuple(rot.shape)}")
        if "index" in self.parts and not torch.equal(keys, (rot.double() @ self.h.T).to(torch.float32)):
            raise AssertionError("HF's index keys are not the read-back keys")
        sc = m.scorer
        q_h = q.double() @ self.h
        scores = torch.relu(torch.einsum("bshd,btd->bsht", q_h, rot.double())) * sc.softmax_scale
        w = sc.weights_proj(hs).float().double() * sc.weights_scaling
        m._kvfp8_scores = torch.einsum("bsh,bsht->bst", w, scores)

    @torch.no_grad()
    def _indexer_probe(self, m, args, output) -> None:
        if self.mode != "fp8" or not self.probing:
            return
        idx, positions = m._kvfp8_scores, args[2]
        threshold = (positions + 1) // m.compress_rate  # entries j < threshold are complete
        k = m.index_topk
        for b in range(idx.shape[0]):
            for s in range(idx.shape[1]):
                n_valid = int(threshold[b, s])
                chosen = {int(i) for i in output[b, s].tolist() if i >= 0}
                if n_valid <= k:
                    if chosen != set(range(n_valid)):
                        raise AssertionError("indexer selected a subset although every entry fits")
                    continue
                row = idx[b, s, :n_valid]
                vals, order = row.sort(descending=True)
                gap = (vals[k - 1] - vals[k]).item() / max(row.abs().max().item(), 1e-30)
                if gap < self.gap:
                    self.gap, self.gap_where = (
                        gap,
                        f"{REC.where} layer {m._kvfp8_layer} position {int(positions[b, s])}",
                    )
                self.gap_rows += 1
                if set(order[:k].tolist()) != chosen:
                    raise AssertionError(
                        "fp8 index scores (float64, engine formula) select other keys than HF"
                    )


# ---------------------------------------------------------------------------------------------
# Loading the committed fixtures


def float_checkpoint_v4(src: Path, dst: Path, presets) -> str:
    """A float32 copy of dsv4_fp8 (release names): FP8 weights (e4m3 + e8m0 ``.scale`` per block) and FP4
    routed experts (packed e2m1 + e8m0 per 32 inputs) decoded by make_goldens_v4.py's reference decoders;
    the MTP block dropped (HF has none)."""
    conf = json.loads((src / "config.json").read_text())
    qc = conf["quantization_config"]
    block = tuple(qc["weight_block_size"])
    if (qc["quant_method"], qc["fmt"], qc["scale_fmt"], block) != ("fp8", "e4m3", "ue8m0", FP8_BLOCK):
        raise ValueError(f"unexpected quantization_config {qc}")
    if conf.get("expert_dtype") != "fp4":
        raise ValueError("expected expert_dtype fp4")
    # the HF config object describes the same model as this release config.json
    release = presets.release_form(presets.V4_TINY_PRESETS["dsv4"])
    rest = {k: v for k, v in conf.items() if k not in ("quantization_config", "expert_dtype", "torch_dtype")}
    if rest != json.loads(json.dumps(release)):
        raise AssertionError(f"{src.name}/config.json is not the dsv4 preset's release form")
    files = {k: v for k, v in read_tensors(src).items() if not k.startswith("mtp.")}
    out, used, n8, n4 = {}, set(), 0, 0
    for k, v in files.items():
        if k.endswith(".scale"):
            continue
        if v.dtype in (torch.float8_e4m3fn, torch.int8):
            scale_name = k[: -len("weight")] + "scale"
            scale = files[scale_name]
            if scale.dtype != torch.float8_e8m0fnu:
                raise AssertionError(f"{scale_name} is {scale.dtype}")
            used.add(scale_name)
            if v.dtype == torch.float8_e4m3fn:
                out[k], n8 = fp8_dequantize(v, scale, block), n8 + 1
            else:
                out[k], n4 = fp4_dequantize(v, scale), n4 + 1
        else:
            out[k] = v.to(torch.float32) if v.is_floating_point() else v
    left = {k for k in files if k.endswith(".scale")} - used
    if left:
        raise AssertionError(f"scales without a quantized weight: {sorted(left)}")
    dst.mkdir(parents=True, exist_ok=True)
    tensors = {k: t.contiguous() for k, t in sorted(out.items())}
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    (dst / "generation_config.json").write_text((src / "generation_config.json").read_text())
    return f"FP8 {block[0]}x{block[1]} e4m3 + ue8m0 ({n8}) and FP4 e2m1 experts ({n4}) decoded"


def load_fixture(name: str, tmp: Path):
    src = FIXTURES / name
    conf = json.loads((src / "config.json").read_text())
    kwargs: dict[str, Any] = {}
    how = "HF checkpoint"
    if "quantization_config" in conf:
        presets = load_presets()
        how = float_checkpoint_v4(src, tmp / name, presets)
        src = tmp / name
        kwargs["config"] = hf_config(presets)  # HF cannot read this release config (HCA ratio 8)
    model = load_hf(src, f"{name}: HF load", **kwargs)
    model.eval()
    if model.generation_config.eos_token_id is not None:
        raise AssertionError("generation_config must have eos_token_id null")
    return model, how


# ---------------------------------------------------------------------------------------------
# Running HF


@torch.no_grad()
def check_cache(model, patch: KvFp8PatchV4, prompt: np.ndarray) -> dict[str, Any]:
    """Cached chunked prefill (29 tokens, then 8) and 3 single-token steps over ``prompt[:40]`` give the
    rows of the uncached forward, and what V4's cache then holds is read-back data: window rows and
    compressed entries are fixed points of the quantizer (it is idempotent), index keys are exactly
    deq(k H) H^T of the kept deq(k H), which are e4m3 values times a power of two; the compressors' source
    state is not quantized."""
    ids = torch.tensor(prompt[None, :40], dtype=torch.long)
    out = model(input_ids=ids[:, :29], use_cache=True)
    pkv, rows = out.past_key_values, [out.logits[0]]
    for a, b in ((29, 37), (37, 38), (38, 39), (39, 40)):
        out = model(input_ids=ids[:, a:b], past_key_values=pkv, use_cache=True)
        rows.append(out.logits[0])
    chunked = torch.cat(rows).float().numpy()
    rel = float(rel_l2_rows(chunked, full_logits(model, prompt[:40])).max())
    if not rel <= MAX_CACHE_REL:
        raise AssertionError(f"chunked cached prefill differs from the uncached forward: {rel:.3g}")
    seen = {"window": 0, "compressed": 0, "index": 0, "state_rows_not_fixed": 0}
    for layer in pkv.layers:
        keys = layer.keys
        if not torch.equal(read_back_rows_clean(keys, patch.rope, patch.tile), keys):
            raise AssertionError("a cached window row is not a read-back row")
        seen["window"] += keys.shape[-2]
        if not isinstance(layer, hf_v4.DeepseekV4HCACache):
            continue
        comp = layer.compressed_kv["compressor"]
        if not torch.equal(read_back_rows_clean(comp, patch.rope, patch.tile), comp):
            raise AssertionError("a cached compressed entry is not a read-back row")
        seen["compressed"] += comp.shape[1]
        if isinstance(layer, hf_v4.DeepseekV4CSACache):
            rot, keys = layer._kvfp8_index_rot, layer.compressed_kv["indexer"]
            if not torch.equal(keys, (rot.double() @ patch.h.T).to(torch.float32)):
                raise AssertionError("cached index keys are not deq(k H) H^T")
            if not torch.equal(qdq_tiles(rot, rot.shape[-1])[0], rot):
                raise AssertionError("kept deq(k H) is not a quantized key")
            seen["index"] += keys.shape[1]
            state = layer.overlap_kv["compressor"]  # [B, ratio, head_dim] source rows
            fixed = read_back_rows_clean(state, patch.rope, patch.tile) == state
            seen["state_rows_not_fixed"] += int((~fixed.all(-1)).sum())
    if seen["state_rows_not_fixed"] == 0:
        raise AssertionError("the compressor's overlap state looks quantized")
    return {"chunked_vs_uncached_rel": rel, **seen}


def make_one(name: str, out_root: Path, tmp: Path, log) -> dict[str, Any]:
    gold = dict(np.load(FIXTURES / name / "golden.npz"))
    model, how = load_fixture(name, tmp)
    cfg = model.config
    patch = KvFp8PatchV4(model)
    n_comp = sum(t != "sliding_attention" for t in cfg.layer_types)
    n_csa = sum(t == "compressed_sparse_attention" for t in cfg.layer_types)
    expect = {"window": cfg.num_hidden_layers, "compressed": n_comp, "index": n_csa}
    if patch.n_modules != expect:
        raise AssertionError(f"patched modules {patch.n_modules}, expected {expect}")

    # 1. hook off: the patched source is HF's computation (bit for bit), and the load reproduces golden.npz
    install_source_patch(False)
    unpatched = run_all(model, gold, name, REC, PROMPTS)
    install_source_patch(True)
    patch.calls, patch.forwards = dict.fromkeys(PARTS, 0), dict.fromkeys(PARTS, 0)
    plain = run_all(model, gold, name, REC, PROMPTS)
    if any(not np.array_equal(plain[k], unpatched[k]) for k in plain):
        raise AssertionError(f"{name}: the patched forwards (hook off) differ from HF's")
    plain_rel = max_rel(plain, gold, LOGITS)
    if not (plain_rel <= MAX_PLAIN_REL and np.array_equal(plain["greedy_tokens"], gold["greedy_tokens"])):
        raise AssertionError(
            f"{name}: the patched model (off) does not reproduce golden.npz ({plain_rel:.3g})"
        )
    if patch.calls != patch.forwards or 0 in patch.calls.values():
        raise AssertionError(f"{name}: hook calls {patch.calls} vs module forwards {patch.forwards}")

    # 2. FP8 KV cache
    patch.mode = "fp8"
    patch.calls, patch.forwards = dict.fromkeys(PARTS, 0), dict.fromkeys(PARTS, 0)
    probes = Probes(model, cfg)  # router gap (and HF's own float32 index scores)
    REC.on, patch.probing = True, True
    fp8 = run_all(model, gold, name, REC, PROMPTS)
    REC.on, patch.probing = False, False
    probes.remove()
    if patch.calls != patch.forwards:
        raise AssertionError(f"{name}: hook calls {patch.calls} vs module forwards {patch.forwards}")
    cache_rel = float(rel_l2_rows(fp8["greedy_logits"], fp8["recompute"]).max())
    if not cache_rel <= MAX_CACHE_REL:
        raise AssertionError(f"{name}: cached fp8 logits differ from the uncached forward: {cache_rel:.3g}")
    again = run_all(model, gold, name, REC, PROMPTS)
    if any(not np.array_equal(again[k], fp8[k]) for k in fp8):
        raise AssertionError(f"{name}: the fp8 run is not deterministic")
    cache = check_cache(model, patch, gold["prompt_long"])
    gap, gap_rows, gap_where = patch.gap, patch.gap_rows, patch.gap_where
    if not (gap_rows > 0 and probes.router_rows > 0 and probes.indexer_rows == gap_rows):
        raise AssertionError(
            f"the probes saw nothing ({gap_rows}, {probes.router_rows}, {probes.indexer_rows})"
        )

    # 3. how far last-bit differences in the quantizer inputs move the goldens
    jit = {}
    moved = {k: np.zeros(len(fp8[k])) for k in LOGITS}  # per row, max over a <= 1e-6
    for amp in JITTERS:
        patch.amp, patch.flips, patch.flip_where = amp, dict.fromkeys(PARTS, 0), []
        j = run_all(model, gold, name, REC, PROMPTS)
        if amp <= 1e-6:
            moved = {k: np.maximum(moved[k], rel_l2_rows(j[k], fp8[k])) for k in LOGITS}
        jit[amp] = (
            max_rel(j, fp8, LOGITS),
            int((j["greedy_tokens"] == fp8["greedy_tokens"]).sum()),
            dict(patch.flips),
        )
        if amp == min(JITTERS):
            flip_where = list(patch.flip_where)
    for part in PARTS:  # the largest noise on one quantizer input only
        patch.jparts, patch.flips = (part,), dict.fromkeys(PARTS, 0)
        j = run_all(model, gold, name, REC, PROMPTS)
        jit[part] = (
            max_rel(j, fp8, LOGITS),
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
    patch.mode = "off"
    off = run_all(model, gold, name, REC, PROMPTS)
    if any(not np.array_equal(off[k], plain[k]) for k in plain):
        raise AssertionError("switching the patch off does not restore HF")

    m_norm, m_abs = margins(fp8["greedy_logits"])
    long_norm, _ = margins(fp8["logits_long"])
    same = fp8["greedy_tokens"] == gold["greedy_tokens"]
    first_diff = int(np.argmin(same)) if not same.all() else len(same)
    comparable = min(first_diff + 1, len(same))  # rows whose context (prompt + earlier tokens) agrees
    vs = {k: rel_l2_rows(fp8[k], gold[k])[: comparable if k == "greedy_logits" else None] for k in LOGITS}
    arrays: dict[str, Any] = {}
    for k in PROMPTS:
        arrays[f"prompt_{k}"] = gold[f"prompt_{k}"].astype(np.int32)
        arrays[f"logits_{k}"] = fp8[f"logits_{k}"].astype(np.float32)
    arrays |= {
        "greedy_prompt": gold["greedy_prompt"].astype(np.int32),
        "greedy_tokens": fp8["greedy_tokens"].astype(np.int32),
        "greedy_logits": fp8["greedy_logits"].astype(np.float32),
        "hf_version": np.array(transformers.__version__),
        "torch_version": np.array(torch.__version__),
        "greedy_min_margin": np.float64(m_norm.min()),
        "greedy_min_margin_abs": np.float64(m_abs.min()),
        "long_argmax_min_margin": np.float64(long_norm.min()),
        "indexer_min_rel_gap": np.float64(gap),
        "indexer_min_rel_gap_hf": np.float64(probes.indexer_min_rel_gap),
        "indexer_rows": np.int64(gap_rows),
        "router_min_gap": np.float64(probes.router_min_gap),
        "cache_vs_recompute_rel": np.float64(cache_rel),
        "chunked_vs_uncached_rel": np.float64(cache["chunked_vs_uncached_rel"]),
    }
    for kind in RecorderV4.KINDS:
        arrays[f"{kind}_min_rel_dist"] = np.float64(REC.min[kind][0])
        if not kind.endswith("_scale"):
            arrays[f"{kind}_min_row_dist"] = np.float64(REC.min_row[kind][0])
            arrays[f"{kind}_n_below_1e-5"] = np.int64(REC.below[kind])
    for amp in JITTERS:
        arrays[f"jitter_{amp:.0e}_max_rel"] = np.float64(jit[amp][0])
    for k in LOGITS:
        arrays[f"ulp_sensitivity_{k}"] = moved[k].astype(np.float32)
    for k, v in vs.items():
        arrays[f"vs_golden_{k}_max_rel"] = np.float64(v.max())
        arrays[f"vs_golden_{k}_mean_rel"] = np.float64(v.mean())
    arrays["vs_golden_greedy_same_tokens"] = np.int64(same.sum())
    arrays["vs_golden_greedy_first_diff"] = np.int64(first_diff)

    warnings = []
    if not arrays["greedy_min_margin"] >= MIN_GREEDY_MARGIN:
        warnings.append(f"greedy margin {fmt(arrays['greedy_min_margin'])} < {MIN_GREEDY_MARGIN}")
    if not gap >= MIN_INDEXER_REL_GAP:
        warnings.append(f"indexer gap {fmt(gap)} < {MIN_INDEXER_REL_GAP}")
    if not probes.router_min_gap >= MIN_ROUTER_GAP:
        warnings.append(f"router gap {fmt(probes.router_min_gap)} < {MIN_ROUTER_GAP}")

    directory = out_root / name
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "golden_kv_fp8.npz"
    save_npz(path, arrays)
    path.chmod(0o644)
    return {
        "name": name,
        "how": how,
        "plain_rel": plain_rel,
        "plain_by_key": {k: float(rel_l2_rows(plain[k], gold[k]).max()) for k in LOGITS},
        "arrays": arrays,
        "where": dict(REC.min),
        "where_row": dict(REC.min_row),
        "below": dict(REC.below),
        "count": dict(REC.count),
        "jitter": jit,
        "gap_where": gap_where,
        "flip_where": flip_where,
        "alone": alone,
        "cache": cache,
        "warnings": warnings,
        "tile": patch.tile,
        "rope": patch.rope,
        "bytes": path.stat().st_size,
    }


# ---------------------------------------------------------------------------------------------
# README section


def readme_section(results: list[dict[str, Any]], selftest: dict[str, Any]) -> str:
    plain = "; ".join(
        f"{r['name']} " + " / ".join(fmt(r["plain_by_key"][k]) for k in LOGITS) for r in results
    )

    def short(w: str) -> str:
        return (
            w.split("/", 1)[1]
            .replace("greedy (generate)", "greedy")
            .replace("greedy (uncached recompute)", "recompute")
        )

    lines = [README_BEGIN, "## FP8 KV cache goldens (`golden_kv_fp8.npz`)", ""]
    tiles = sorted({r["tile"] for r in results})
    lines += prose(
        f"""Made by `tests/reference/make_kv_fp8_goldens_v4.py` (transformers {transformers.__version__},
        torch {torch.__version__}, CPU, float32, eager; see `tests/reference/README.md`) from the committed
        checkpoints (`dsv4_fp8`: FP8 / FP4 weights decoded as `golden.npz` used them): HF with every row V4's
        cache holds written in the released engines' FP8 formats (FlashMLA "MODEL1", docs/models.md §5.3)
        and read back. A K = V row `[nope | rope]` (RoPE on the trailing {results[0]["rope"]}
        values, pairs rotated in place as the engines do): nope in tiles of 64 (here the whole nope part,
        {", ".join(map(str, tiles))} values, is one tile), `amax = max(max|x|, 1e-4)`, `s` = the power of two
        at or above amax / 448, `q = e4m3fn(x / s)` (nearest even), read as `f32(q) * s`; rope in bf16. Such
        rows are the sliding-window rows of every layer (after RoPE; the current token's included) and the
        compressed entries of the CSA and HCA compressors (after their RoPE). CSA index keys (after RoPE):
        `k @ H` (normalized Sylvester Hadamard), one such scale per key, e4m3; queries rotated, not
        quantized: score `(q H) . deq(k H)`. The compressors' fp32 source state is not quantized. Rows are
        quantized when written, so HF's cache holds the read-back rows (checked: fixed points of the
        quantizer; chunked cached prefill + decode = uncached forward)."""
    )
    lines += prose(
        """Keys: `prompt_{short,mid,long}`, `logits_{short,mid,long}` (full forward, no cache),
        `greedy_prompt`, `greedy_tokens`, `greedy_logits` (`generate`, V4 cache, 16 tokens), same prompts
        and shapes as `golden.npz`; float64 margins `greedy_min_margin` ((top1 - top2) / max(1, std);
        `_abs`: top1 - top2), `long_argmax_min_margin`, `indexer_min_rel_gap` (FP8 scores in float64, engine
        formula, rows with more complete entries than index_topk; `_hf`: HF's float32 scores),
        `router_min_gap`, `cache_vs_recompute_rel`, `chunked_vs_uncached_rel`; for each rounding kind
        (`window_`, `compressed_`: `e4m3` x / s to an e4m3 midpoint, `bf16` rope values to a bf16 midpoint,
        `scale` amax / 448 to a power of two; `index_e4m3`, `index_scale` likewise for kH)
        `<kind>_min_rel_dist` (distance / |value|) and, for the value kinds, `<kind>_min_row_dist`
        (distance / max |value| of its tile, key or rope part) and `<kind>_n_below_1e-5`;
        `jitter_<a>_max_rel` (below); `vs_golden_*` (last table)."""
    )
    lines += [
        "| name | greedy margin (abs) | indexer rel gap fp8 f64 / HF f32 (rows) | router gap "
        "| cache vs recompute | chunked prefill |",
        "|---|---|---|---|---|---|",
    ]
    for r in results:
        a = r["arrays"]
        lines.append(
            f"| {r['name']} | {fmt(a['greedy_min_margin'])} ({fmt(a['greedy_min_margin_abs'])}) | "
            f"{fmt(a['indexer_min_rel_gap'])} / {fmt(a['indexer_min_rel_gap_hf'])} "
            f"({int(a['indexer_rows'])}) | "
            f"{fmt(a['router_min_gap'])} | {fmt(a['cache_vs_recompute_rel'])} | "
            f"{fmt(a['chunked_vs_uncached_rel'])} |"
        )
    warn = [f"{r['name']}: " + "; ".join(r["warnings"]) for r in results if r["warnings"]]
    where = "; ".join(f"{r['name']} at {short(r['gap_where'])}" for r in results)
    lines += [""] + prose(
        f"""Below the thresholds `make_goldens_v4.py` picks seeds by (greedy {MIN_GREEDY_MARGIN}, indexer
        {MIN_INDEXER_REL_GAP}, router {MIN_ROUTER_GAP}): {"; ".join(warn) if warn else "none"}. The smallest
        indexer gap is at (run, layer, query position): {where}."""
    )
    lines += prose(
        """Closest rounding decisions, relative to the value (relative to its row's max |value|), and how many
        of all rounded values lie closer than 1e-5 (relative to the value) to their boundary:"""
    )
    lines += [
        "| name | window e4m3 / bf16 | compressed e4m3 / bf16 | index e4m3 "
        "| amax/448 to 2^k: window / compressed / index "
        "| < 1e-5: window e4m3 / bf16, compressed e4m3 / bf16, index |",
        "|---|---|---|---|---|---|",
    ]
    for r in results:
        a, b, n = r["arrays"], r["below"], r["count"]
        dist = lambda k, a=a: f"{fmt(a[f'{k}_min_rel_dist'])} ({fmt(a[f'{k}_min_row_dist'])})"  # noqa: E731
        cnt = lambda k, b=b, n=n: f"{b[k]} of {n[k]}"  # noqa: E731
        lines.append(
            f"| {r['name']} | {dist('window_e4m3')} / {dist('window_bf16')} | "
            f"{dist('compressed_e4m3')} / {dist('compressed_bf16')} | {dist('index_e4m3')} | "
            f"{fmt(a['window_scale_min_rel_dist'])} / {fmt(a['compressed_scale_min_rel_dist'])} / "
            f"{fmt(a['index_scale_min_rel_dist'])} | {cnt('window_e4m3')} / {cnt('window_bf16')}, "
            f"{cnt('compressed_e4m3')} / {cnt('compressed_bf16')}, {cnt('index_e4m3')} |"
        )
    lines += [""] + prose(
        """Where the closest one (relative to the value) is (run: prompt_short / _mid / _long, greedy =
        `generate`, recompute = its uncached forward; layer; token position or compressed entry, from 0):"""
    )

    kinds = (
        ("window_e4m3", "window e4m3"),
        ("window_bf16", "window bf16"),
        ("compressed_e4m3", "compressed e4m3"),
        ("compressed_bf16", "compressed bf16"),
        ("index_e4m3", "index"),
    )
    for r in results:
        lines.append(
            f"- {r['name']}: "
            + "; ".join(f"{lab} {fmt(r['where'][k][0])} at {short(r['where'][k][1])}" for k, lab in kinds)
        )
    lines += [""] + prose(
        """What a last-bit difference in the quantizer inputs can do: the logits (max rel L2 per row over
        logits_short / _mid / _long and greedy_logits) when every quantizer input x gets `x + a u(x) max|row|`
        (|u| <= 1, a hash of x's bits; rows = nope tile / rope part / index key; greedy tokens still equal, of
        16, in brackets); the number of stored values that changed (window / compressed / index) at a = 1e-7
        and 1e-6; how many rows of logits_short / _mid / _long / greedy_logits moved by more than 1e-4 at a =
        1e-7 or 1e-6 (per row: `ulp_sensitivity_<key>`, the larger of the two moves); and a = 1e-5 on one row
        kind only:"""
    )
    lines += [
        "| name | a = 1e-7 | a = 1e-6 | a = 1e-5 | flips at 1e-7; 1e-6 | rows > 1e-4 at a <= 1e-6 "
        "| 1e-5 window / compressed / index only |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        j, a = r["jitter"], r["arrays"]
        cell = lambda key, j=j: f"{fmt(j[key][0])} ({j[key][1]})"  # noqa: E731
        flips = lambda f: f"{f['window']} / {f['compressed']} / {f['index']}"  # noqa: E731
        rows = " / ".join(
            f"{int((a[f'ulp_sensitivity_{k}'] > 1e-4).sum())} of {len(a[f'ulp_sensitivity_{k}'])}"
            for k in LOGITS
        )
        lines.append(
            f"| {r['name']} | {cell(1e-7)} | {cell(1e-6)} | {cell(1e-5)} | {flips(j[1e-7][2])}; "
            f"{flips(j[1e-6][2])} | {rows} | {cell('window')} / {cell('compressed')} / {cell('index')} |"
        )
    lines += [""] + prose(
        f"Stored values the noise changed at a = {min(JITTERS)} (run, row kind, layer, row):"
    )
    for r in results:
        lines.append(f"- {r['name']}: " + ("; ".join(r["flip_where"]) or "none"))
    lines += [""] + prose(
        """A flipped e4m3 value changes by one e4m3 step (1/16 to 1/8 of itself), which moves the rows
        computed after it by ~1e-4 to 1e-3, enough to flip further values and, where a gap is small, router or
        indexer choices: one flip spreads to every later position (a bf16 flip, 2^-8 of a rope value, much
        less). An implementation whose rows differ from HF's by about one float32 ulp before quantization can
        therefore miss these goldens by more than a parity tolerance on the rows where `ulp_sensitivity_*`
        exceeds that tolerance."""
    )
    lines += prose(
        """How far the FP8 cache moves the logits from `golden.npz` (informational): rel L2 per row, max /
        mean; greedy rows up to the first differing token (later rows have other contexts); and logits_long
        with one read-back alone (window rows / compressed entries / index keys) vs `golden.npz`:"""
    )
    lines += [
        "| name | logits_short | logits_mid | logits_long | greedy_logits | greedy tokens equal "
        "| one alone: window / compressed / index |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        a, al = r["arrays"], r["alone"]
        pair = lambda k, a=a: (  # noqa: E731
            f"{fmt(a[f'vs_golden_{k}_max_rel'])} / {fmt(a[f'vs_golden_{k}_mean_rel'])}"
        )
        lines.append(
            f"| {r['name']} | {pair('logits_short')} | {pair('logits_mid')} | {pair('logits_long')} | "
            f"{pair('greedy_logits')} | "
            f"{int(a['vs_golden_greedy_same_tokens'])} / {len(a['greedy_tokens'])} | "
            f"{fmt(al['window'])} / {fmt(al['compressed'])} / {fmt(al['index'])} |"
        )
    lines += [""] + prose(
        """(The random tiny models are chaotic at this scale: e4m3's few-percent change of a row flips router
        and indexer choices downstream, so these numbers do not measure FP8 accuracy on real weights.)"""
    )
    lines += prose(
        f"""The script first runs `make_kv_fp8_goldens.py`'s self-test of the roundings against numpy (256
        e4m3 codes; torch's e4m3 cast = round-to-nearest-even on {selftest["e4m3_values_checked"]} values,
        its bf16 cast on {selftest["bf16_values_checked"]}; power-of-two scale, tile quantizer, boundary
        distances, Hadamard matrix) and checks HF's V4 RoPE against an in-place pair rotation of the
        trailing values. With the hook off, the patched forwards give HF's own logits bit for bit, and the
        loaded models reproduce `golden.npz` (max rel L2 of logits_short / _mid / _long / greedy_logits:
        {plain}; same tokens)."""
    )
    return "\n".join(lines[:-1] + [README_END]) + "\n"


# ---------------------------------------------------------------------------------------------


def _new_recorder() -> None:
    global REC
    REC = RecorderV4()


def _report(log, r: dict[str, Any]) -> None:
    a = r["arrays"]
    log(f"  {r['how']}; patch off vs golden.npz {fmt(r['plain_rel'])}; {r['bytes'] / 1e3:.1f} kB")
    log(
        f"  greedy margin {fmt(a['greedy_min_margin'])} (abs {fmt(a['greedy_min_margin_abs'])})  "
        f"indexer gap {fmt(a['indexer_min_rel_gap'])} (HF f32 {fmt(a['indexer_min_rel_gap_hf'])}, "
        f"{int(a['indexer_rows'])} rows)  router gap {fmt(a['router_min_gap'])}  "
        f"cache vs recompute {fmt(a['cache_vs_recompute_rel'])}"
    )
    log(f"  indexer gap at {r['gap_where']}; flipped at a = {min(JITTERS)}: {r['flip_where']}")
    log(f"  cache check {json.dumps(r['cache'])}")
    log(
        "  rows moved > 1e-4 by a <= 1e-6: "
        + ", ".join(f"{k} {np.flatnonzero(a[f'ulp_sensitivity_{k}'] > 1e-4).tolist()}" for k in LOGITS)
    )
    for w in r["warnings"]:
        log(f"  WARNING {w}")
    log_checks(log, r, RecorderV4.KINDS, 16, LOGITS)


def main() -> None:
    args = start_run(FIXTURE_NAMES)
    results, st, log = run_fixtures(args, FIXTURE_NAMES, _new_recorder, make_one, _report)
    if not args.only and args.out == FIXTURES:
        write_readme_section(
            readme_section(results, st), FIXTURES / "README_dsv4.md", README_BEGIN, README_END
        )
        log("README section written")


if __name__ == "__main__":
    main()
