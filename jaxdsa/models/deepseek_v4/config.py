"""DeepSeek-V4 configuration: one frozen dataclass parsed from either form of ``config.json``.

Two forms exist (docs/models.md §1.1, §8.10):

- **HF serialized** (what transformers 5.23 ``save_pretrained`` writes): ``layer_types``,
  ``compress_rates`` {type: ratio}, ``mlp_layer_types``, nested ``rope_parameters`` {main,
  compress} with a ``partial_rotary_factor`` in each entry;
- **upstream release** (what DeepSeek's checkpoints ship): ``compress_ratios`` (one int per layer,
  then the MTP block's, sometimes padding), ``num_hash_layers``, ``rope_theta`` +
  ``compress_rope_theta`` + ``rope_scaling`` (YaRN, compressed layers only), ``qk_rope_head_dim``.

Both become per-layer (attention type, compression ratio, hash routing or not) tuples and two
RoPE configs. Where a file carries both forms they must agree; anything jaxdsa cannot run, or that
contradicts itself, is a :class:`~jaxdsa.config.ConfigError` naming the file and the field.

Semantics follow HF where HF defines them (the parity oracle): a ratio-4 layer in the release form
is CSA (overlapping windows + indexer) and any other non-zero ratio is HCA, as in DeepSeek's code;
HF itself only maps release ratios {0, 4, 128}. The compress RoPE built from the release form gets
YaRN attention factor 1 (HF forces it); a nested entry without ``attention_factor`` gets HF's
derived mscale, exactly as HF computes it.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any

from jaxdsa.checkpoints.quant import QuantConfig
from jaxdsa.checkpoints.tiny.presets import V4_TINY_PRESETS
from jaxdsa.config import Fields, RopeConfig, eos_ids, parse_quantization, read_config_json

MODEL_TYPE = "deepseek_v4"
SWA = "sliding_attention"
CSA = "compressed_sparse_attention"
HCA = "heavily_compressed_attention"
LAYER_TYPES = (SWA, CSA, HCA)
MLP_TYPES = ("hash_moe", "moe")
HF_DEFAULT_COMPRESS_RATES = {CSA: 4, HCA: 128}
CSA_RELEASE_RATIO = 4  # DeepSeek's code: overlap and an indexer exactly when the ratio is 4


@dataclasses.dataclass(frozen=True)
class V4Config:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    head_dim: int
    qk_rope_head_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    sliding_window: int
    layer_types: tuple[str, ...]  # per main layer, one of LAYER_TYPES
    compress_ratios: tuple[int, ...]  # per main layer: 0 (sliding only) or the window length m
    hash_layers: tuple[bool, ...]  # per main layer: route by tid2eid[token] instead of top-k
    mtp_layer_type: str
    mtp_compress_ratio: int
    rope: RopeConfig  # sliding-window-only layers
    compress_rope: RopeConfig  # CSA / HCA layers: queries, window keys, compressed entries, indexer
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    n_routed_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    routed_scaling_factor: float
    swiglu_limit: float
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    rms_norm_eps: float
    max_position_embeddings: int
    num_nextn_predict_layers: int = 0
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None
    quantization: QuantConfig | None = None
    expert_dtype: str | None = None  # "fp4": routed experts packed e2m1 with ue8m0 scales per 32
    model_type: str = MODEL_TYPE

    @property
    def softmax_scale(self) -> float:
        """head_dim^-0.5; V4 has no YaRN mscale on the softmax (docs/models.md §1.2)."""
        return self.head_dim**-0.5

    def layer_type(self, layer: int) -> str:
        """Attention type of a main layer, or of the MTP block for ``layer >= num_hidden_layers``."""
        return self.layer_types[layer] if layer < self.num_hidden_layers else self.mtp_layer_type

    def compress_ratio(self, layer: int) -> int:
        return self.compress_ratios[layer] if layer < self.num_hidden_layers else self.mtp_compress_ratio

    def is_hash_layer(self, layer: int) -> bool:
        return layer < self.num_hidden_layers and self.hash_layers[layer]

    def replace(self, **changes: Any) -> V4Config:
        return dataclasses.replace(self, **changes)

    def architecture(self) -> V4Config:
        """Only what the math depends on (no file format, no special tokens): the static key of the
        jitted forward, so checkpoints of one architecture share one compilation."""
        return self.replace(
            quantization=None, expert_dtype=None, bos_token_id=None, eos_token_ids=(), pad_token_id=None
        )


# ---------------------------------------------------------------------------------------------
# Parsing


def _rope_entry(f: Fields, field: str, entry: Any, head_dim: int) -> tuple[RopeConfig, int]:
    """One nested ``rope_parameters`` entry -> (RopeConfig, rotary dims), with HF's defaults."""
    if not isinstance(entry, Mapping):
        raise f.error(field, f"expected an object, got {type(entry).__name__}")
    kind = entry.get("rope_type", entry.get("type", "default"))
    if kind not in ("default", "yarn"):
        raise f.error(f"{field}.rope_type", f"unsupported RoPE type {kind!r} (default or yarn)")
    if "rope_theta" not in entry:
        raise f.error(f"{field}.rope_theta", "missing")
    if entry.get("truncate", True) is not True:
        raise f.error(
            f"{field}.truncate", "HF reads truncate only at the top level and DeepSeek always truncates"
        )
    factor = entry.get("partial_rotary_factor", 1.0)  # HF's default when an entry has none
    rope = RopeConfig(theta=float(entry["rope_theta"]))
    if kind == "yarn":
        for key in ("factor", "original_max_position_embeddings"):
            if key not in entry:
                raise f.error(f"{field}.{key}", "missing for yarn")
        rope = RopeConfig(
            theta=float(entry["rope_theta"]),
            type="yarn",
            factor=float(entry["factor"]),
            original_max_position_embeddings=int(entry["original_max_position_embeddings"]),
            beta_fast=float(entry.get("beta_fast") or 32),
            beta_slow=float(entry.get("beta_slow") or 1),
            mscale=entry.get("mscale"),
            mscale_all_dim=entry.get("mscale_all_dim"),
            attention_factor=entry.get("attention_factor"),
        )
    return rope, int(head_dim * factor)


