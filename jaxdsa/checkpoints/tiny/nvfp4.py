"""Tiny checkpoints stored as NVIDIA ModelOpt NVFP4 (``make_tiny --quant nvfp4``; docs/models.md §4.8).

:func:`quantize` follows ModelOpt's ``NVFP4QTensor`` (``get_weights_scaling_factor_2``,
``get_weights_scaling_factor``, ``quantize``) in float32 NumPy: the global scale ``g = amax / (6 *
448)``, per 16 inputs of a row an e4m3 scale ``block_amax / (6 g)`` (1 for an all-zero block, at
least 2^-9), codes the nearest e2m1 values of ``w / (fp32(s) g)`` (ties to even), packed two per
byte with the even column in the low nibble. It stands in for ModelOpt, which jaxdsa does not
depend on; the goldens of ``tests/reference`` quantize with their own torch implementation, and
the loader is tested against both through the format's decoder.
"""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np

from jaxdsa.checkpoints.quant import NVFP4_GROUP

E2M1_MAX, E4M3_MAX = 6.0, 448.0
EXCLUDE = ["lm_head"]  # as ModelOpt's exports: the head stays bf16 (routers are not Linears: never quantized)


def quantization_config() -> dict[str, Any]:
    """config.json's ``quantization_config`` as ModelOpt's ``convert_hf_quant_config_format`` writes it."""
    fields = {"dynamic": False, "num_bits": 4, "type": "float", "group_size": NVFP4_GROUP}
    return {
        "config_groups": {"group_0": {"input_activations": fields, "weights": fields, "targets": ["Linear"]}},
        "ignore": list(EXCLUDE),
        "producer": {"name": "modelopt", "version": "0.40.0"},
        "quant_algo": "NVFP4",
        "quant_method": "modelopt",
    }


def hf_quant_config() -> dict[str, Any]:
    """``hf_quant_config.json``, ModelOpt's own form of the same."""
    return {
        "producer": {"name": "modelopt", "version": "0.40.0"},
        "quantization": {
            "quant_algo": "NVFP4",
            "kv_cache_quant_algo": None,
            "group_size": NVFP4_GROUP,
            "exclude_modules": list(EXCLUDE),
        },
    }


def quantizes(name: str) -> bool:
    """Whether the tiny maker stores the linear weight ``name`` (``X.weight``) as NVFP4."""
    return name.endswith(".weight") and not name.endswith("mlp.gate.weight") and name != "lm_head.weight"


def quantize(w: np.ndarray) -> dict[str, np.ndarray]:
    """A ``[out, in]`` weight (in a multiple of 16) -> its ``weight``, ``weight_scale``,
    ``weight_scale_2`` and ``input_scale`` tensors (the last a W4A4 checkpoint's activation scale: a
    fixed 1.0 here, which jaxdsa reads and ignores)."""
    w = np.asarray(w, np.float32)
    out, inp = w.shape
    amax = np.abs(w).max()
    g = np.float32(amax / np.float32(E2M1_MAX * E4M3_MAX)) if amax > 0 else np.float32(1.0)
    blocks = w.reshape(out, inp // NVFP4_GROUP, NVFP4_GROUP)
    s = np.abs(blocks).max(axis=-1) / (np.float32(E2M1_MAX) * g)
    s = np.where(s == 0, np.float32(1.0), s)
    s = np.clip(s, np.float32(2.0**-9), np.float32(E4M3_MAX)).astype(ml_dtypes.float8_e4m3fn)
    scaled = blocks / (s.astype(np.float32) * g)[..., None]
    e2m1 = np.clip(scaled, -E2M1_MAX, E2M1_MAX).astype(ml_dtypes.float4_e2m1fn)  # nearest, ties to even
    codes = (e2m1.view(np.uint8) & 0xF).reshape(out, inp)
    return {
        "weight": codes[:, 0::2] | (codes[:, 1::2] << 4),
        "weight_scale": s,
        "weight_scale_2": np.asarray(g, np.float32),
        "input_scale": np.asarray(1.0, np.float32),
    }
