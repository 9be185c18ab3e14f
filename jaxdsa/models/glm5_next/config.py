"""GLM-5.3-Flash configuration: ``config.json`` -> one frozen dataclass (docs/models.md §9.1).

The text model's fields sit under ``text_config`` (HF's ``Glm5NextConfig`` with text and vision
sub-configs); a flat file with the text fields at the top level is read as HF reads it (its
``__post_init__`` forwards them into ``text_config``). The vision tower's fields are not parsed:
nothing here runs it.

Two spellings of the text fields exist, both read:

- **HF serialized** (what transformers 5.23 ``save_pretrained`` writes): ``layer_types`` with
  ``linear_attention`` / ``indexed_attention``, ``linear_num_heads``, ``linear_head_dim``,
  ``linear_conv_kernel_dim``, ``linear_lower_bound``;
- **release** (the keys GLM's own files use, which HF folds in): ``layer_types`` spelling DSA layers
  ``deepseek_sparse_attention`` (or ``full_attention``), a ``linear_attn_config`` object
  (``num_heads``, ``head_dim``, ``short_conv_kernel_size``, ``gate_lower_bound``, ``safe_gate``,
  ``kda_layers``, ``full_attn_layers``), ``first_k_dense_replace``, ``num_nextn_predict_layers``,
  ``index_topk_freq`` / ``index_skip_topk_offset`` / ``index_topk_pattern``.

A field the file omits takes ``Glm5NextTextConfig``'s default (:data:`HF_TEXT_DEFAULTS`). Keys HF
ignores but that would change the model if HF honoured them (``first_k_dense_replace``,
``linear_attn_config.kda_layers``, ``mhc``, ``mla_use_nope``, ...) must agree with what HF computes;
anything jaxdsa cannot run or that contradicts itself is a :class:`~jaxdsa.config.ConfigError`
naming the file and the field (``text_config.<name>`` in the nested form).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from typing import Any

from jaxdsa.checkpoints.quant import QuantConfig
from jaxdsa.config import ConfigError, Fields, eos_ids, parse_quantization, read_config_json

MODEL_TYPE = "glm5_next"
TEXT_MODEL_TYPE = "glm5_next_text"

KDA = "linear_attention"
DSA = "indexed_attention"
# HF turns these into indexed_attention: Glm5NextTextConfig maps full_attention, transformers'
# legacy remap deepseek_sparse_attention (the release's spelling).
DSA_SPELLINGS = (DSA, "full_attention", "deepseek_sparse_attention")
FULL, SHARED = "full", "shared"
DENSE, SPARSE = "dense", "sparse"

# Constants of HF's code, not of the config (docs/models.md §9.3, §9.5).
KDA_CHUNK = 64  # chunk_kimi_delta_attention's chunk_size
KDA_L2_NORM_EPS = 1e-6  # l2norm of q and k inside the KDA kernels
INDEXER_K_NORM_EPS = 1e-6  # the indexer's k_norm LayerNorm
HF_DENSE_LAYERS = 3  # Glm5NextTextConfig's mlp_layer_types default: the first 3 layers dense
HF_DSA_EVERY = 4  # its layer_types default: layer i is DSA iff i % 4 == 3

# Glm5NextTextConfig's defaults (transformers 5.23): what a file that omits a field means.
HF_TEXT_DEFAULTS: dict[str, Any] = {
    "vocab_size": 154880,
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": 45,
    "num_attention_heads": 64,
    "n_shared_experts": 1,
    "n_routed_experts": 288,
    "routed_scaling_factor": 2.5,
    "kv_lora_rank": 512,
    "q_lora_rank": 1536,
    "qk_rope_head_dim": 0,
    "v_head_dim": 256,
    "qk_nope_head_dim": 256,
    "n_group": 1,
    "topk_group": 1,
    "num_experts_per_tok": 8,
    "norm_topk_prob": True,
    "hidden_act": "silu",
    "max_position_embeddings": 1048576,
    "rms_norm_eps": 1e-5,
    "pad_token_id": 154820,
    "attention_bias": False,
    "index_topk": 2048,
    "index_head_dim": 128,
    "index_n_heads": 32,
    "swiglu_limit": 10.0,
    "linear_head_dim": 128,
    "linear_num_heads": 64,
    "linear_conv_kernel_dim": 4,
    "linear_lower_bound": -5.0,
    "hc_mult": 4,
    "hc_eps": 1e-6,
    "hc_sinkhorn_iters": 20,
    "index_kpool": 16,
    "index_kpool_always_select_tail": True,
    "index_topk_freq": 1,
    "index_skip_topk_offset": 2,
}


@dataclasses.dataclass(frozen=True)
class Glm5NextConfig:
    """The text model's configuration, with HF's meaning for every field (docs/models.md §9)."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    layer_types: tuple[str, ...]  # per layer: KDA or DSA
    indexer_types: tuple[str, ...]  # per layer: FULL or SHARED (read on DSA layers only)
    mlp_layer_types: tuple[str, ...]  # per layer: DENSE or SPARSE
    # KDA
    linear_num_heads: int
    linear_head_dim: int  # key and value head width alike
    linear_conv_kernel_dim: int
    linear_lower_bound: float | None  # None: the unbounded softplus forget gate
    # NoPE MLA
    num_attention_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    v_head_dim: int
    # pooled DSA indexer
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    index_kpool: int
    index_kpool_always_select_tail: bool
    # hyper-connections
    hc_mult: int
    hc_eps: float
    hc_sinkhorn_iters: int
    # FFNs
    intermediate_size: int
    moe_intermediate_size: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    n_group: int
    topk_group: int
    routed_scaling_factor: float
    norm_topk_prob: bool
    swiglu_limit: float
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    num_nextn_predict_layers: int = 0  # next-n layers in the file; HF runs none (docs/models.md §9.11)
    qk_rope_head_dim: int = 0  # no position encoding anywhere in the text model
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None
    quantization: QuantConfig | None = None
    model_type: str = MODEL_TYPE

    # ---- derived quantities -------------------------------------------------------------
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        """MLA's qk_head_dim^-0.5 (no RoPE, no YaRN mscale)."""
        return self.qk_head_dim**-0.5

    @property
    def linear_dim(self) -> int:
        """Width of each of KDA's q, k, v projections (heads x head dim)."""
        return self.linear_num_heads * self.linear_head_dim

    @property
    def index_pools(self) -> int:
        """Complete key pools a query selects at most (index_topk // index_kpool)."""
        return self.index_topk // self.index_kpool

    @property
    def index_width(self) -> int:
        """Width of HF's per-query index list: the pools' tokens, plus the open pool's <= kpool - 1."""
        return self.index_topk + (self.index_kpool - 1 if self.index_kpool_always_select_tail else 0)

    def is_kda_layer(self, layer: int) -> bool:
        return self.layer_types[layer] == KDA

    def has_indexer(self, layer: int) -> bool:
        """A DSA layer that runs its own indexer; a shared one reuses the layer before's top-k."""
        return self.layer_types[layer] == DSA and self.indexer_types[layer] == FULL

    def is_moe_layer(self, layer: int) -> bool:
        return self.mlp_layer_types[layer] == SPARSE

    @property
    def kda_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == KDA)

    @property
    def dsa_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == DSA)

    @property
    def indexer_layers(self) -> tuple[int, ...]:
        """The DSA layers that run their own indexer (and keep index keys in the cache)."""
        return tuple(i for i in range(self.num_hidden_layers) if self.has_indexer(i))

    def replace(self, **changes: Any) -> Glm5NextConfig:
        return dataclasses.replace(self, **changes)

    def architecture(self) -> Glm5NextConfig:
        """Only what the math depends on (no file format, no special tokens): the static key of a
        jitted forward, so checkpoints of one architecture share one compilation."""
        return self.replace(quantization=None, bos_token_id=None, eos_token_ids=(), pad_token_id=None)


