#!/usr/bin/env python3
"""Make the DeepSeek-V4 Hugging Face golden fixtures under ``tests/fixtures/dsv4*/`` (not part of CI).

Run with the reference venv ``<venv>``: a Python 3.11 venv with torch==2.13.0 (CPU) transformers==5.23.0
compressed-tensors (README.md here sets it up):

    <venv>/bin/python tests/reference/make_goldens_v4.py [--only NAME ...] [--out DIR]

For every fixture this script

1. builds ``DeepseekV4ForCausalLM`` (eager, float32) from the tiny HF-form preset in
   ``jaxdsa/checkpoints/tiny/presets.py`` (read by path: no JAX here) and randomizes every
   parameter, including those HF initializes to 0 / 1 (sinks, ``ape``, HC base and scale, norm
   weights, router bias), and draws ``tid2eid`` as distinct random experts per token;
2. runs HF's uncached forward on prompts shorter than the window, longer than it, and crossing many
   compression boundaries, and HF ``generate`` (greedy, V4's own cache, 16 tokens);
3. checks that nothing sits on a tie (greedy margins, the indexer's top-k cut-off, the router's
   expert cut-off, recomputed from each module's inputs in forward hooks), that fp32 agrees with
   fp64, that cached generation equals an uncached recompute and that every prompt prefix gives the
   same logits (causality); a seed failing any check is skipped;
4. computes MTP goldens with a torch oracle: HF's own decoder-layer and HC-head modules wired as
   DeepSeek's reference ``MTPBlock`` (HF has no MTP);
5. writes the checkpoint in one of three layouts (HF-saved names in one file; release names over
   several shards with the release-form config.json; release names with FP8 e4m3 + ue8m0 ``.scale``
   and FP4 e2m1 routed experts), reloads it into HF and checks that it gives the same logits.
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import math
import re
import shutil
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
import transformers
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, DeepseekV4Config, GenerationConfig
from transformers.masking_utils import create_sliding_window_causal_mask
from transformers.models.deepseek_v4 import modeling_deepseek_v4 as hf_v4

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_goldens import full_logits, greedy, greedy_margins, rel_l2_rows, save_npz  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures"

# ---------------------------------------------------------------------------------------------
# Settings

PROMPT_LENGTHS = {"short": 6, "mid": 21, "long": 61}  # window 8; CSA ratio 4; HCA ratio 8
GREEDY_PROMPT = 19
NEW = 16  # make_goldens.greedy generates this many tokens
MAX_ATTEMPTS = 40

GAIN = 1.0  # Linear ~ N(0, GAIN^2 / fan_in)
LM_GAIN = 2.5  # lm_head gain: logits with a std of a few units, far from uniform
HC_BASE_STD = 0.5
BIAS_STD = 0.1  # router correction bias ~ N(0, BIAS_STD^2)

MIN_GREEDY_MARGIN = 1e-2  # (top1 - top2) / max(1, std(logits)) at every generate step
MIN_INDEXER_REL_GAP = 1e-4  # (s_k - s_{k+1}) / max |valid scores of the row|
MIN_ROUTER_GAP = 1e-5  # on biased sqrt-softplus scores
MAX_FP64_REL = 1e-5
MAX_CACHE_REL = 1e-5

FP8_BLOCK = (32, 32)
FP4_BLOCK = 32
QUANT_CONFIG = {
    "activation_scheme": "dynamic",
    "fmt": "e4m3",
    "quant_method": "fp8",
    "scale_fmt": "ue8m0",
    "weight_block_size": list(FP8_BLOCK),
}
# Release-name suffixes stored as FP8 in DeepSeek's V4 checkpoints (docs/models.md §4.4); routed
# experts are FP4.
FP8_SUFFIXES = (
    "attn.wq_a.weight",
    "attn.wq_b.weight",
    "attn.wkv.weight",
    "attn.wo_a.weight",
    "attn.wo_b.weight",
    "attn.indexer.wq_b.weight",
    "shared_experts.w1.weight",
    "shared_experts.w2.weight",
    "shared_experts.w3.weight",
    "e_proj.weight",
    "h_proj.weight",
)

FIXTURE_SPECS: list[dict[str, Any]] = [
    {
        "name": "dsv4",
        "seed": 7000,
        "layout": "hf",
        "about": "HF-form config.json and the names HF 5.23's save_pretrained writes, one file; MTP as "
        "release-named `mtp.0.*`.",
    },
    {
        "name": "dsv4_sharded",
        "seed": 8000,
        "layout": "release",
        "shards": 4,
        "about": "Release names (`embed.weight`, `layers.N.attn.*`, `layers.N.ffn.*`, `hc_*`, `head.weight`, "
        "`mtp.0.*`) over 4 shards + index, release-form config.json (`compress_ratios`, "
        "`num_hash_layers`, `rope_scaling`, `qk_rope_head_dim`).",
    },
    {
        "name": "dsv4_fp8",
        "seed": 9000,
        "layout": "release",
        "quantized": True,
        "about": "Release names and config with `quantization_config` (fp8 e4m3, ue8m0, 32x32 blocks) and "
        "`expert_dtype: fp4`: FP8 weights + F8_E8M0 `.scale`, routed experts packed e2m1 (I8 [out, in/2], "
        "low nibble = even column) + F8_E8M0 `.scale` per 32 inputs; goldens on the dequantized weights.",
    },
]

# ---------------------------------------------------------------------------------------------
# Presets and names


def load_presets():
    """jaxdsa/checkpoints/tiny/presets.py (stdlib only), without importing jaxdsa."""
    path = ROOT / "jaxdsa" / "checkpoints" / "tiny" / "presets.py"
    spec = importlib.util.spec_from_file_location("_dsv4_presets", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    sys.dont_write_bytecode = True
    spec.loader.exec_module(mod)
    return mod


# Per-layer HF module names -> release names, written out from docs/models.md §4.4 (and checked below by
# HF's own loader, which converts release names back through its conversion mapping).
LAYER_RENAMES = [
    ("self_attn.q_a_proj.", "attn.wq_a."),
    ("self_attn.q_a_norm.", "attn.q_norm."),
    ("self_attn.q_b_proj.", "attn.wq_b."),
    ("self_attn.kv_proj.", "attn.wkv."),
    ("self_attn.kv_norm.", "attn.kv_norm."),
    ("self_attn.o_a_proj.", "attn.wo_a."),
    ("self_attn.o_b_proj.", "attn.wo_b."),
    ("self_attn.sinks", "attn.attn_sink"),
    ("self_attn.compressor.indexer.kv_proj.", "attn.indexer.compressor.wkv."),
    ("self_attn.compressor.indexer.gate_proj.", "attn.indexer.compressor.wgate."),
    ("self_attn.compressor.indexer.position_bias", "attn.indexer.compressor.ape"),
    ("self_attn.compressor.indexer.kv_norm.", "attn.indexer.compressor.norm."),
    ("self_attn.compressor.indexer.q_b_proj.", "attn.indexer.wq_b."),
    ("self_attn.compressor.indexer.scorer.weights_proj.", "attn.indexer.weights_proj."),
    ("self_attn.compressor.kv_proj.", "attn.compressor.wkv."),
    ("self_attn.compressor.gate_proj.", "attn.compressor.wgate."),
    ("self_attn.compressor.position_bias", "attn.compressor.ape"),
    ("self_attn.compressor.kv_norm.", "attn.compressor.norm."),
    ("input_layernorm.", "attn_norm."),
    ("post_attention_layernorm.", "ffn_norm."),
    ("attn_hc.fn", "hc_attn_fn"),
    ("attn_hc.base", "hc_attn_base"),
    ("attn_hc.scale", "hc_attn_scale"),
    ("ffn_hc.fn", "hc_ffn_fn"),
    ("ffn_hc.base", "hc_ffn_base"),
    ("ffn_hc.scale", "hc_ffn_scale"),
    ("mlp.gate.e_score_correction_bias", "ffn.gate.bias"),
    ("mlp.gate.", "ffn.gate."),
    ("mlp.shared_experts.gate_proj.", "ffn.shared_experts.w1."),
    ("mlp.shared_experts.up_proj.", "ffn.shared_experts.w3."),
    ("mlp.shared_experts.down_proj.", "ffn.shared_experts.w2."),
]
TOP_RENAMES = {
    "model.embed_tokens.weight": "embed.weight",
    "lm_head.weight": "head.weight",
    "model.norm.weight": "norm.weight",
    "model.hc_head.hc_fn": "hc_head_fn",
    "model.hc_head.hc_base": "hc_head_base",
    "model.hc_head.hc_scale": "hc_head_scale",
}


def rename_layer(suffix: str, *, to_release: bool) -> str:
    for hf, rel in LAYER_RENAMES:
        a, b = (hf, rel) if to_release else (rel, hf)
        if suffix.startswith(a):
            return b + suffix[len(a) :]
    raise KeyError(suffix)


def release_state(model) -> dict[str, torch.Tensor]:
    """The model's tensors under release names, fused experts split per expert (w1 = gate, w3 = up)."""
    out = {}
    state = dict(model.state_dict())
    for name, t in state.items():
        if name in TOP_RENAMES:
            out[TOP_RENAMES[name]] = t
            continue
        m = re.match(r"model\.layers\.(\d+)\.(.*)", name)
        if m is None:
            raise KeyError(name)
        layer, suffix = m.groups()
        p = f"layers.{layer}."
        if suffix == "mlp.experts.gate_up_proj":
            inter = t.shape[1] // 2
            for e in range(t.shape[0]):
                out[f"{p}ffn.experts.{e}.w1.weight"] = t[e, :inter]
                out[f"{p}ffn.experts.{e}.w3.weight"] = t[e, inter:]
        elif suffix == "mlp.experts.down_proj":
            for e in range(t.shape[0]):
                out[f"{p}ffn.experts.{e}.w2.weight"] = t[e]
        else:
            out[p + rename_layer(suffix, to_release=True)] = t
    return {k: v.contiguous() for k, v in out.items()}


