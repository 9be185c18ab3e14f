"""Where every parameter of :class:`~jaxdsa.models.deepseek_v4.model.V4Model` comes from in a checkpoint.

:func:`param_spec` maps each parameter path to a :mod:`jaxdsa.checkpoints.spec` leaf read by the one
walker (:mod:`jaxdsa.checkpoints.walker`). Leaves name tensors by the **release name** (docs/models.md §4.4:
``embed.weight``, ``layers.N.attn.wq_a.weight``, ``layers.N.ffn.experts.E.w1.weight``,
``hc_head_fn``, ``mtp.0.*``, ...); :func:`tensor_name` maps what a file stores onto those names,
so both stored forms load through the one spec:

=========================================  ===========================================
stored name                                 read as
=========================================  ===========================================
``model.embed_tokens.weight``              ``embed.weight``
``model.norm.weight``                      ``norm.weight``
``model.hc_head.hc_{fn,base,scale}``       ``hc_head_{fn,base,scale}``
``model.layers.N.attn.norm.weight``        ``layers.N.attn.kv_norm.weight``
``model.layers.N.<rest>``                  ``layers.N.<rest>``
``model.mtp.0.<rest>`` (if ever written)   ``mtp.0.<rest>``
``<module>.scale`` (ue8m0, FP8 and FP4)    ``<module>.weight_scale_inv`` (the walker's scale name)
=========================================  ===========================================

The first five are the names HF transformers 5.23's ``save_pretrained`` writes (``head.weight``
and everything else under a layer already carry release names in HF's files).
"""

from __future__ import annotations

import re

from jaxdsa.checkpoints.spec import (
    V4_EXPERT_NAMES,
    ExpertDown,
    ExpertGateUp,
    IndexTable,
    Leaf,
    Linear,
    Spec,
    Tensor,
    as_stored,
    transpose,
    transpose_split,
)
from jaxdsa.models.deepseek_v4.config import CSA, SWA, V4Config
from jaxdsa.models.deepseek_v4.model import V4Model
from jaxdsa.models.layer_groups import group_specs

Path = tuple


def _per_head(groups: int, heads: int):
    """wo_a [g * o_lora, H/g * d] -> [o_lora, H, d]: group k's rows are contiguous, its input is its
    heads' outputs concatenated, so head h's block is group h // (H/g)'s columns of that head. Not a
    view of the file (the regrouping copies one layer's wo_a once per device that reads it)."""

    def view(w):
        r = w.shape[0] // groups
        return w.reshape(groups, r, w.shape[1]).transpose(1, 0, 2).reshape(r, heads, -1)

    return view


def _nest(prefix: Path, tree: dict[Path, Leaf]) -> dict[Path, Leaf]:
    return {prefix + path: leaf for path, leaf in tree.items()}


def hc_tensors(name: str, cfg, mix: int, scales: int) -> dict[Path, Leaf]:
    """An HC site (``{name}_fn [mix, n D]``, ``_base``, ``_scale``) or head; fn transposed to [n D, mix]."""
    nd = cfg.hc_mult * cfg.hidden_size
    return {
        ("fn",): Tensor(name + "_fn", (mix, nd), init="bias", view=transpose),
        ("base",): Tensor(name + "_base", (mix,), init="bias"),
        ("scale",): Tensor(name + "_scale", (scales,)),
    }


def _compressor(prefix: str, cfg: V4Config, ratio: int, width: int, overlap: bool) -> dict[Path, Leaf]:
    c, D = 2 if overlap else 1, cfg.hidden_size
    return {
        ("wkv", "weight"): Linear(prefix + "wkv", c * width, D),
        ("wgate", "weight"): Linear(prefix + "wgate", c * width, D),
        ("ape",): Tensor(prefix + "ape", (ratio, c * width), init="bias"),
        ("norm", "weight"): Tensor(prefix + "norm.weight", (width,)),
    }