# ---------------------------------------------------------------------------------------------
# Parsing


class _Section(Fields):
    """Fields of a nested object; errors name the field with its path (``text_config.hidden_size``)."""

    def __init__(self, raw: Mapping[str, Any], source: str, prefix: str):
        super().__init__(raw, source)
        self.prefix = prefix

    def error(self, field: str, message: str) -> ConfigError:
        return ConfigError(self.source, self.prefix + field, message)

    def section(self, field: str) -> _Section | None:
        """The object under ``field`` (None when absent or null)."""
        value = self.raw.get(field)
        if value is None:
            return None
        if not isinstance(value, Mapping):
            raise self.error(field, f"expected an object, got {type(value).__name__}")
        return _Section(value, self.source, f"{self.prefix}{field}.")

    def strings(self, field: str, allowed: Sequence[str]) -> list[str] | None:
        """A list of strings from ``allowed`` (None when absent or null)."""
        value = self.raw.get(field)
        if value is None:
            return None
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise self.error(field, f"expected a list of strings, got {value!r}")
        if bad := sorted({v for v in value if v not in allowed}):
            raise self.error(field, f"unknown entries {bad}; allowed {list(allowed)}")
        return value

    def hf(self, field: str, kind: type = int, *, positive: bool = True) -> Any:
        """``field``, or HF's default when the file omits it."""
        return self.get(field, kind, HF_TEXT_DEFAULTS[field], positive=positive)


