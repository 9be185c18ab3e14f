"""NVIDIA ModelOpt's quantization configs (docs/models.md §4.8): which of them jaxdsa runs.

ModelOpt describes a checkpoint twice: ``hf_quant_config.json`` beside config.json holds its own form,
``{"quantization": {"quant_algo", "group_size", "exclude_modules", "kv_cache_quant_algo"}}``, and
config.json's ``quantization_config`` the form ModelOpt converts it to (``quant_method: modelopt``,
``quant_algo``, the group size in ``config_groups``, the exclusions under ``ignore``). vLLM reads
both; so does :func:`parse` (the nested ``quantization`` key tells them apart).

jaxdsa runs NVFP4 weights with bf16 / float32 activations (W4A16): ``NVFP4`` (whose activation
scales it reads and ignores) and ``W4A16_NVFP4`` load, every other algorithm is refused by name
through ``error``, so a checkpoint jaxdsa would compute wrongly fails before a weight is read.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from jaxdsa.checkpoints.quant import NVFP4_GROUP, QuantConfig

HF_QUANT_CONFIG = "hf_quant_config.json"  # ModelOpt's own file beside config.json
SUPPORTED = ("NVFP4", "W4A16_NVFP4")
# Why the other algorithms ModelOpt exports (vLLM's QUANT_ALGOS, ModelOpt's convert_hf_config.py) stop.
_REFUSED = {
    "MIXED_PRECISION": "a format per layer (quantized_layers) is not supported",
    "NVFP4_AWQ": "AWQ pre_quant_scale tensors are not supported",
    "NVFP4_SVD": "SVDQuant pre_quant_scale and low-rank tensors are not supported",
}

Error = Callable[[str, str], Exception]


def is_modelopt(quant_method: Any) -> bool:
    """Whether a ``quant_method`` names ModelOpt (vLLM: any lower-cased name starting 'modelopt')."""
    return isinstance(quant_method, str) and quant_method.lower().startswith("modelopt")


def parse(q: Mapping[str, Any], error: Error, prefix: str = "") -> QuantConfig:
    """A ModelOpt config dict (either form) -> the NVFP4 :class:`QuantConfig`. ``error(field,
    message)`` builds the exception for an unsupported or malformed field, ``prefix`` leads the field
    names (``"quantization_config."`` inside config.json)."""
    if "quantization" in q:  # ModelOpt's own form (hf_quant_config.json)
        inner = q["quantization"]
        if not isinstance(inner, Mapping):
            raise error(prefix + "quantization", "expected an object")
        prefix += "quantization."
        algo, group, exclude = inner.get("quant_algo"), inner.get("group_size"), inner.get("exclude_modules")
        group_field, exclude_field = prefix + "group_size", prefix + "exclude_modules"
    else:  # converted into config.json: the group size in the one config group's weights
        algo, exclude, exclude_field = q.get("quant_algo"), q.get("ignore"), prefix + "ignore"
        group, group_field = _group_size(q, error, prefix)
    _check_algo(algo, error, prefix + "quant_algo")
    group = NVFP4_GROUP if group is None else group
    if group != NVFP4_GROUP:
        raise error(group_field, f"NVFP4 scales one e4m3 per {NVFP4_GROUP} inputs, got group size {group!r}")
    exclude = [] if exclude is None else exclude
    if not isinstance(exclude, list) or not all(isinstance(p, str) for p in exclude):
        raise error(exclude_field, f"expected a list of module name patterns, got {exclude!r}")
    return QuantConfig(method="nvfp4", group_size=NVFP4_GROUP, ignore=tuple(exclude), targets=())


def _group_size(q: Mapping[str, Any], error: Error, prefix: str) -> tuple[Any, str]:
    """The weights' group size of config.json's form and its field: the one config group's, else a
    top-level ``group_size`` (what vLLM reads), else None."""
    groups = q.get("config_groups") or {}
    if not isinstance(groups, Mapping) or len(groups) > 1:
        raise error(prefix + "config_groups", "expected one group (a format per layer is not supported)")
    for name, group in groups.items():
        field = f"{prefix}config_groups.{name}.weights"
        weights = group.get("weights") if isinstance(group, Mapping) else None
        if not isinstance(weights, Mapping):
            raise error(field, "expected an object")
        if (weights.get("num_bits"), weights.get("type")) != (4, "float"):
            raise error(field, f"NVFP4 weights are 4-bit floats, got {weights}")
        if weights.get("group_size") is not None:
            return weights["group_size"], field + ".group_size"
    return q.get("group_size"), prefix + "group_size"


def _check_algo(algo: Any, error: Error, field: str) -> None:
    if not isinstance(algo, str) or not algo:
        raise error(field, f"missing or not a string: {algo!r}")
    name = algo.upper()  # vLLM upper-cases it: ModelOpt may write lower case
    if name in SUPPORTED:
        return
    why = _REFUSED.get(name, "jaxdsa runs ModelOpt checkpoints only as NVFP4 weights")
    raise error(field, f"unsupported {algo!r}: {why} (supported: {', '.join(SUPPORTED)})")