def _attention(cfg: V4Config, a: str, layer: int) -> dict[Path, Leaf]:
    D, H, d, g = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim, cfg.o_groups
    q_lora = cfg.q_lora_rank
    tree: dict[Path, Leaf] = {
        ("wq_a", "weight"): Linear(a + "wq_a", q_lora, D),
        ("q_norm", "weight"): Tensor(a + "q_norm.weight", (q_lora,)),
        ("wq_b", "weight"): Linear(a + "wq_b", H * d, q_lora, transpose_split(H, d)),
        ("wkv", "weight"): Linear(a + "wkv", d, D),
        ("kv_norm", "weight"): Tensor(a + "kv_norm.weight", (d,)),
        ("wo_a",): Linear(a + "wo_a", g * cfg.o_lora_rank, H * d // g, _per_head(g, H)),
        ("wo_b", "weight"): Linear(a + "wo_b", D, g * cfg.o_lora_rank),
        ("sink",): Tensor(a + "attn_sink", (H,), init="bias"),
    }
    kind, ratio = cfg.layer_type(layer), cfg.compress_ratio(layer)
    if kind != SWA:
        tree |= _nest(("compressor",), _compressor(a + "compressor.", cfg, ratio, d, overlap=kind == CSA))
    if kind == CSA:
        n, di, i = cfg.index_n_heads, cfg.index_head_dim, a + "indexer."
        tree |= _nest(
            ("indexer",),
            {
                ("wq_b", "weight"): Linear(i + "wq_b", n * di, q_lora, transpose_split(n, di)),
                ("weights_proj", "weight"): Linear(i + "weights_proj", n, D),
                **_nest(("compressor",), _compressor(i + "compressor.", cfg, ratio, di, overlap=True)),
            },
        )
    return tree


def block_spec(cfg: V4Config, prefix: str, layer: int) -> dict[Path, Leaf]:
    """One :class:`Block` (main layer ``layers.N.`` or the MTP block's ``mtp.0.``), paths relative to it."""
    D, E, N, n = cfg.hidden_size, cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.hc_mult
    f = prefix + "ffn."
    fp4 = cfg.expert_dtype == "fp4"
    ffn: dict[Path, Leaf] = {
        ("router", "weight"): Linear(f + "gate", E, D, as_stored),
        ("experts", "gate_up"): ExpertGateUp(f + "experts", E, N, D, names=V4_EXPERT_NAMES, fp4=fp4),
        ("experts", "down"): ExpertDown(f + "experts", E, N, D, names=V4_EXPERT_NAMES, fp4=fp4),
        ("shared", "gate", "weight"): Linear(f + "shared_experts.w1", N, D),
        ("shared", "up", "weight"): Linear(f + "shared_experts.w3", N, D),
        ("shared", "down", "weight"): Linear(f + "shared_experts.w2", D, N),
    }
    if cfg.is_hash_layer(layer):
        ffn[("router", "tid2eid")] = IndexTable(
            f + "gate.tid2eid", (cfg.vocab_size, cfg.num_experts_per_tok), E
        )
    else:
        ffn[("router", "bias")] = Tensor(f + "gate.bias", (E,), init="bias")
    return {
        ("attn_norm", "weight"): Tensor(prefix + "attn_norm.weight", (D,)),
        ("ffn_norm", "weight"): Tensor(prefix + "ffn_norm.weight", (D,)),
        **_nest(("hc_attn",), hc_tensors(prefix + "hc_attn", cfg, (2 + n) * n, 3)),
        **_nest(("hc_ffn",), hc_tensors(prefix + "hc_ffn", cfg, (2 + n) * n, 3)),
        **_nest(("attn",), _attention(cfg, prefix + "attn.", layer)),
        **_nest(("ffn",), ffn),
    }


def _mtp_spec(cfg: V4Config) -> dict[Path, Leaf]:
    D, p = cfg.hidden_size, "mtp.0."
    return {
        ("enorm", "weight"): Tensor(p + "enorm.weight", (D,)),
        ("hnorm", "weight"): Tensor(p + "hnorm.weight", (D,)),
        ("e_proj", "weight"): Linear(p + "e_proj", D, D),
        ("h_proj", "weight"): Linear(p + "h_proj", D, D),
        ("norm", "weight"): Tensor(p + "norm.weight", (D,)),
        **_nest(("hc_head",), hc_tensors(p + "hc_head", cfg, cfg.hc_mult, 1)),
        **_nest(("block",), block_spec(cfg, p, cfg.num_hidden_layers)),
    }


MTP_MARKER = "mtp.0.e_proj.weight"  # present when the checkpoint ships the MTP block


def param_spec(cfg: V4Config, model: V4Model) -> dict[Path, Spec]:
    """Sources of every parameter of ``model`` (its groups as they are: scanned or taken apart)."""
    V, D = cfg.vocab_size, cfg.hidden_size
    spec: dict[Path, Spec] = {
        ("embed", "weight"): Tensor("embed.weight", (V, D), init="embed"),
        ("norm", "weight"): Tensor("norm.weight", (D,)),
        ("head", "weight"): Linear("head", V, D),
        **_nest(("hc_head",), hc_tensors("hc_head", cfg, cfg.hc_mult, 1)),
    }
    spec |= group_specs(model.groups, lambda i: block_spec(cfg, f"layers.{i}.", i))
    for k in range(len(model.mtp)):
        spec |= _nest(("mtp", k), _mtp_spec(cfg))
    return spec


_HF_SAVED_TOP = {
    "model.embed_tokens.weight": "embed.weight",
    "model.norm.weight": "norm.weight",
    "model.hc_head.hc_fn": "hc_head_fn",
    "model.hc_head.hc_base": "hc_head_base",
    "model.hc_head.hc_scale": "hc_head_scale",
}
# HF renames the release ``attn.kv_norm`` to its module ``kv_norm`` through a ``.norm.`` ->
# ``.kv_norm.`` rule and writes the reverse, ``attn.norm``, on save.
_HF_SAVED_KV_NORM = re.compile(r"^(layers\.\d+\.attn)\.norm\.weight$")


def release_name(stored: str) -> str:
    """The release name of a stored tensor name (HF-saved or release form)."""
    if stored in _HF_SAVED_TOP:
        return _HF_SAVED_TOP[stored]
    name = stored[len("model.") :] if stored.startswith(("model.layers.", "model.mtp.")) else stored
    return _HF_SAVED_KV_NORM.sub(r"\1.kv_norm.weight", name)


def tensor_name(stored: str) -> str:
    """The name :func:`param_spec` reads a stored tensor under: its release name, with a quantized
    weight's ue8m0 ``.scale`` as the walker's ``.weight_scale_inv``."""
    name = release_name(stored)
    return name[: -len(".scale")] + ".weight_scale_inv" if name.endswith(".scale") else name