def _text_section(top: _Section) -> _Section:
    """The text model's fields: ``text_config``, or the top level of a flat file."""
    text = top.section("text_config")
    if text is None:
        return top
    if (kind := text.raw.get("model_type", TEXT_MODEL_TYPE)) != TEXT_MODEL_TYPE:
        raise text.error("model_type", f"{kind!r} is not {TEXT_MODEL_TYPE!r}")
    return text


def _layer_types(f: _Section, n: int) -> tuple[str, ...]:
    """Per-layer KDA / DSA, and the release's kda_layers / full_attn_layers that HF ignores."""
    given = f.strings("layer_types", (KDA, *DSA_SPELLINGS))
    if given is None:
        types = tuple(DSA if i % HF_DSA_EVERY == HF_DSA_EVERY - 1 else KDA for i in range(n))
    elif len(given) != n:
        raise f.error("layer_types", f"{len(given)} entries for {n} layers (num_hidden_layers)")
    else:
        types = tuple(KDA if t == KDA else DSA for t in given)
    if (lin := f.section("linear_attn_config")) is not None:
        for key, kind in (("kda_layers", KDA), ("full_attn_layers", DSA)):
            if (layers := lin.raw.get(key)) is None:
                continue
            want = [i for i, t in enumerate(types) if t == kind]
            ints = isinstance(layers, list) and all(type(i) is int for i in layers)
            if not ints or sorted(layers) != want:
                raise lin.error(key, f"{layers!r} contradicts layer_types ({kind} at {want}, 0-based)")
    return types


def _mlp_layer_types(f: _Section, n: int) -> tuple[str, ...]:
    given = f.strings("mlp_layer_types", (DENSE, SPARSE))
    dense = min(HF_DENSE_LAYERS, n)
    if given is None:
        types = (DENSE,) * dense + (SPARSE,) * (n - dense)
    elif len(given) != n:
        raise f.error("mlp_layer_types", f"{len(given)} entries for {n} layers (num_hidden_layers)")
    else:
        types = tuple(given)
    if f.raw.get("first_k_dense_replace") is not None:
        k = f.get("first_k_dense_replace", int)
        if types != (DENSE,) * k + (SPARSE,) * (n - k):
            where = "mlp_layer_types" if given is not None else f"HF's default ({dense} dense layers)"
            raise f.error("first_k_dense_replace", f"{k} contradicts {where}; HF reads only mlp_layer_types")
    return types