def stored_fp32(release_name: str) -> bool:
    """Tensors V4 checkpoints keep in float32 (the rest is bf16 when not quantized)."""
    leaf = release_name.split(".")[-1]
    return (
        leaf in ("attn_sink", "ape", "bias") or leaf.startswith("hc_") or release_name.startswith("hc_head_")
    )


# ---------------------------------------------------------------------------------------------
# Weights


def bf16_exact(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16).to(torch.float32)


def init_value(name: str, shape: tuple[int, ...], g: torch.Generator) -> torch.Tensor:
    """Random value for an HF parameter, by name; float32, bf16-exact unless V4 stores it in fp32."""
    randn = lambda: torch.randn(shape, generator=g, dtype=torch.float64)  # noqa: E731
    leaf = name.split(".")[-1]
    if name.endswith(("_hc.fn", "hc_head.hc_fn")):
        return (randn() / math.sqrt(shape[-1])).float()  # mix ~ N(0, 1) on the RMS-normalized streams
    if name.endswith(("_hc.base", "hc_head.hc_base")):
        return (HC_BASE_STD * randn()).float()
    if name.endswith(("_hc.scale", "hc_head.hc_scale")):
        return (0.5 + torch.rand(shape, generator=g, dtype=torch.float64)).float()
    if leaf in ("sinks", "position_bias"):
        return randn().float()
    if name == "model.embed_tokens.weight":
        return bf16_exact(randn().float())
    if "norm" in name.split(".")[-2]:
        return bf16_exact((1.0 + 0.1 * randn()).float())
    if name == "lm_head.weight":
        return bf16_exact((LM_GAIN * randn() / math.sqrt(shape[-1])).float())
    if len(shape) in (2, 3):  # Linear [out, in]; fused experts [E, out, in]
        return bf16_exact((GAIN * randn() / math.sqrt(shape[-1])).float())
    raise ValueError(f"no init rule for {name} {shape}")


@torch.no_grad()
def randomize(model, cfg, g: torch.Generator) -> None:
    for name, p in model.named_parameters():
        p.copy_(init_value(name, tuple(p.shape), g))
    for name, b in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            b.copy_((BIAS_STD * torch.randn(b.shape, generator=g, dtype=torch.float64)).float())
        elif name.endswith("tid2eid"):  # distinct experts per token (HF's zeros send all to expert 0)
            rows = [
                torch.randperm(cfg.n_routed_experts, generator=g)[: b.shape[1]] for _ in range(b.shape[0])
            ]
            b.copy_(torch.stack(rows))