def _parse_ropes(f: Fields, head_dim: int) -> tuple[RopeConfig, RopeConfig, int]:
    """(main rope, compress rope, rotary dims) from nested rope_parameters or the release keys."""
    raw = f.raw
    nested = raw.get("rope_parameters")
    if isinstance(nested, Mapping) and isinstance(nested.get("main"), Mapping):
        if not isinstance(nested.get("compress"), Mapping):
            raise f.error(
                "rope_parameters.compress", "missing: nested rope_parameters need main and compress"
            )
        main, dims_main = _rope_entry(f, "rope_parameters.main", nested["main"], head_dim)
        compress, dims_compress = _rope_entry(f, "rope_parameters.compress", nested["compress"], head_dim)
        if dims_main != dims_compress:
            raise f.error(
                "rope_parameters.compress.partial_rotary_factor",
                f"rotates {dims_compress} dims but main rotates {dims_main}",
            )
        dims = dims_main
        for name, value in (("rope_theta", main.theta), ("compress_rope_theta", compress.theta)):
            if raw.get(name) is not None and float(raw[name]) != value:
                raise f.error(name, f"{raw[name]} contradicts rope_parameters ({value})")
    else:
        flat = {**(raw.get("rope_scaling") or {}), **(nested or {})}
        field = "rope_parameters" if nested else "rope_scaling"
        theta = flat.get("rope_theta", raw.get("rope_theta"))
        if theta is None:
            raise f.error("rope_theta", "missing")
        main = RopeConfig(theta=float(theta))
        compress_theta = f.get("compress_rope_theta", float)
        kind = flat.get("rope_type", flat.get("type", "default"))
        entry = {**flat, "rope_type": kind, "rope_theta": compress_theta}
        if kind == "yarn":
            entry.setdefault("attention_factor", 1.0)  # HF: the V4 reference never scales cos/sin
        compress, _ = _rope_entry(f, field, entry, head_dim)
        dims = None
    factor = raw.get("partial_rotary_factor")
    rope_dims = raw.get("qk_rope_head_dim")
    candidates = {
        "partial_rotary_factor": None if factor is None else int(head_dim * factor),
        "qk_rope_head_dim": rope_dims,
    }
    for name, value in candidates.items():
        if value is None:
            continue
        if dims is not None and value != dims:
            raise f.error(name, f"gives {value} rotary dims, rope_parameters give {dims}")
        dims = value
    if dims is None:
        raise f.error("qk_rope_head_dim", "missing (neither qk_rope_head_dim nor partial_rotary_factor)")
    if not isinstance(dims, int) or dims <= 0 or dims % 2 or dims > head_dim:
        raise f.error("qk_rope_head_dim", f"{dims}: must be even, > 0 and <= head_dim {head_dim}")
    return main, compress, dims


