"""What every tiny maker shares: the random values, the JSON files and the safetensors files (one, or
K shards with ``model.safetensors.index.json``).

Values depend only on (seed, tensor name), so a tensor keeps its values whatever the dtype, sharding
or the other tensors. Scales keep activations O(1): linear weights ~ N(0, 1/fan_in), embeddings
~ N(0, 1), norm weights ~ 1 + N(0, 0.1^2), LayerNorm bias and router bias ~ N(0, 0.1^2).
"""

from __future__ import annotations

import glob
import json
import os
import zlib
from collections.abc import Callable
from typing import Any

import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16}

# (shape, kind); the kind ("linear", "embed", "norm", "bias", "router_bias", and V4's own kinds in
# jaxdsa.checkpoints.tiny.v4) says how the value is drawn.
Spec = tuple[tuple[int, ...], str]


def random_tensor(name: str, shape: tuple[int, ...], kind: str, seed: int) -> np.ndarray:
    """float32 values for one tensor, a function of (seed, name) only."""
    rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
    x = rng.standard_normal(shape, dtype=np.float32)
    if kind == "linear":
        return x / np.float32(np.sqrt(shape[1]))
    if kind == "norm":
        return 1.0 + np.float32(0.1) * x
    if kind in ("bias", "router_bias"):
        return np.float32(0.1) * x
    return x  # embed


def _shard_names(names: list[str], sizes: list[int], shards: int) -> list[list[str]]:
    """Contiguous groups of roughly equal bytes, exactly ``shards`` of them, none empty."""
    total, groups, done = sum(sizes), [], 0
    for i, (name, size) in enumerate(zip(names, sizes)):
        behind = done * shards // total >= len(groups)  # this tensor starts past the current shard's share
        must = len(names) - i == shards - len(groups)  # one tensor left per shard still to open
        if not groups or (len(groups) < shards and (behind or must)):
            groups.append([])
        groups[-1].append(name)
        done += size
    return groups


def write_weights(tensors: dict[str, np.ndarray], out_dir: str, shards: int) -> None:
    """model.safetensors, or K shards + model.safetensors.index.json (replacing any earlier ones)."""
    for stale in glob.glob(os.path.join(out_dir, "model*.safetensors*")):
        os.remove(stale)
    metadata = {"format": "pt"}  # transformers refuses safetensors without it
    if shards == 1:
        save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata=metadata)
        return
    names = list(tensors)
    weight_map = {}
    for i, group in enumerate(_shard_names(names, [tensors[n].nbytes for n in names], shards), start=1):
        file = f"model-{i:05d}-of-{shards:05d}.safetensors"
        save_file({n: tensors[n] for n in group}, os.path.join(out_dir, file), metadata=metadata)
        weight_map |= {n: file for n in group}
    index = {"metadata": {"total_size": sum(t.nbytes for t in tensors.values())}, "weight_map": weight_map}
    write_json(os.path.join(out_dir, "model.safetensors.index.json"), index)


def write_drawn(
    specs: dict[str, Spec],
    draw: Callable[[str, tuple[int, ...], str], np.ndarray],
    out_dir: str,
    *,
    dtype: str,
    shards: int,
    fp32_kinds: tuple[str, ...],
) -> None:
    """Every tensor of ``specs`` drawn by ``draw(name, shape, kind)`` and written (:func:`write_weights`):
    float32 draws stored in ``dtype`` but the ``fp32_kinds`` (what HF keeps float32), other draws
    (DeepSeek-V4's int64 ``tid2eid``) as they are. The makers without quantized tensors share it."""
    tensors = {}
    for name, (shape, kind) in specs.items():
        value = draw(name, shape, kind)
        if value.dtype == np.float32:
            value = value.astype(np.float32 if kind in fp32_kinds else DTYPES[dtype])
        tensors[name] = value
    write_weights(tensors, out_dir, shards)


def write_json(path: str, obj: Any) -> None:
    """``obj`` as indented UTF-8 JSON ending in a newline."""
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(obj, fh, indent=2, ensure_ascii=False)
        fh.write("\n")