def mtp_release_tensors(model, cfg, g: torch.Generator) -> dict[str, torch.Tensor]:
    """Random MTP block ``mtp.0.*``: a sliding-window, score-routed block like layer 0 plus e_proj, h_proj,
    enorm, hnorm, norm and its own HC head (release names; HF ignores them)."""
    shapes = {}
    for name, t in release_state(model).items():
        if name.startswith("layers.0."):
            shapes[name[len("layers.0.") :]] = tuple(t.shape)
    shapes.pop("ffn.gate.tid2eid")
    d, hc = cfg.hidden_size, cfg.hc_mult
    shapes |= {
        "ffn.gate.bias": (cfg.n_routed_experts,),
        "e_proj.weight": (d, d),
        "h_proj.weight": (d, d),
        "enorm.weight": (d,),
        "hnorm.weight": (d,),
        "norm.weight": (d,),
        "hc_head_fn": (hc, hc * d),
        "hc_head_base": (hc,),
        "hc_head_scale": (1,),
    }
    out = {}
    for suffix in sorted(shapes):
        if suffix == "ffn.gate.bias":
            value = (BIAS_STD * torch.randn(shapes[suffix], generator=g, dtype=torch.float64)).float()
        else:
            hf_like = {"hc_head_fn": "x.hc_head.hc_fn", "hc_head_base": "x.hc_head.hc_base"}.get(suffix)
            hf_like = hf_like or {"hc_head_scale": "x.hc_head.hc_scale"}.get(suffix)
            if hf_like is None and suffix.startswith(("e_proj", "h_proj")):
                hf_like = f"x.{suffix}"
            if hf_like is None and suffix.endswith("norm.weight"):
                hf_like = f"x.{suffix.replace('norm.weight', 'norm')}.weight"
            if hf_like is None and re.match(r"ffn\.experts\.\d+\.w[123]\.weight", suffix):
                hf_like = "x.experts.linear.weight"
            hf_like = hf_like or "x." + rename_layer(suffix, to_release=False)
            value = init_value(hf_like, shapes[suffix], g)
        out[f"mtp.0.{suffix}"] = value.contiguous()
    return out


# ---------------------------------------------------------------------------------------------
# FP8 (ue8m0 blocks) and FP4 (e2m1, ue8m0 per 32 inputs)


def pow2_ceil(x: torch.Tensor) -> torch.Tensor:
    """Smallest power of two >= x (x > 0), exactly."""
    mant, expo = torch.frexp(x)
    expo = torch.where(mant == 0.5, expo - 1, expo)
    return torch.ldexp(torch.ones_like(x), expo)


