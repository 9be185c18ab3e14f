"""The DeepSeek-V4 parameter spec: one declarative map from checkpoint tensors to params leaves.

Every leaf names its tensor by the **release name** (models.md §4.4: ``embed.weight``,
``layers.N.attn.wq_a.weight``, ``layers.N.ffn.experts.E.w1.weight``, ``hc_head_fn``,
``mtp.0.*``, ...), the shape the file holds it in (after decoding FP8 / FP4), and the transform
into the layout the math uses (``x @ W``: linears transposed to ``[in, out]``, heads split out).
:func:`release_name` maps the other stored form, the names HF transformers 5.23 writes, onto
release names, so both forms load through the same spec:

=========================================  ===========================================
HF-saved name (``save_pretrained``)         release name
=========================================  ===========================================
``model.embed_tokens.weight``              ``embed.weight``
``model.norm.weight``                      ``norm.weight``
``model.hc_head.hc_{fn,base,scale}``       ``hc_head_{fn,base,scale}``
``model.layers.N.attn.norm.weight``        ``layers.N.attn.kv_norm.weight``
``model.layers.N.<rest>``                  ``layers.N.<rest>``
``model.mtp.0.<rest>`` (if ever written)   ``mtp.0.<rest>``
=========================================  ===========================================

(``head.weight`` and everything else under a layer already carry release names in HF's files.)

The params pytree (``[in, out]`` linears; n = hc_mult, M = (2 + n) n, g = o_groups):

- ``embed [V, D]``, ``head [D, V]``, ``norm [D]``, ``hc_head {fn [nD, n], base [n], scale [1]}``
- ``layers[i]`` and ``mtp[0]``: ``attn_norm``, ``ffn_norm [D]``; ``hc_attn``, ``hc_ffn``
  ``{fn [nD, M], base [M], scale [3]}``; ``attn {wq_a [D, q_lora], q_norm, wq_b [q_lora, H, d],
  wkv [D, d], kv_norm [d], wo_a [g, H d / g, o_lora], wo_b [g o_lora, D], sink [H]}`` plus, on
  compressed layers, ``attn.compressor {wkv, wgate [D, c d], ape [m, c d], norm [d]}`` (c = 2 on CSA)
  and on CSA layers ``attn.indexer {wq_b [q_lora, nI, dI], weights_proj [D, nI], compressor}``;
  ``ffn {gate [D, E], bias [E] | tid2eid [V, k] int32, experts (ops.pack_experts), shared {w1, w3
  [D, I], w2 [I, D]}}``
- ``mtp[0]`` also: ``e_proj``, ``h_proj [D, D]``, ``enorm``, ``hnorm``, ``norm [D]``, ``hc_head``.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable

import numpy as np

from jaxdsa.models.deepseek_v4.config import CSA, SWA, V4Config


def _identity(x: np.ndarray) -> np.ndarray:
    return x


def _transpose(x: np.ndarray) -> np.ndarray:
    return x.T


def _transpose_split(*dims: int) -> Callable[[np.ndarray], np.ndarray]:
    """[out, in] -> [in, *dims] with prod(dims) == out (heads split out of a projection)."""
    return lambda w: w.T.reshape((w.shape[1], *dims))


def _grouped(groups: int) -> Callable[[np.ndarray], np.ndarray]:
    """wo_a [g * o_lora, in_per_group] -> [g, in_per_group, o_lora] (group g's rows are contiguous)."""
    return lambda w: w.reshape(groups, -1, w.shape[1]).transpose(0, 2, 1)


@dataclasses.dataclass(frozen=True)
class Leaf:
    """One tensor: its release name, stored shape ([out, in] for linears) and layout transform.

    ``quantizable``: the file may store it as FP8 e4m3 + ``.scale`` (V4's quantized linears).
    ``keep_fp32``: stays float32 whatever dtype the model runs in (HC, sinks, ape, router bias).
    ``index``: an integer table (``tid2eid``), loaded as int32.
    """

    name: str
    shape: tuple[int, ...]
    post: Callable[[np.ndarray], np.ndarray] = _identity
    quantizable: bool = False
    keep_fp32: bool = False
    index: bool = False


@dataclasses.dataclass(frozen=True)
class ExpertsLeaf:
    """Routed experts ``{prefix}.{e}.{w1,w3,w2}.weight`` (w1 = gate, w3 = up, w2 = down), packed
    with ``ops.pack_experts``; stored plain, FP8 or FP4 (``expert_dtype: fp4``)."""

    prefix: str
    num: int
    inter: int
    hidden: int


def _linear(name: str, out: int, inp: int, post=_transpose, quantizable: bool = True) -> Leaf:
    return Leaf(name, (out, inp), post, quantizable=quantizable)


def _hc(prefix: str, cfg: V4Config, site: str) -> dict:
    n, d = cfg.hc_mult, cfg.hidden_size
    mix = (2 + n) * n
    return {
        "fn": Leaf(f"{prefix}hc_{site}_fn", (mix, n * d), _transpose, keep_fp32=True),
        "base": Leaf(f"{prefix}hc_{site}_base", (mix,), keep_fp32=True),
        "scale": Leaf(f"{prefix}hc_{site}_scale", (3,), keep_fp32=True),
    }


def _hc_head(prefix: str, cfg: V4Config) -> dict:
    n, d = cfg.hc_mult, cfg.hidden_size
    return {
        "fn": Leaf(f"{prefix}hc_head_fn", (n, n * d), _transpose, keep_fp32=True),
        "base": Leaf(f"{prefix}hc_head_base", (n,), keep_fp32=True),
        "scale": Leaf(f"{prefix}hc_head_scale", (1,), keep_fp32=True),
    }


def _compressor(prefix: str, cfg: V4Config, ratio: int, width: int, overlap: bool) -> dict:
    c = 2 if overlap else 1
    D = cfg.hidden_size
    return {
        "wkv": _linear(prefix + "wkv.weight", c * width, D, quantizable=False),
        "wgate": _linear(prefix + "wgate.weight", c * width, D, quantizable=False),
        "ape": Leaf(prefix + "ape", (ratio, c * width), keep_fp32=True),
        "norm": Leaf(prefix + "norm.weight", (width,)),
    }


def attention_spec(cfg: V4Config, prefix: str, layer: int) -> dict:
    D, H, d = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim
    g, q_lora = cfg.o_groups, cfg.q_lora_rank
    a = prefix + "attn."
    tree = {
        "wq_a": _linear(a + "wq_a.weight", q_lora, D),
        "q_norm": Leaf(a + "q_norm.weight", (q_lora,)),
        "wq_b": _linear(a + "wq_b.weight", H * d, q_lora, _transpose_split(H, d)),
        "wkv": _linear(a + "wkv.weight", d, D),
        "kv_norm": Leaf(a + "kv_norm.weight", (d,)),
        "wo_a": _linear(a + "wo_a.weight", g * cfg.o_lora_rank, H * d // g, _grouped(g)),
        "wo_b": _linear(a + "wo_b.weight", D, g * cfg.o_lora_rank),
        "sink": Leaf(a + "attn_sink", (H,), keep_fp32=True),
    }
    kind, ratio = cfg.layer_type(layer), cfg.compress_ratio(layer)
    if kind != SWA:
        tree["compressor"] = _compressor(a + "compressor.", cfg, ratio, d, overlap=kind == CSA)
    if kind == CSA:
        n, di = cfg.index_n_heads, cfg.index_head_dim
        tree["indexer"] = {
            "wq_b": _linear(a + "indexer.wq_b.weight", n * di, q_lora, _transpose_split(n, di)),
            "weights_proj": _linear(a + "indexer.weights_proj.weight", n, D, quantizable=False),
            "compressor": _compressor(a + "indexer.compressor.", cfg, ratio, di, overlap=True),
        }
    return tree


def block_spec(cfg: V4Config, prefix: str, layer: int) -> dict:
    """One block (main layer ``layers.N.`` or the MTP block ``mtp.0.``): HC sites, attention, MoE."""
    D, E, inter = cfg.hidden_size, cfg.n_routed_experts, cfg.moe_intermediate_size
    f = prefix + "ffn."
    ffn = {
        "gate": _linear(f + "gate.weight", E, D, quantizable=False),
        "experts": ExpertsLeaf(f + "experts", E, inter, D),
        "shared": {
            "w1": _linear(f + "shared_experts.w1.weight", inter, D),
            "w3": _linear(f + "shared_experts.w3.weight", inter, D),
            "w2": _linear(f + "shared_experts.w2.weight", D, inter),
        },
    }
    if cfg.is_hash_layer(layer):
        ffn["tid2eid"] = Leaf(f + "gate.tid2eid", (cfg.vocab_size, cfg.num_experts_per_tok), index=True)
    else:
        ffn["bias"] = Leaf(f + "gate.bias", (E,), keep_fp32=True)
    return {
        "attn_norm": Leaf(prefix + "attn_norm.weight", (D,)),
        "ffn_norm": Leaf(prefix + "ffn_norm.weight", (D,)),
        "hc_attn": _hc(prefix, cfg, "attn"),
        "hc_ffn": _hc(prefix, cfg, "ffn"),
        "attn": attention_spec(cfg, prefix, layer),
        "ffn": ffn,
    }


def mtp_spec(cfg: V4Config) -> dict:
    D, p = cfg.hidden_size, "mtp.0."
    return {
        **block_spec(cfg, p, cfg.num_hidden_layers),
        "e_proj": _linear(p + "e_proj.weight", D, D),
        "h_proj": _linear(p + "h_proj.weight", D, D),
        "enorm": Leaf(p + "enorm.weight", (D,)),
        "hnorm": Leaf(p + "hnorm.weight", (D,)),
        "norm": Leaf(p + "norm.weight", (D,)),
        "hc_head": _hc_head(p, cfg),
    }


def model_spec(cfg: V4Config, *, mtp: bool) -> dict:
    """The whole tree; ``mtp`` adds ``params['mtp'] = [mtp block]``."""
    V, D = cfg.vocab_size, cfg.hidden_size
    tree = {
        "embed": Leaf("embed.weight", (V, D)),
        "head": _linear("head.weight", V, D, quantizable=False),
        "norm": Leaf("norm.weight", (D,)),
        "hc_head": _hc_head("", cfg),
        "layers": [block_spec(cfg, f"layers.{i}.", i) for i in range(cfg.num_hidden_layers)],
    }
    if mtp:
        tree["mtp"] = [mtp_spec(cfg)]
    return tree


# ---------------------------------------------------------------------------------------------
# Names as HF transformers 5.23 saves them

_HF_SAVED_TOP = {
    "model.embed_tokens.weight": "embed.weight",
    "model.norm.weight": "norm.weight",
    "model.hc_head.hc_fn": "hc_head_fn",
    "model.hc_head.hc_base": "hc_head_base",
    "model.hc_head.hc_scale": "hc_head_scale",
}
# HF renames the release ``attn.kv_norm`` to its module ``kv_norm`` through a ``.norm.`` ->
# ``.kv_norm.`` rule and writes the reverse, ``attn.norm``, on save.
_HF_SAVED_LAYER = [(re.compile(r"^(layers\.\d+\.attn)\.norm\.weight$"), r"\1.kv_norm.weight")]


def release_name(stored: str) -> str:
    """The release name of a stored tensor name (HF-saved or release form)."""
    if stored in _HF_SAVED_TOP:
        return _HF_SAVED_TOP[stored]
    name = stored[len("model.") :] if stored.startswith(("model.layers.", "model.mtp.")) else stored
    for pattern, repl in _HF_SAVED_LAYER:
        name = pattern.sub(repl, name)
    return name