def _indexer_types(f: _Section, layer_types: tuple[str, ...], mtp: int) -> tuple[str, ...]:
    """Per-layer full / shared, HF's way: indexer_types, else index_topk_pattern, else the
    index_topk_freq / index_skip_topk_offset rule (default: every layer full)."""
    n = len(layer_types)
    field = "indexer_types"
    types = f.strings(field, (FULL, SHARED))
    if types is None and (pattern := f.raw.get("index_topk_pattern")) is not None:
        field, lookup = "index_topk_pattern", {"F": FULL, "S": SHARED}
        if not isinstance(pattern, str):
            types = f.strings(field, (FULL, SHARED))
        elif set(pattern) <= set(lookup):
            types = [lookup[c] for c in pattern]
        else:
            raise f.error(field, f"only 'F' (full) and 'S' (shared) letters, got {pattern!r}")
    if types is None:
        freq = max(f.hf("index_topk_freq", positive=False), 1)
        offset = f.hf("index_skip_topk_offset", positive=False)
        types = [FULL if max(i - offset + 1, 0) % freq == 0 else SHARED for i in range(n)]
    if len(types) not in (n, n + mtp):
        raise f.error(field, f"{len(types)} entries for {n} layers (num_hidden_layers)")
    types = tuple(types[:n])  # entries past the main layers describe next-n layers
    for i, (kind, mode) in enumerate(zip(layer_types, types)):
        after_full = i > 0 and layer_types[i - 1] == DSA and types[i - 1] == FULL
        if kind == DSA and mode == SHARED and not after_full:
            before = f"layer {i - 1} is not a DSA layer with its own indexer" if i else "no layer precedes it"
            raise f.error(
                field,
                f"layer {i} is a shared DSA layer, but {before}: HF hands a shared layer only the top-k "
                "of the layer right before it",
            )
    return types


def _linear_attention(f: _Section) -> tuple[int, int, int, float | None]:
    """(heads, head dim, conv kernel, gate lower bound): the top-level linear_* fields, overridden
    by linear_attn_config as HF does; the two must agree where both are given."""
    values: dict[str, Any] = {
        "linear_num_heads": f.hf("linear_num_heads"),
        "linear_head_dim": f.hf("linear_head_dim"),
        "linear_conv_kernel_dim": f.hf("linear_conv_kernel_dim"),
    }
    bound_field = "linear_lower_bound"
    bound = f.get(bound_field, float, None) if bound_field in f.raw else HF_TEXT_DEFAULTS[bound_field]
    if (lin := f.section("linear_attn_config")) is not None:
        for key, name in (
            ("num_heads", "linear_num_heads"),
            ("head_dim", "linear_head_dim"),
            ("short_conv_kernel_size", "linear_conv_kernel_dim"),
        ):
            if lin.raw.get(key) is not None:
                value = lin.get(key, int, positive=True)
                if f.raw.get(name) is not None and value != values[name]:
                    raise lin.error(key, f"{value} contradicts {name} {values[name]}")
                values[name] = value
        if "gate_lower_bound" in lin.raw:
            value = lin.get("gate_lower_bound", float, None)
            if bound_field in f.raw and value != bound:
                raise lin.error("gate_lower_bound", f"{value} contradicts {bound_field} {bound}")
            bound = value
        if lin.get("safe_gate", bool, True) and bound is None:
            bound = HF_TEXT_DEFAULTS[bound_field]  # HF: a safe gate without a bound gets -5
    if bound is not None and bound >= 0:
        raise f.error(bound_field, f"must be < 0 (a bound on the log decay), got {bound}")
    return values["linear_num_heads"], values["linear_head_dim"], values["linear_conv_kernel_dim"], bound