def vary_blocks(w: torch.Tensor, block: tuple[int, int], g: torch.Generator) -> torch.Tensor:
    """Scale each block by 2^u, u ~ U(-1.5, 1.5): block scales then differ inside a tensor."""
    b0, b1 = block
    rows, cols = -(-w.shape[0] // b0), -(-w.shape[1] // b1)
    u = torch.rand(rows, cols, generator=g, dtype=torch.float64) * 3.0 - 1.5
    f = torch.exp2(u).repeat_interleave(b0, 0).repeat_interleave(b1, 1)[: w.shape[0], : w.shape[1]]
    return (w.double() * f).float()


def fp8_quantize(w: torch.Tensor, block=FP8_BLOCK):
    """(e4m3 [out, in], e8m0 scale [ceil(out/b0), ceil(in/b1)], dequantized float32)."""
    b0, b1 = block
    out, inn = w.shape
    rows, cols = -(-out // b0), -(-inn // b1)
    padded = torch.zeros(rows * b0, cols * b1, dtype=torch.float64)
    padded[:out, :inn] = w.double()
    amax = padded.abs().view(rows, b0, cols, b1).amax(dim=(1, 3)).clamp_min(1e-30)
    scale = pow2_ceil(amax / 448.0).float()
    full = scale.repeat_interleave(b0, 0).repeat_interleave(b1, 1)[:out, :inn]
    q = (w / full).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    return q, scale.to(torch.float8_e8m0fnu), q.float() * full


E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def fp4_quantize(w: torch.Tensor, block=FP4_BLOCK):
    """(packed int8 [out, in/2] (low nibble = even column), e8m0 scale [out, in/32], dequantized)."""
    out, inn = w.shape
    groups = w.double().view(out, inn // block, block)
    amax = groups.abs().amax(-1).clamp_min(6 * 2.0**-126)
    scale = pow2_ceil(amax / 6.0)
    x = (groups / scale[..., None]).clamp(-6.0, 6.0)
    # nearest e2m1 magnitude (ties toward zero; the goldens use whatever the stored codes decode to)
    mag = torch.argmin((x.abs()[..., None] - E2M1.double()).abs(), dim=-1)
    codes = (mag + 8 * (x < 0)).to(torch.uint8).view(out, inn)
    deq = (E2M1[mag].double() * torch.sign(x) * scale[..., None]).view(out, inn).float()
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).view(torch.int8)
    return packed, scale.float().to(torch.float8_e8m0fnu), deq


def fp4_dequantize(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Independent reference decoder of the stored FP4 tensors."""
    b = packed.view(torch.uint8).long()
    codes = torch.stack([b & 0xF, b >> 4], dim=-1).flatten(-2)
    val = E2M1[codes & 7] * torch.where(codes >= 8, -1.0, 1.0)
    return val * scale.float().repeat_interleave(FP4_BLOCK, dim=1)


def fp8_dequantize(q: torch.Tensor, scale: torch.Tensor, block=FP8_BLOCK) -> torch.Tensor:
    i = torch.arange(q.shape[0]) // block[0]
    j = torch.arange(q.shape[1]) // block[1]
    return q.float() * scale.float()[i[:, None], j[None, :]]


@torch.no_grad()
def quantize_model(model, mtp: dict[str, torch.Tensor], g: torch.Generator):
    """Replace quantizable weights by their FP8 / FP4 round trip; return the stored release tensors."""
    stored: dict[str, tuple[str, torch.Tensor, torch.Tensor]] = {}
    params = dict(model.named_parameters())
    for name, p in params.items():
        m = re.match(r"model\.layers\.(\d+)\.(.*)", name)
        if m is None:
            continue
        layer, suffix = m.groups()
        if suffix == "mlp.experts.gate_up_proj":
            inter = p.shape[1] // 2
            for e in range(p.shape[0]):
                for part, rows in (("w1", slice(0, inter)), ("w3", slice(inter, 2 * inter))):
                    q, s, deq = fp4_quantize(p[e, rows])
                    p[e, rows] = deq
                    stored[f"layers.{layer}.ffn.experts.{e}.{part}.weight"] = ("fp4", q, s)
        elif suffix == "mlp.experts.down_proj":
            for e in range(p.shape[0]):
                q, s, deq = fp4_quantize(p[e])
                p[e] = deq
                stored[f"layers.{layer}.ffn.experts.{e}.w2.weight"] = ("fp4", q, s)
        else:
            release = f"layers.{layer}." + rename_layer(suffix, to_release=True)
            if release.endswith(FP8_SUFFIXES):
                q, s, deq = fp8_quantize(vary_blocks(p, FP8_BLOCK, g))
                p.copy_(deq)
                stored[release] = ("fp8", q, s)
    for name in list(mtp):
        if re.search(r"\.experts\.\d+\.w[123]\.weight$", name):
            q, s, mtp[name] = fp4_quantize(mtp[name])
            stored[name] = ("fp4", q, s)
        elif name.endswith(FP8_SUFFIXES):
            q, s, mtp[name] = fp8_quantize(vary_blocks(mtp[name], FP8_BLOCK, g))
            stored[name] = ("fp8", q, s)
    return stored


# ---------------------------------------------------------------------------------------------
# Tie probes


class Probes:
    """Smallest cut-off gaps of every indexer and score-routed router, recomputed in forward hooks."""

    def __init__(self, model, cfg):
        self.k = cfg.index_topk
        self.handles = []
        self.indexer_min_rel_gap, self.indexer_rows = math.inf, 0
        self.router_min_gap, self.router_rows = math.inf, 0
        self._scores = None
        for m in model.modules():
            if isinstance(m, hf_v4.DeepseekV4IndexerScorer):
                self.handles.append(m.register_forward_hook(self._scorer_hook))
            elif isinstance(m, hf_v4.DeepseekV4Indexer):
                self.handles.append(m.register_forward_hook(self._indexer_hook))
            elif isinstance(m, hf_v4.DeepseekV4TopKRouter):
                self.handles.append(m.register_forward_hook(self._router_hook))

    def remove(self):
        for h in self.handles:
            h.remove()

    def _scorer_hook(self, module, args, output):
        self._scores = output.detach().double()

    @torch.no_grad()
    def _indexer_hook(self, module, args, output):
        positions = args[2]
        scores, self._scores = self._scores, None
        threshold = (positions + 1) // module.compress_rate  # entries j < threshold are complete
        for b in range(scores.shape[0]):
            for s in range(scores.shape[1]):
                n_valid = int(threshold[b, s])
                row = scores[b, s, :n_valid]
                chosen = set(int(i) for i in output[b, s].tolist() if i >= 0)
                if n_valid <= self.k:
                    if chosen != set(range(n_valid)):
                        raise AssertionError("indexer selected a subset although every entry fits")
                    continue
                vals, order = row.sort(descending=True)
                gap = (vals[self.k - 1] - vals[self.k]).item() / max(row.abs().max().item(), 1e-30)
                self.indexer_min_rel_gap = min(self.indexer_min_rel_gap, gap)
                self.indexer_rows += 1
                if set(order[: self.k].tolist()) != chosen:
                    raise AssertionError(f"indexer probe disagrees with HF at row {s}")

    @torch.no_grad()
    def _router_hook(self, module, args, output):
        x = args[0].reshape(-1, module.hidden_dim).double()
        scores = F.softplus(F.linear(x, module.weight.double())).sqrt()
        biased = scores + module.e_score_correction_bias.double()
        s = biased.sort(dim=-1, descending=True).values
        self.router_min_gap = min(
            self.router_min_gap, (s[:, module.top_k - 1] - s[:, module.top_k]).min().item()
        )
        self.router_rows += x.shape[0]
        mine = biased.topk(module.top_k, dim=-1).indices.sort(-1).values
        if not torch.equal(mine, output[2].sort(-1).values):
            raise AssertionError("router probe disagrees with HF")


# ---------------------------------------------------------------------------------------------
# MTP oracle: HF's modules wired as DeepSeek's reference MTPBlock (docs/models.md §3.10)


class MTPOracle(torch.nn.Module):
    def __init__(self, cfg, tensors: dict[str, torch.Tensor]):
        super().__init__()
        n = cfg.num_hidden_layers
        c = copy.deepcopy(cfg)
        c.num_hidden_layers = n + 1
        c.layer_types = list(cfg.layer_types) + ["sliding_attention"]
        c.mlp_layer_types = list(cfg.mlp_layer_types) + ["moe"]
        self.block = hf_v4.DeepseekV4DecoderLayer(c, n)
        self.hc_head = hf_v4.DeepseekV4HyperHead(cfg)
        d, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.e_proj = torch.nn.Linear(d, d, bias=False)
        self.h_proj = torch.nn.Linear(d, d, bias=False)
        self.enorm = hf_v4.DeepseekV4RMSNorm(d, eps)
        self.hnorm = hf_v4.DeepseekV4RMSNorm(d, eps)
        self.norm = hf_v4.DeepseekV4RMSNorm(d, eps)
        self.block.self_attn.layer_idx = n
        own = dict(self.named_parameters()) | dict(self.named_buffers())
        loaded = set()
        with torch.no_grad():
            for name, t in tensors.items():
                suffix = name[len("mtp.0.") :]
                if suffix.startswith("hc_head_"):
                    key = "hc_head.hc_" + suffix[len("hc_head_") :]
                elif suffix.split(".")[0] in ("e_proj", "h_proj", "enorm", "hnorm", "norm"):
                    key = suffix
                elif re.match(r"ffn\.experts\.\d+\.w[123]\.weight", suffix):
                    continue
                else:
                    key = "block." + rename_layer(suffix, to_release=False)
                own[key].copy_(t)
                loaded.add(key)
            experts = self.block.mlp.experts
            inter = cfg.moe_intermediate_size
            for e in range(cfg.n_routed_experts):
                experts.gate_up_proj[e, :inter] = tensors[f"mtp.0.ffn.experts.{e}.w1.weight"]
                experts.gate_up_proj[e, inter:] = tensors[f"mtp.0.ffn.experts.{e}.w3.weight"]
                experts.down_proj[e] = tensors[f"mtp.0.ffn.experts.{e}.w2.weight"]
            loaded |= {"block.mlp.experts.gate_up_proj", "block.mlp.experts.down_proj"}
        missing = {k for k in own if k not in loaded and "inv_freq" not in k}
        if missing:
            raise AssertionError(f"MTP oracle parameters not loaded: {sorted(missing)}")

    @torch.no_grad()
    def forward(self, model, ids: torch.Tensor) -> torch.Tensor:
        """Logits [T-1, V]: row t predicts token t+2 from the main model's streams at t and token t+1."""
        streams = {}
        handle = model.model.hc_head.register_forward_pre_hook(lambda m, a: streams.setdefault("x", a[0]))
        model(input_ids=ids, use_cache=False)
        handle.remove()
        h, nxt = streams["x"][:, :-1], ids[:, 1:]
        e = self.enorm(model.model.embed_tokens(nxt))
        x = self.e_proj(e).unsqueeze(2) + self.h_proj(self.hnorm(h))
        positions = torch.arange(x.shape[1])[None]
        emb = model.model.embed_tokens(nxt)
        rot = model.model.rotary_emb
        pe = {t: rot(emb, position_ids=positions, layer_type=t) for t in ("main", "compress")}
        mask = create_sliding_window_causal_mask(
            config=model.config,
            inputs_embeds=emb,
            attention_mask=None,
            past_key_values=None,
            position_ids=positions,
        )
        if not isinstance(mask, torch.Tensor):
            raise AssertionError(f"expected an explicit eager mask, got {type(mask)}")
        x = self.block(x, input_ids=nxt, position_embeddings=pe, position_ids=positions, attention_mask=mask)
        return model.lm_head(self.norm(self.hc_head(x)))[0].float().numpy()


# ---------------------------------------------------------------------------------------------
# One fixture


def hf_config(presets) -> DeepseekV4Config:
    cfg = DeepseekV4Config(**copy.deepcopy(presets.V4_TINY_PRESETS["dsv4"]))
    cfg._attn_implementation = "eager"
    return cfg


def build_model(cfg, seed: int):
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="eager").eval()
    randomize(model, cfg, torch.Generator().manual_seed(seed))
    model.generation_config = GenerationConfig(
        bos_token_id=cfg.bos_token_id, eos_token_id=None, do_sample=False
    )
    return model


def make_prompts(seed: int, vocab: int) -> dict[str, np.ndarray]:
    g = torch.Generator().manual_seed(10_000 + seed)
    draw = lambda n: torch.randint(2, vocab, (n,), generator=g).numpy().astype(np.int32)  # noqa: E731
    prompts = {f"prompt_{k}": draw(n) for k, n in PROMPT_LENGTHS.items()}
    prompts["greedy_prompt"] = draw(GREEDY_PROMPT)
    return prompts


def attempt(spec, presets, seed: int) -> dict[str, Any]:
    cfg = hf_config(presets)
    model = build_model(cfg, seed)
    mtp = mtp_release_tensors(model, cfg, torch.Generator().manual_seed(20_000 + seed))
    stored = None
    if spec.get("quantized"):
        stored = quantize_model(model, mtp, torch.Generator().manual_seed(30_000 + seed))
    prompts = make_prompts(seed, cfg.vocab_size)

    probes = Probes(model, cfg)
    res: dict[str, Any] = dict(prompts)
    for k in PROMPT_LENGTHS:
        res[f"logits_{k}"] = full_logits(model, prompts[f"prompt_{k}"])
    res["greedy_tokens"], res["greedy_logits"] = greedy(model, prompts["greedy_prompt"])
    checks: dict[str, Any] = {
        "indexer_min_rel_gap": probes.indexer_min_rel_gap,
        "indexer_rows": probes.indexer_rows,
        "router_min_gap": probes.router_min_gap,
        "router_rows": probes.router_rows,
    }
    probes.remove()
    res["mtp_logits"] = MTPOracle(cfg, mtp)(
        model, torch.tensor(prompts["prompt_long"][None], dtype=torch.long)
    )

    glog = res["greedy_logits"]
    checks["greedy_min_margin"] = float(greedy_margins(glog).min())
    checks["logit_std_long"] = float(res["logits_long"].std(-1).mean())
    # Cached generation (V4's compressor state, sliding window cache) == uncached recompute.
    seq = np.concatenate([prompts["greedy_prompt"], res["greedy_tokens"][:-1]])
    checks["cache_vs_recompute_rel"] = float(
        rel_l2_rows(glog, full_logits(model, seq)[GREEDY_PROMPT - 1 :]).max()
    )
    # Causality: every prefix of the long prompt gives the rows of the full forward.
    long = prompts["prompt_long"]
    checks["prefix_rel"] = float(
        max(rel_l2_rows(full_logits(model, long[:n]), res["logits_long"][:n]).max() for n in (5, 9, 30, 44))
    )
    m64 = copy.deepcopy(model).to(torch.float64)
    m64.set_experts_implementation("eager")
    checks["fp64_rel"] = float(
        max(
            rel_l2_rows(res[f"logits_{k}"], full_logits(m64, prompts[f"prompt_{k}"])).max()
            for k in PROMPT_LENGTHS
        )
    )
    tok64, glog64 = greedy(m64, prompts["greedy_prompt"])
    checks["fp64_greedy_same"] = bool(np.array_equal(tok64, res["greedy_tokens"]))
    checks["fp64_rel_greedy"] = float(rel_l2_rows(glog, glog64).max())
    del m64

    problems = []
    if not checks["indexer_min_rel_gap"] >= MIN_INDEXER_REL_GAP:
        problems.append(f"indexer gap {checks['indexer_min_rel_gap']:.3g}")
    if not checks["router_min_gap"] >= MIN_ROUTER_GAP:
        problems.append(f"router gap {checks['router_min_gap']:.3g}")
    if not checks["greedy_min_margin"] >= MIN_GREEDY_MARGIN:
        problems.append(f"greedy margin {checks['greedy_min_margin']:.3g}")
    if not checks["cache_vs_recompute_rel"] <= MAX_CACHE_REL:
        problems.append(f"cache vs recompute {checks['cache_vs_recompute_rel']:.3g}")
    if not checks["prefix_rel"] <= MAX_CACHE_REL:
        problems.append(f"prefix (causality) {checks['prefix_rel']:.3g}")
    if not (checks["fp64_rel"] <= MAX_FP64_REL and checks["fp64_rel_greedy"] <= MAX_FP64_REL):
        problems.append(f"fp64 rel {checks['fp64_rel']:.3g} / {checks['fp64_rel_greedy']:.3g}")
    if not checks["fp64_greedy_same"]:
        problems.append("fp64 greedy tokens differ")
    if checks["indexer_rows"] == 0 or checks["router_rows"] == 0:
        problems.append("probes saw nothing")
    return {
        "model": model,
        "cfg": cfg,
        "mtp": mtp,
        "stored": stored,
        "res": res,
        "checks": checks,
        "problems": problems,
    }


# ---------------------------------------------------------------------------------------------
# Writing and reloading


def write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")


def storage(name: str, t: torch.Tensor) -> torch.Tensor:
    """bf16 for what V4 stores in bf16 (values are bf16-exact), float32 / int64 as stored upstream."""
    if t.dtype != torch.float32 or stored_fp32(name):
        return t.contiguous()
    if not torch.equal(bf16_exact(t), t):
        raise AssertionError(f"{name} is not bf16-exact")
    return t.to(torch.bfloat16).contiguous()


def hf_saved_names(model, directory: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """What HF 5.23's save_pretrained writes (it reverses part of its conversion mapping)."""
    tmp = directory.with_name(directory.name + ".tmp")
    model.save_pretrained(tmp)
    tensors = {}
    with safe_open(tmp / "model.safetensors", "pt") as fh:
        for k in fh.keys():
            tensors[k] = fh.get_tensor(k)
    config = json.loads((tmp / "config.json").read_text())
    shutil.rmtree(tmp)
    return tensors, config


def save_files(tensors: dict[str, torch.Tensor], directory: Path, shards: int) -> None:
    names = list(tensors)
    if shards == 1:
        save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
        return
    per = -(-len(names) // shards)
    weight_map = {}
    for i in range(shards):
        group = names[i * per : (i + 1) * per]
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        save_file({n: tensors[n] for n in group}, str(directory / file), metadata={"format": "pt"})
        weight_map |= {n: file for n in group}
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    write_json(
        directory / "model.safetensors.index.json",
        {"metadata": {"total_size": total}, "weight_map": weight_map},
    )


def write_checkpoint(r, spec, presets, directory: Path) -> None:
    model, cfg, mtp, stored = r["model"], r["cfg"], r["mtp"], r["stored"]
    if directory.exists():
        shutil.rmtree(directory)
    directory.mkdir(parents=True)
    if spec["layout"] == "hf":
        tensors, config = hf_saved_names(model, directory)
        config["dtype"] = "bfloat16"
    else:
        tensors = release_state(model)
        config = presets.release_form(presets.V4_TINY_PRESETS["dsv4"])
        config["torch_dtype"] = "bfloat16"
    tensors |= mtp
    if stored is not None:
        for name, (kind, q, s) in stored.items():
            expect = fp4_dequantize(q, s) if kind == "fp4" else fp8_dequantize(q, s)
            if not torch.equal(expect, tensors[name]):
                raise AssertionError(f"stored {kind} of {name} does not decode to the golden weight")
            tensors[name], tensors[name[: -len("weight")] + "scale"] = q, s
        config["quantization_config"] = dict(QUANT_CONFIG)
        config["expert_dtype"] = "fp4"
    release_names = {k: k if spec["layout"] == "release" else _release_name_of_saved(k) for k in tensors}
    tensors = {k: storage(release_names[k], v) for k, v in sorted(tensors.items())}
    save_files(tensors, directory, spec.get("shards", 1))
    write_json(directory / "config.json", config)
    gen = {"bos_token_id": cfg.bos_token_id, "eos_token_id": None, "do_sample": False}
    write_json(directory / "generation_config.json", gen)


def _release_name_of_saved(name: str) -> str:
    """HF-saved name -> release name, for the storage dtype rule only."""
    saved_top = {"model.embed_tokens.weight": "embed.weight", "model.norm.weight": "norm.weight"}
    if name in saved_top:
        return saved_top[name]
    if name.startswith("model.hc_head.hc_"):
        return "hc_head_" + name[len("model.hc_head.hc_") :]
    return name[len("model.") :] if name.startswith("model.") else name


def load_hf(directory: Path, what: str, **kwargs):
    """HF's float32 eager model from ``directory``; AssertionError naming ``what`` if any tensor is
    missing or mismatched, or is unexpected beyond the MTP block (HF has no MTP)."""
    m, loading = AutoModelForCausalLM.from_pretrained(
        directory, dtype=torch.float32, attn_implementation="eager", output_loading_info=True, **kwargs
    )
    bad = {k: v for k, v in loading.items() if v and k != "unexpected_keys"}
    unexpected = [k for k in loading.get("unexpected_keys", []) if not re.match(r"(^|.*\.)mtp\.", k)]
    if bad or unexpected:
        raise AssertionError(f"{what}: {bad} unexpected {unexpected}")
    return m


def reload_check(directory: Path, spec, r) -> dict[str, Any]:
    """HF loads the written checkpoint (release names through its own conversion mapping) and gives
    bit-identical logits; quantized files are decoded independently instead (HF cannot run them on CPU)."""
    info: dict[str, Any] = {}
    files = {}
    for f in sorted(directory.glob("*.safetensors")):
        with safe_open(f, "pt") as fh:
            files |= {k: fh.get_tensor(k) for k in fh.keys()}
    info["n_tensors"] = len(files)
    info["n_mtp_tensors"] = sum(k.startswith("mtp.") for k in files)
    info["dtypes"] = sorted({str(v.dtype).replace("torch.", "") for v in files.values()})
    if spec.get("quantized"):
        info["fp8_tensors"] = sum(v.dtype == torch.float8_e4m3fn for v in files.values())
        info["fp4_tensors"] = sum(v.dtype == torch.int8 for v in files.values())
        return info
    kwargs = {} if spec["layout"] == "hf" else {"config": r["cfg"]}
    m = load_hf(directory, f"HF reload of {directory.name}", **kwargs)
    res = r["res"]
    rel = max(
        rel_l2_rows(full_logits(m, res[f"prompt_{k}"]), res[f"logits_{k}"]).max() for k in PROMPT_LENGTHS
    )
    if rel != 0.0:
        raise AssertionError(f"reloaded {directory.name} differs: {rel}")
    info["hf_reload"] = "bit-identical logits"
    return info


@torch.no_grad()
def sensitivity(model, prompt: np.ndarray, base: np.ndarray) -> dict[str, float]:
    """Max rel L2 of the logits when one detail of HF's V4 is changed: what a 1e-4 parity test catches."""
    out: dict[str, float] = {}
    modules = list(model.modules())

    def variant(name, targets, attribute, value):
        saved = [getattr(m, attribute) for m in targets]
        saved = [v.clone() if isinstance(v, torch.Tensor) else v for v in saved]
        for m in targets:
            if isinstance(getattr(m, attribute), torch.Tensor):
                getattr(m, attribute).copy_(torch.as_tensor(value).expand_as(getattr(m, attribute)))
            else:
                setattr(m, attribute, value)
        out[name] = float(rel_l2_rows(full_logits(model, prompt), base).max())
        for m, v in zip(targets, saved):
            if isinstance(v, torch.Tensor):
                getattr(m, attribute).copy_(v)
            else:
                setattr(m, attribute, v)

    attns = [m for m in modules if isinstance(m, hf_v4.DeepseekV4Attention)]
    sinks = [a.sinks.clone() for a in attns]
    for a in attns:
        a.sinks.fill_(-math.inf)
    out["no_sink"] = float(rel_l2_rows(full_logits(model, prompt), base).max())
    for a, s in zip(attns, sinks):
        a.sinks.copy_(s)
    indexers = [m for m in modules if isinstance(m, hf_v4.DeepseekV4Indexer)]
    variant("all_complete_entries_instead_of_top_k", indexers, "index_topk", 10**6)
    routers = [m for m in modules if isinstance(m, hf_v4.DeepseekV4TopKRouter)]
    saved_bias = [r.e_score_correction_bias.clone() for r in routers]
    for r in routers:
        r.e_score_correction_bias.zero_()
    out["router_bias_zeroed"] = float(rel_l2_rows(full_logits(model, prompt), base).max())
    for r, b in zip(routers, saved_bias):
        r.e_score_correction_bias.copy_(b)
    mlps = [m for m in modules if isinstance(m, (hf_v4.DeepseekV4Experts, hf_v4.DeepseekV4MLP))]
    variant("no_swiglu_clamp", mlps, "limit", math.inf)
    variant("window_one_longer", [model.config], "sliding_window", model.config.sliding_window + 1)
    rotaries = [m for m in modules if isinstance(m, hf_v4.DeepseekV4RotaryEmbedding)]
    dim = model.config.qk_rope_head_dim
    plain = 1.0 / (model.config.compress_rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
    variant("compress_rope_without_yarn", rotaries, "compress_inv_freq", plain)
    if not np.array_equal(full_logits(model, prompt), base):
        raise AssertionError("sensitivity probes did not restore the model")
    return out


def make_fixture(spec, presets, out_root: Path, log) -> dict[str, Any]:
    tried = []
    for i in range(MAX_ATTEMPTS):
        seed = spec["seed"] + i
        r = attempt(spec, presets, seed)
        if not r["problems"]:
            break
        tried.append((seed, r["problems"]))
        log(f"  seed {seed} rejected: {', '.join(r['problems'])}")
    else:
        raise RuntimeError(f"{spec['name']}: no seed passed: {tried}")
    sens = sensitivity(r["model"], r["res"]["prompt_long"], r["res"]["logits_long"])
    weak = {k: v for k, v in sens.items() if not v > 1e-3}
    if weak:
        raise AssertionError(f"logits_long barely depends on {weak}")
    directory = out_root / spec["name"]
    write_checkpoint(r, spec, presets, directory)
    info = reload_check(directory, spec, r)
    res, checks = r["res"], r["checks"]
    golden = {k: res[k].astype(np.int32) for k in res if k.startswith("prompt_") or k == "greedy_prompt"}
    golden |= {k: res[k].astype(np.float32) for k in res if k.endswith("logits") or k.startswith("logits_")}
    golden |= {
        "greedy_tokens": res["greedy_tokens"].astype(np.int32),
        "seed": np.int64(seed),
        "hf_version": np.array(transformers.__version__),
        "torch_version": np.array(torch.__version__),
        "greedy_min_margin": np.float64(checks["greedy_min_margin"]),
        "indexer_min_rel_gap": np.float64(checks["indexer_min_rel_gap"]),
        "router_min_gap": np.float64(checks["router_min_gap"]),
    }
    save_npz(directory / "golden.npz", dict(sorted(golden.items())))
    for f in directory.iterdir():
        f.chmod(0o644)
    size = sum(f.stat().st_size for f in directory.iterdir())
    return {
        "name": spec["name"],
        "seed": seed,
        "rejected": tried,
        "checks": checks,
        "info": info,
        "bytes": size,
        "spec": spec,
        "sensitivity": sens,
    }


# ---------------------------------------------------------------------------------------------
# README


def fmt(x: float) -> str:
    return "inf" if x == math.inf else f"{x:.3g}"


def write_readme(results: list[dict[str, Any]], out_root: Path) -> None:
    preset = load_presets().V4_TINY_PRESETS["dsv4"]
    lines = [
        "# DeepSeek-V4 golden fixtures (Hugging Face transformers reference)",
        "",
        "Made by `tests/reference/make_goldens_v4.py` (see `tests/reference/README.md`) with transformers",
        f"{transformers.__version__} and torch {torch.__version__} on CPU, float32, eager attention.",
        "Do not edit by hand.",
        "",
        "Model: the `dsv4` preset of `jaxdsa/checkpoints/tiny/presets.py`: "
        f"{preset['num_hidden_layers']} layers {preset['layer_types']} (CSA ratio 4 with overlap and "
        f"indexer, HCA ratio 8), mlp {preset['mlp_layer_types']}, window {preset['sliding_window']}, hidden "
        "32, 4 heads of 32 (rope 8), q_lora 40, 2 output groups of rank 16, 16 indexer heads of 16, "
        "index_topk 5, 8 experts (2 per token, intermediate 32, swiglu_limit 1.5), hc_mult 4, 20 Sinkhorn "
        "iterations, vocab 128, compress RoPE YaRN (theta 160000, factor 8, original 32). Every fixture also "
        "holds an MTP block `mtp.0.*` (sliding-window, score-routed).",
        "",
        "| key | dtype / shape | what |",
        "|---|---|---|",
    ]
    for k, n in PROMPT_LENGTHS.items():
        lines.append(
            f"| `prompt_{k}`, `logits_{k}` | int32 [{n}], float32 [{n}, 128] | HF uncached forward |"
        )
    lines += [
        f"| `greedy_prompt` | int32 [{GREEDY_PROMPT}] | prompt for generation |",
        f"| `greedy_tokens`, `greedy_logits` | int32 [{NEW}], float32 [{NEW}, 128] | HF `generate` (greedy, "
        "V4 cache); row i is position Tg-1+i |",
        "| `mtp_logits` | float32 [60, 128] | MTP on `prompt_long`: row t from the main streams at t and "
        "token t+1 (predicts t+2); torch oracle = HF decoder layer + HC head wired as DeepSeek's "
        "`MTPBlock` |",
        "| `seed`, margins, versions | | seed that passed every check; weights torch.Generator(seed), "
        "prompts seed + 10000, MTP seed + 20000, FP8 block factors seed + 30000 |",
        "",
        "Prompt token ids are in [2, 128). `short` (6) is shorter than the window (one CSA entry, no HCA",
        "entry), `mid` (21) is longer than it, `long` (61) crosses 15 CSA and 7 HCA window boundaries (not a",
        "multiple of 4 or 8: partial windows stay uncompressed).",
        "",
        "## Fixtures",
        "",
        "| name | size | seed | layout |",
        "|---|---|---|---|",
    ]
    for r in results:
        lines.append(f"| `{r['name']}` | {r['bytes'] / 1e6:.2f} MB | {r['seed']} | {r['spec']['about']} |")
    lines += [
        "",
        "## Weights",
        "",
        f"Linear ~ N(0, {GAIN}^2 / fan_in), lm_head gain {LM_GAIN}, embeddings N(0, 1), norm weights",
        "1 + 0.1 N(0, 1), all rounded to bf16 and stored as bf16 (as V4 releases store them). Float32 as",
        f"upstream: HC `fn` ~ N(0, 1 / (4 D)), `base` ~ {HC_BASE_STD} N(0, 1), `scale` ~ U(0.5, 1.5);",
        f"`attn_sink` ~ N(0, 1); `ape` ~ N(0, 1); router bias ~ {BIAS_STD} N(0, 1). `tid2eid` (int64) holds",
        "2 distinct random experts per token. The FP8 fixture multiplies each 32x32 block by 2^U(-1.5, 1.5)",
        "before quantizing, so block scales differ inside a tensor.",
        "",
        "## Checks (a seed failing one is skipped)",
        "",
        f"- greedy margin (top1 - top2) / max(1, std) >= {MIN_GREEDY_MARGIN} at each generate step;",
        "- indexer: every row with more complete entries than index_topk,",
        f"  (s_k - s_k+1) / max|s| >= {MIN_INDEXER_REL_GAP}",
        "  (scores captured from HF's scorer; the recomputed top-k set must equal HF's);",
        f"- router (score-routed layers): k-th minus (k+1)-th biased score >= {MIN_ROUTER_GAP};",
        f"- cached `generate` logits == uncached recompute (rel L2 <= {MAX_CACHE_REL}); prefixes of",
        "  `prompt_long` give the same rows as the full forward (causality);",
        "- the same model in float64 (HF keeps HC, RoPE and indexer math in fp32) within rel L2",
        f"  {MAX_FP64_REL}, same tokens;",
        "- HF reloads the written checkpoint (release names through its conversion mapping, with the HF",
        "  config object for the release-form config.json) with no missing keys and gives bit-identical",
        "  logits. Quantized files are decoded independently and must equal the golden weights bit for bit.",
        "",
        "| name | greedy margin | indexer rel gap (rows) | router gap (rows) | fp32 vs fp64 | cache vs "
        "recompute | prefix |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        c = r["checks"]
        lines.append(
            f"| `{r['name']}` | {fmt(c['greedy_min_margin'])} | {fmt(c['indexer_min_rel_gap'])} "
            f"({c['indexer_rows']}) | {fmt(c['router_min_gap'])} ({c['router_rows']}) | "
            f"{fmt(max(c['fp64_rel'], c['fp64_rel_greedy']))} | {fmt(c['cache_vs_recompute_rel'])} | "
            f"{fmt(c['prefix_rel'])} |"
        )
    names = list(results[0]["sensitivity"])
    lines += [
        "",
        "How far `logits_long` moves (max rel L2 over positions) when one detail of HF's V4 is changed (a",
        "parity test at 1e-4 catches everything well above that): sinks removed, every complete CSA entry",
        "instead of the indexer's top-k, router bias zeroed, no SwiGLU clamp, a window one token longer,",
        "compress RoPE without YaRN.",
        "",
        "| name | " + " | ".join(f"`{n}`" for n in names) + " |",
        "|---|" + "---|" * len(names),
    ]
    for r in results:
        lines.append(f"| `{r['name']}` | " + " | ".join(fmt(r["sensitivity"][n]) for n in names) + " |")
    lines += ["", "## What HF 5.23 computes (see docs/models.md §8.10)", "", *HF_FACTS, ""]
    (out_root / "README_dsv4.md").write_text("\n".join(lines))


HF_FACTS = [
    "- `save_pretrained` writes neither HF's module names nor the release names: per layer the release",
    "  leaf names under `model.layers.N.` (`attn.wq_a`, `attn.norm` for the KV norm, `ffn.experts.E.w1`,",
    "  `hc_attn_fn`, ...), `head.weight`, but `model.embed_tokens.weight`, `model.norm.weight`,",
    "  `model.hc_head.hc_{fn,base,scale}` (its conversion mapping is reversed only where a pattern",
    "  matches); config.json carries `qk_rope_head_dim` next to `partial_rotary_factor`. `from_pretrained`",
    "  reads both that form and the release names.",
    "- HF maps release `compress_ratios` only through {0, 4, 128}; a release config with another HCA",
    "  ratio (8 here) does not load, so the release-form fixtures are reloaded with the HF config object.",
    "- YaRN `truncate` is read from the top level of `rope_parameters`, never from the `compress` entry.",
    "- Routed expert weights multiply after `down_proj` (DeepSeek's reference: before w2); router weights",
    "  are normalized with + 1e-20; hash layers have no correction bias.",
]


# ---------------------------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="*", help="fixture names to (re)make (README lists only these)")
    ap.add_argument("--out", type=Path, default=FIXTURES)
    args = ap.parse_args()
    if transformers.__version__ != "5.23.0" or not torch.__version__.startswith("2.13.0"):
        versions = f"{transformers.__version__} / {torch.__version__}"
        print(f"WARNING: expected transformers 5.23.0 / torch 2.13.0, got {versions}")
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    presets = load_presets()
    args.out.mkdir(parents=True, exist_ok=True)
    log = lambda s: print(s, flush=True)  # noqa: E731
    results = []
    for spec in FIXTURE_SPECS:
        if args.only and spec["name"] not in args.only:
            continue
        log(f"== {spec['name']}")
        r = make_fixture(spec, presets, args.out, log)
        c = r["checks"]
        log(
            f"  seed {r['seed']}  {r['bytes'] / 1e6:.2f} MB  greedy margin {fmt(c['greedy_min_margin'])}  "
            f"indexer gap {fmt(c['indexer_min_rel_gap'])} ({c['indexer_rows']} rows)  "
            f"router gap {fmt(c['router_min_gap'])}"
        )
        log(
            f"  fp64 {fmt(c['fp64_rel'])} / greedy {fmt(c['fp64_rel_greedy'])}  cache vs recompute "
            f"{fmt(c['cache_vs_recompute_rel'])}  prefix {fmt(c['prefix_rel'])}  "
            f"logit std {c['logit_std_long']:.2f}"
        )
        log(f"  {json.dumps(r['info'], default=str)}")
        log(f"  sensitivity {json.dumps({k: float(f'{v:.3g}') for k, v in r['sensitivity'].items()})}")
        results.append(r)
    if not args.only:
        write_readme(results, args.out)


if __name__ == "__main__":
    main()
