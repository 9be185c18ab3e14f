"""NVIDIA ModelOpt NVFP4 in torch, written from the format's definition (docs/models.md §4.8), for the
``glm5_nvfp4`` golden fixture of ``make_goldens.py`` (reference venv; ModelOpt itself is not
installable there). Nothing of the jaxdsa package is imported.

- quantize (ModelOpt's ``NVFP4QTensor``): ``g = amax / (6 * 448)``; per 16 inputs of a row
  ``s = e4m3(max(block_amax / (6 g), 2^-9))`` (1 for an all-zero block); codes the nearest e2m1 values
  of ``w / (fp32(s) g)`` by ModelOpt's midpoint search (ties to even), sign in bit 3; bytes
  ``(q[:, 1::2] << 4) | q[:, 0::2]``;
- dequantize: ``e2m1(q) * (fp32(s) * g)``, the block's product rounded to float32 first;
- the configs: config.json's ``quantization_config`` (ModelOpt's ``convert_hf_quant_config_format``)
  and ``hf_quant_config.json``; exclusions are ``fnmatch`` wildcards on a module and its parents.
"""

from __future__ import annotations

import fnmatch
from typing import Any

import torch

GROUP = 16
E2M1_VALUES = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6])
E2M1_MIDPOINTS = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
ROUND_UP_AT = torch.tensor([0.75, 1.75, 3.5])  # midpoints whose upper neighbour has the even mantissa
PRODUCER = {"name": "modelopt", "version": "0.40.0"}


def quantizes(module: str, exclude: list[str]) -> bool:
    """Whether ``module`` is quantized under the exclusion wildcards (it or a parent matching one is not)."""
    parts = module.split(".")
    names = [".".join(parts[:i]) for i in range(1, len(parts) + 1)]
    return not any(fnmatch.fnmatchcase(name, p) for name in names for p in exclude)


def e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    """The nearest e2m1 code (uint8 0..15) of each float32 value in [-6, 6], ties to the even mantissa."""
    magnitude = x.abs()
    code = torch.searchsorted(E2M1_MIDPOINTS, magnitude.contiguous(), right=False)
    code = code + (magnitude.unsqueeze(-1) == ROUND_UP_AT).any(-1)
    return (code | ((x < 0).long() << 3)).to(torch.uint8)


def quantize(w: torch.Tensor) -> dict[str, torch.Tensor]:
    """``[out, in]`` float32 -> ``weight`` uint8 ``[out, in / 2]``, ``weight_scale`` float8_e4m3fn
    ``[out, in / 16]``, ``weight_scale_2`` and ``input_scale`` float32 scalars (the latter a W4A4
    checkpoint's activation scale: 1 here; jaxdsa ignores it)."""
    w = w.to(torch.float32)
    out, inp = w.shape
    g = w.abs().amax() / (6.0 * 448.0)
    blocks = w.reshape(out, inp // GROUP, GROUP)
    s = blocks.abs().amax(-1) / (6.0 * g)
    s = torch.where(s == 0, torch.ones_like(s), s).clamp(min=2.0**-9).to(torch.float8_e4m3fn)
    scaled = blocks / (s.to(torch.float32) * g).unsqueeze(-1)
    q = e2m1_codes(scaled.clamp(-6.0, 6.0)).reshape(out, inp)
    return {
        "weight": (q[:, 1::2] << 4) | q[:, 0::2],
        "weight_scale": s,
        "weight_scale_2": g.reshape(()),
        "input_scale": torch.tensor(1.0),
    }


def dequantize(t: dict[str, torch.Tensor], *, global_scale: torch.Tensor | None = None) -> torch.Tensor:
    """The float32 ``[out, in]`` weight of an NVFP4 linear's tensors; ``global_scale`` replaces its
    ``weight_scale_2`` (what a loader that takes another matrix's scale computes)."""
    packed = t["weight"]
    codes = torch.stack([packed & 0xF, packed >> 4], dim=-1).reshape(packed.shape[0], -1).long()
    g = t["weight_scale_2"] if global_scale is None else global_scale
    block = t["weight_scale"].to(torch.float32) * g.to(torch.float32)
    return E2M1_VALUES[codes] * block.repeat_interleave(GROUP, dim=1)


def dequantize_folded(t: dict[str, torch.Tensor]) -> torch.Tensor:
    """The weight with its global scale folded into the e4m3 block scales (``e4m3(fp32(s) * g)``): what
    a loader that keeps one scale per block would compute. Not the format (a sensitivity probe)."""
    folded = (t["weight_scale"].to(torch.float32) * t["weight_scale_2"]).to(torch.float8_e4m3fn)
    return dequantize({**t, "weight_scale": folded, "weight_scale_2": torch.tensor(1.0)})


def dequantize_nibbles_swapped(t: dict[str, torch.Tensor]) -> torch.Tensor:
    """The weight read with the high nibble as the even column (the wrong order; a sensitivity probe)."""
    swapped = (t["weight"] << 4) | (t["weight"] >> 4)
    return dequantize({**t, "weight": swapped})


def quantization_config(exclude: list[str]) -> dict[str, Any]:
    """config.json's ``quantization_config``, as ModelOpt's ``convert_hf_quant_config_format`` writes it."""
    fields = {"dynamic": False, "num_bits": 4, "type": "float", "group_size": GROUP}
    return {
        "config_groups": {"group_0": {"input_activations": fields, "weights": fields, "targets": ["Linear"]}},
        "ignore": list(exclude),
        "producer": PRODUCER,
        "quant_algo": "NVFP4",
        "quant_method": "modelopt",
    }


def hf_quant_config(exclude: list[str]) -> dict[str, Any]:
    """``hf_quant_config.json`` (ModelOpt's own form)."""
    return {
        "producer": PRODUCER,
        "quantization": {
            "quant_algo": "NVFP4",
            "kv_cache_quant_algo": None,
            "group_size": GROUP,
            "exclude_modules": list(exclude),
        },
    }