def _require(f: _Section, field: str, want: Any, why: str) -> None:
    if field in f.raw and f.raw[field] != want:
        raise f.error(field, f"{f.raw[field]!r}: {why}")


def _check_unsupported(f: _Section) -> None:
    """Keys HF reads as one fixed value (or not at all) must not ask for another."""
    _require(f, "hidden_act", "silu", "HF's experts hard-code silu")
    _require(f, "attention_bias", False, "the release has no attention bias; jaxdsa runs none")
    _require(f, "scoring_func", "sigmoid", "HF's router scores with a sigmoid")
    _require(f, "topk_method", "noaux_tc", "HF's router is noaux_tc")
    _require(f, "mhc", True, "HF always runs hyper-connections")
    _require(f, "mla_use_nope", True, "HF's MLA has no position encoding")
    _require(f, "index_kpool_compress", True, "HF's indexer always pools its keys")
    if f.raw.get("q_lora_rank", 0) is None:
        raise f.error("q_lora_rank", "null: HF's DSA attention requires a query LoRA")


def _token_ids(top: _Section, f: _Section, vocab: int) -> tuple[int | None, tuple[int, ...], int | None]:
    """(bos, eos ids, pad): the text config's, else the top level's; pad only from the text config,
    the embedding's padding_idx."""
    bos_from = f if f.raw.get("bos_token_id") is not None else top
    eos_from = f if f.raw.get("eos_token_id") is not None else top
    pad = f.get("pad_token_id", int, None) if "pad_token_id" in f.raw else HF_TEXT_DEFAULTS["pad_token_id"]
    if pad is not None and not 0 <= pad < vocab:
        raise f.error("pad_token_id", f"{pad} is outside the {vocab}-token vocabulary (HF's padding_idx)")
    return bos_from.get("bos_token_id", int, None), eos_ids(eos_from), pad


def _tie_word_embeddings(top: _Section, f: _Section) -> bool:
    """Glm5NextForConditionalGeneration ties by the top-level flag; the text config's must agree."""
    tie = top.get("tie_word_embeddings", bool, False)
    if f is not top and f.raw.get("tie_word_embeddings") is not None:
        if f.get("tie_word_embeddings", bool) != tie:
            raise f.error("tie_word_embeddings", f"contradicts the top-level {tie}, which HF ties by")
    return tie