def _parse_layers(f: Fields, n: int) -> tuple[tuple[str, ...], tuple[int, ...], str, int]:
    """Per-layer attention types and ratios, and the MTP block's (type, ratio)."""
    raw = f.raw
    rates = dict(HF_DEFAULT_COMPRESS_RATES)
    if raw.get("compress_rates") is not None:
        if not isinstance(raw["compress_rates"], Mapping):
            raise f.error("compress_rates", "expected an object {layer type: ratio}")
        unknown = set(raw["compress_rates"]) - {CSA, HCA}
        if unknown:
            raise f.error("compress_rates", f"unknown layer types {sorted(unknown)}")
        rates |= raw["compress_rates"]
    for key, kind in (("compress_rate_csa", CSA), ("compress_rate_hca", HCA)):
        if raw.get(key) is not None:
            rates[kind] = raw[key]
    for kind, rate in rates.items():
        if not isinstance(rate, int) or isinstance(rate, bool) or rate <= 0:
            raise f.error(f"compress_rates.{kind}", f"must be a positive int, got {rate!r}")

    from_ratios = None
    if raw.get("compress_ratios") is not None:
        ratios = raw["compress_ratios"]
        if not isinstance(ratios, list) or not all(isinstance(r, int) and r >= 0 for r in ratios):
            raise f.error("compress_ratios", "expected a list of non-negative ints")
        if len(ratios) < n:
            raise f.error("compress_ratios", f"{len(ratios)} entries for {n} layers")
        kind = lambda r: SWA if r == 0 else CSA if r == CSA_RELEASE_RATIO else HCA  # noqa: E731
        from_ratios = [(kind(r), r) for r in ratios]

    if raw.get("layer_types") is not None:
        types = raw["layer_types"]
        if not isinstance(types, list) or len(types) != n:
            raise f.error("layer_types", f"expected a list of {n} entries (num_hidden_layers)")
        bad = sorted({t for t in types if t not in LAYER_TYPES})
        if bad:
            raise f.error("layer_types", f"unknown types {bad}; allowed {list(LAYER_TYPES)}")
        layers = [(t, 0 if t == SWA else rates[t]) for t in types]
        if from_ratios is not None and from_ratios[:n] != layers:
            raise f.error("compress_ratios", "contradicts layer_types / compress_rates")
        mtp = from_ratios[n] if from_ratios is not None and len(from_ratios) > n else (SWA, 0)
    elif from_ratios is not None:
        layers = from_ratios[:n]
        mtp = from_ratios[n] if len(from_ratios) > n else (SWA, 0)
    else:
        raise f.error("layer_types", "missing (neither layer_types nor compress_ratios)")
    return tuple(t for t, _ in layers), tuple(r for _, r in layers), mtp[0], mtp[1]


def _parse_hash_layers(f: Fields, n: int) -> tuple[bool, ...]:
    raw = f.raw
    from_count = None
    if raw.get("num_hash_layers") is not None:
        count = f.get("num_hash_layers", int)
        if not 0 <= count <= n:
            raise f.error("num_hash_layers", f"{count} is not within 0..{n}")
        from_count = tuple(i < count for i in range(n))
    if raw.get("mlp_layer_types") is not None:
        types = raw["mlp_layer_types"]
        if not isinstance(types, list) or len(types) != n or any(t not in MLP_TYPES for t in types):
            raise f.error("mlp_layer_types", f"expected {n} entries from {list(MLP_TYPES)}")
        hashed = tuple(t == "hash_moe" for t in types)
        if from_count is not None and from_count != hashed:
            raise f.error("num_hash_layers", "contradicts mlp_layer_types")
        return hashed
    if from_count is None:
        raise f.error("num_hash_layers", "missing (neither num_hash_layers nor mlp_layer_types)")
    return from_count


def _expert_dtype(f: Fields) -> str | None:
    quant = f.raw.get("quantization_config")
    values = {
        "expert_dtype": f.raw.get("expert_dtype"),
        "quantization_config.expert_dtype": quant.get("expert_dtype") if isinstance(quant, Mapping) else None,
    }
    given = {k: v for k, v in values.items() if v is not None}
    if len(set(given.values())) > 1:
        raise f.error("expert_dtype", f"contradicts quantization_config.expert_dtype: {given}")
    for field, value in given.items():
        if value != "fp4":
            raise f.error(field, f"only fp4 routed experts are supported, got {value!r}")
        if not isinstance(quant, Mapping):
            raise f.error(field, "fp4 experts need the fp8 quantization_config that holds their scale format")
    return "fp4" if given else None


