"""Configuration primitives shared by every model family.

A family parses its own ``config.json`` fields (``jaxdsa/models/<family>/config.py``) with these:
:class:`Fields` for typed access where every problem is a :class:`ConfigError` naming the file and
the field (so a bad checkpoint directory fails before any weight is read), the RoPE and
quantization sections that several families share, and :func:`read_config_json`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Mapping
from typing import Any

from jaxdsa.checkpoints import modelopt
from jaxdsa.checkpoints.quant import QuantConfig


class ConfigError(ValueError):
    """A config.json that jaxdsa cannot run: unknown model type, missing or contradictory field."""

    def __init__(self, source: str, field: str | None, message: str):
        """``field`` None: the file as a whole (missing, not JSON)."""
        self.source, self.field = source, field
        super().__init__(f"{source}: field '{field}': {message}" if field else f"{source}: {message}")


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    """RoPE frequencies; ``type`` is 'default' or 'yarn' (HF ``rope_parameters`` semantics)."""

    theta: float
    type: str = "default"
    factor: float = 1.0
    original_max_position_embeddings: int | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_attention_factor(rope: RopeConfig) -> float:
    """The factor HF multiplies cos/sin with for YaRN (1.0 for default RoPE)."""
    if rope.type == "default":
        return 1.0
    if rope.attention_factor is not None:
        return rope.attention_factor
    if rope.mscale and rope.mscale_all_dim:
        return yarn_mscale(rope.factor, rope.mscale) / yarn_mscale(rope.factor, rope.mscale_all_dim)
    return yarn_mscale(rope.factor)


class Fields:
    """Typed access to a config dict; every problem names the file and the field."""

    def __init__(self, raw: Mapping[str, Any], source: str):
        self.raw, self.source = raw, source

    def error(self, field: str, message: str) -> ConfigError:
        return ConfigError(self.source, field, message)

    def get(self, field: str, kind: type, default: Any = dataclasses.MISSING, *, positive: bool = False):
        if field not in self.raw or self.raw[field] is None:
            if default is dataclasses.MISSING:
                raise self.error(field, "missing (required)")
            return default
        value = self.raw[field]
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if kind is int and isinstance(value, float) and value.is_integer():
            value = int(value)
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise self.error(field, f"expected {kind.__name__}, got {type(value).__name__} {value!r}")
        if positive and value <= 0:
            raise self.error(field, f"must be > 0, got {value!r}")
        return value


def parse_rope(f: Fields) -> RopeConfig:
    # transformers v5 writes `rope_parameters` (theta inside); older configs use rope_theta + rope_scaling.
    params = f.raw.get("rope_parameters") or {}
    scaling = f.raw.get("rope_scaling") or {}
    for name, value in (("rope_parameters", params), ("rope_scaling", scaling)):
        if not isinstance(value, dict):
            raise f.error(name, f"expected an object, got {type(value).__name__}")
    merged = {**scaling, **params}
    field = "rope_parameters" if params else "rope_scaling"
    theta = merged.get("rope_theta", f.raw.get("rope_theta"))
    if theta is None:
        raise f.error("rope_theta", "missing (neither rope_theta nor rope_parameters.rope_theta is set)")
    kind = merged.get("rope_type", merged.get("type", "default"))
    if kind not in ("default", "yarn"):
        raise f.error(f"{field}.rope_type", f"unsupported RoPE type {kind!r} (default or yarn)")
    if kind == "default":
        return RopeConfig(theta=float(theta))
    if "factor" not in merged:
        raise f.error(f"{field}.factor", "missing for yarn")
    orig = merged.get("original_max_position_embeddings", f.raw.get("max_position_embeddings"))
    return RopeConfig(
        theta=float(theta),
        type="yarn",
        factor=float(merged["factor"]),
        original_max_position_embeddings=int(orig),
        beta_fast=float(merged.get("beta_fast") or 32),
        beta_slow=float(merged.get("beta_slow") or 1),
        mscale=merged.get("mscale"),
        mscale_all_dim=merged.get("mscale_all_dim"),
        attention_factor=merged.get("attention_factor"),
        truncate=bool(merged.get("truncate", True)),
    )


def parse_quantization(f: Fields) -> QuantConfig | None:
    q = f.raw.get("quantization_config")
    if q is None:
        return None
    if not isinstance(q, dict):
        raise f.error("quantization_config", "expected an object")
    method = q.get("quant_method")
    if method == "fp8":
        block = tuple(q.get("weight_block_size") or (128, 128))
        if len(block) != 2 or any(int(b) <= 0 for b in block):
            raise f.error("quantization_config.weight_block_size", f"expected two positive ints, got {block}")
        fmt = q.get("fmt", "e4m3")
        if fmt != "e4m3":
            raise f.error("quantization_config.fmt", f"only e4m3 fp8 checkpoints are supported, got {fmt!r}")
        return QuantConfig(method="fp8", weight_block_size=(int(block[0]), int(block[1])))
    if method == "compressed-tensors":
        fmt = q.get("format")
        if fmt != "pack-quantized":
            raise f.error("quantization_config.format", f"only 'pack-quantized' is supported, got {fmt!r}")
        groups = q.get("config_groups") or {}
        if len(groups) != 1:
            raise f.error(
                "quantization_config.config_groups", f"expected exactly one group, got {len(groups)}"
            )
        (group,) = groups.values()
        weights = group.get("weights") or {}
        bits, strategy = weights.get("num_bits"), weights.get("strategy", "group")
        if bits != 4 or weights.get("type", "int") != "int":
            raise f.error(
                "quantization_config.config_groups.weights", f"only 4-bit int weights, got {weights}"
            )
        if strategy != "group" or not weights.get("group_size"):
            raise f.error(
                "quantization_config.config_groups.weights.group_size", "group strategy with a size"
            )
        targets = group.get("targets") or ["Linear"]
        if not isinstance(targets, list) or not all(isinstance(t, str) for t in targets):
            raise f.error(
                "quantization_config.config_groups.targets", f"expected a list of strings, got {targets}"
            )
        return QuantConfig(
            method="compressed-tensors",
            num_bits=4,
            group_size=int(weights["group_size"]),
            symmetric=bool(weights.get("symmetric", True)),
            ignore=tuple(q.get("ignore") or ()),
            targets=tuple(targets),
        )
    if modelopt.is_modelopt(method):
        return modelopt.parse(q, f.error, "quantization_config.")
    raise f.error(
        "quantization_config.quant_method", f"unsupported {method!r} (fp8, compressed-tensors or modelopt)"
    )


def eos_ids(f: Fields) -> tuple[int, ...]:
    eos = f.raw.get("eos_token_id")
    if eos is None:
        return ()
    eos = eos if isinstance(eos, list) else [eos]
    if not all(isinstance(e, int) and not isinstance(e, bool) for e in eos):
        raise f.error("eos_token_id", f"expected int or list of ints, got {eos!r}")
    return tuple(eos)


def read_config_json(path: str | os.PathLike) -> tuple[dict[str, Any], str]:
    """``config.json`` of a checkpoint directory (or the file itself) -> (raw dict, file path).

    A config.json without ``quantization_config`` beside ModelOpt's ``hf_quant_config.json``
    (docs/models.md §4.8) takes that file's content as its ``quantization_config``, checked first so
    that an error names hf_quant_config.json and its field; config.json's own section wins."""
    path = os.fspath(path)
    file = os.path.join(path, "config.json") if os.path.isdir(path) else path
    raw = _json_object(file)
    side = os.path.join(os.path.dirname(file), modelopt.HF_QUANT_CONFIG)
    if raw.get("quantization_config") is None and os.path.isfile(side):
        quant = _json_object(side)
        modelopt.parse(quant, lambda field, message: ConfigError(side, field, message))
        raw = {**raw, "quantization_config": {"quant_method": "modelopt", **quant}}
    return raw, file


def _json_object(file: str) -> dict[str, Any]:
    try:
        with open(file, encoding="utf-8") as fh:
            raw = json.load(fh)
    except FileNotFoundError:
        raise ConfigError(file, None, "file not found") from None
    except json.JSONDecodeError as e:
        raise ConfigError(file, None, f"invalid JSON: {e}") from None
    if not isinstance(raw, dict):
        raise ConfigError(file, None, "the top level must be a JSON object")
    return raw