def parse_config(raw: Mapping[str, Any], source: str = "<dict>") -> Glm5NextConfig:
    """Parse a GLM-5.3-Flash ``config.json`` dict (either form); ``source`` names it in errors."""
    top = _Section(raw, source, "")
    if (model_type := top.get("model_type", str)) != MODEL_TYPE:
        raise top.error("model_type", f"{model_type!r} is not {MODEL_TYPE!r}")
    f = _text_section(top)
    _check_unsupported(f)
    n = f.hf("num_hidden_layers")
    mtp = f.get("num_nextn_predict_layers", int, 0)
    if mtp < 0:
        raise f.error("num_nextn_predict_layers", f"must be >= 0, got {mtp}")
    layer_types = _layer_types(f, n)
    heads, head_dim, kernel, bound = _linear_attention(f)
    vocab = f.hf("vocab_size")
    bos, eos, pad = _token_ids(top, f, vocab)
    cfg = Glm5NextConfig(
        vocab_size=vocab,
        hidden_size=f.hf("hidden_size"),
        num_hidden_layers=n,
        layer_types=layer_types,
        indexer_types=_indexer_types(f, layer_types, mtp),
        mlp_layer_types=_mlp_layer_types(f, n),
        linear_num_heads=heads,
        linear_head_dim=head_dim,
        linear_conv_kernel_dim=kernel,
        linear_lower_bound=bound,
        num_attention_heads=f.hf("num_attention_heads"),
        q_lora_rank=f.hf("q_lora_rank"),
        kv_lora_rank=f.hf("kv_lora_rank"),
        qk_nope_head_dim=f.hf("qk_nope_head_dim"),
        v_head_dim=f.hf("v_head_dim"),
        index_n_heads=f.hf("index_n_heads"),
        index_head_dim=f.hf("index_head_dim"),
        index_topk=f.hf("index_topk"),
        index_kpool=f.hf("index_kpool"),
        index_kpool_always_select_tail=f.hf("index_kpool_always_select_tail", bool),
        hc_mult=f.hf("hc_mult"),
        hc_eps=f.hf("hc_eps", float),
        hc_sinkhorn_iters=f.hf("hc_sinkhorn_iters"),
        intermediate_size=f.hf("intermediate_size"),
        moe_intermediate_size=f.hf("moe_intermediate_size"),
        n_routed_experts=f.hf("n_routed_experts"),
        n_shared_experts=f.hf("n_shared_experts", positive=False),
        num_experts_per_tok=f.hf("num_experts_per_tok"),
        n_group=f.hf("n_group"),
        topk_group=f.hf("topk_group"),
        routed_scaling_factor=f.hf("routed_scaling_factor", float),
        norm_topk_prob=f.hf("norm_topk_prob", bool),
        swiglu_limit=f.hf("swiglu_limit", float),
        rms_norm_eps=f.hf("rms_norm_eps", float),
        max_position_embeddings=f.hf("max_position_embeddings"),
        tie_word_embeddings=_tie_word_embeddings(top, f),
        num_nextn_predict_layers=mtp,
        qk_rope_head_dim=f.get("qk_rope_head_dim", int, 0, positive=False),
        bos_token_id=bos,
        eos_token_ids=eos,
        pad_token_id=pad,
        quantization=parse_quantization(top),
    )
    _check_consistency(cfg, f)
    return cfg


def _check_consistency(c: Glm5NextConfig, f: _Section) -> None:
    """HF's validate_architecture, and what its modules need to build and run."""
    if c.qk_rope_head_dim != 0:
        raise f.error("qk_rope_head_dim", f"{c.qk_rope_head_dim}: HF's GLM-5.3-Flash MLA is NoPE (0)")
    if f.raw.get("qk_head_dim") is not None and f.get("qk_head_dim", int) != c.qk_head_dim:
        raise f.error("qk_head_dim", f"{f.raw['qk_head_dim']} is not qk_nope_head_dim + qk_rope_head_dim")
    kv_heads = f.get("num_key_value_heads", int, c.num_attention_heads, positive=True)
    if kv_heads != c.num_attention_heads:
        raise f.error("num_key_value_heads", f"{kv_heads} != num_attention_heads {c.num_attention_heads}")
    if c.n_shared_experts < 0:
        raise f.error("n_shared_experts", f"must be >= 0, got {c.n_shared_experts}")
    if c.index_topk % c.index_kpool:
        raise f.error("index_topk", f"{c.index_topk} is not a multiple of index_kpool {c.index_kpool}")
    if c.n_routed_experts % c.n_group:
        raise f.error("n_group", f"{c.n_routed_experts} experts do not split into {c.n_group} groups")
    if c.n_routed_experts // c.n_group < 2:
        raise f.error("n_group", "HF scores a group by its two best experts: groups need >= 2 experts")
    if c.topk_group > c.n_group:
        raise f.error("topk_group", f"{c.topk_group} > n_group {c.n_group}")
    if c.num_experts_per_tok > c.topk_group * (c.n_routed_experts // c.n_group):
        raise f.error(
            "num_experts_per_tok", f"{c.num_experts_per_tok} > the experts of {c.topk_group} kept groups"
        )


def load_glm5_next_config(path: str | os.PathLike) -> Glm5NextConfig:
    """Read ``config.json`` from a checkpoint directory (or the file itself)."""
    raw, file = read_config_json(path)
    return parse_config(raw, file)