def v4_config_from_dict(raw: Mapping[str, Any], source: str = "<dict>") -> V4Config:
    """Parse a DeepSeek-V4 ``config.json`` dict (HF or release form); ``source`` names it in errors."""
    f = Fields(raw, source)
    if (model_type := f.get("model_type", str)) != MODEL_TYPE:
        raise f.error("model_type", f"{model_type!r} is not {MODEL_TYPE!r}")
    g = lambda name, kind=int, default=dataclasses.MISSING: f.get(name, kind, default, positive=True)  # noqa: E731
    for field, want in (
        ("hidden_act", "silu"),
        ("scoring_func", "sqrtsoftplus"),
        ("topk_method", "noaux_tc"),
    ):
        if raw.get(field, want) != want:
            raise f.error(field, f"only {want!r} is supported, got {raw[field]!r}")
    for field, want in (
        ("num_key_value_heads", 1),
        ("n_shared_experts", 1),
        ("n_group", 1),
        ("topk_group", 1),
    ):
        if raw.get(field, want) != want:
            raise f.error(field, f"DeepSeek-V4 has {want}, got {raw[field]!r}")
    for field in ("attention_bias", "mlp_bias", "tie_word_embeddings"):
        if raw.get(field):
            raise f.error(field, "must be false for DeepSeek-V4")
    if raw.get("norm_topk_prob") is False:
        raise f.error(
            "norm_topk_prob", "HF and DeepSeek normalize the routing weights of sqrtsoftplus scores"
        )

    n = g("num_hidden_layers")
    head_dim = g("head_dim")
    main_rope, compress_rope, rope_dims = _parse_ropes(f, head_dim)
    layer_types, ratios, mtp_type, mtp_ratio = _parse_layers(f, n)
    quant = parse_quantization(f)
    if quant is not None and quant.method != "fp8":
        raise f.error("quantization_config.quant_method", f"DeepSeek-V4 ships fp8, got {quant.method!r}")
    cfg = V4Config(
        vocab_size=g("vocab_size"),
        hidden_size=g("hidden_size"),
        num_hidden_layers=n,
        num_attention_heads=g("num_attention_heads"),
        head_dim=head_dim,
        qk_rope_head_dim=rope_dims,
        q_lora_rank=g("q_lora_rank"),
        o_groups=g("o_groups"),
        o_lora_rank=g("o_lora_rank"),
        sliding_window=g("sliding_window"),
        layer_types=layer_types,
        compress_ratios=ratios,
        hash_layers=_parse_hash_layers(f, n),
        mtp_layer_type=mtp_type,
        mtp_compress_ratio=mtp_ratio,
        rope=main_rope,
        compress_rope=compress_rope,
        index_n_heads=g("index_n_heads"),
        index_head_dim=g("index_head_dim"),
        index_topk=g("index_topk"),
        n_routed_experts=g("n_routed_experts"),
        num_experts_per_tok=g("num_experts_per_tok"),
        moe_intermediate_size=g("moe_intermediate_size"),
        routed_scaling_factor=g("routed_scaling_factor", float, 1.0),
        swiglu_limit=g("swiglu_limit", float),
        hc_mult=g("hc_mult"),
        hc_sinkhorn_iters=g("hc_sinkhorn_iters"),
        hc_eps=g("hc_eps", float),
        rms_norm_eps=g("rms_norm_eps", float, 1e-6),
        max_position_embeddings=g("max_position_embeddings"),
        num_nextn_predict_layers=f.get("num_nextn_predict_layers", int, 0),
        bos_token_id=f.get("bos_token_id", int, None),
        eos_token_ids=eos_ids(f),
        pad_token_id=f.get("pad_token_id", int, None),
        quantization=quant,
        expert_dtype=_expert_dtype(f),
    )
    _check_consistency(cfg, f)
    return cfg


def _check_consistency(c: V4Config, f: Fields) -> None:
    if (c.num_attention_heads * c.head_dim) % c.o_groups:
        raise f.error(
            "o_groups", f"{c.num_attention_heads} heads x {c.head_dim} do not split into {c.o_groups} groups"
        )
    if c.num_experts_per_tok > c.n_routed_experts:
        raise f.error(
            "num_experts_per_tok", f"{c.num_experts_per_tok} > n_routed_experts {c.n_routed_experts}"
        )
    uses_indexer = CSA in c.layer_types or c.mtp_layer_type == CSA
    if uses_indexer and c.index_head_dim < c.qk_rope_head_dim:
        raise f.error(
            "index_head_dim", f"{c.index_head_dim} < the {c.qk_rope_head_dim} rotary dims it carries"
        )
    if c.num_nextn_predict_layers > 1:
        raise f.error(
            "num_nextn_predict_layers", f"DeepSeek-V4 has one MTP block, got {c.num_nextn_predict_layers}"
        )
    if c.expert_dtype == "fp4" and (c.moe_intermediate_size % 32 or c.hidden_size % 32):
        raise f.error("moe_intermediate_size", "fp4 experts need input widths that are multiples of 32")


def load_v4_config(path: str | os.PathLike) -> V4Config:
    """Read ``config.json`` from a checkpoint directory (or the file itself)."""
    raw, file = read_config_json(path)
    return v4_config_from_dict(raw, file)


def tiny_v4_config(name: str = "dsv4", **overrides: Any) -> V4Config:
    """A tiny preset from :data:`jaxdsa.checkpoints.tiny.presets.V4_TINY_PRESETS` (HF form) with field
    overrides."""
    return v4_config_from_dict({**V4_TINY_PRESETS[name], **overrides}, f"<tiny:{name}>")
