"""What the tiny makers' tests share: reading a checkpoint back, and the checks a sharded bfloat16
checkpoint passes against its single-file float32 twin (every maker writes both alike)."""

from __future__ import annotations

import json
import pathlib

import ml_dtypes
import numpy as np
from safetensors import safe_open

Tensors = dict[str, tuple[np.ndarray, str]]


def read_tensors(path: pathlib.Path) -> Tensors:
    """name -> (value, safetensors dtype string) over all shards."""
    out = {}
    for file in sorted(path.glob("model*.safetensors")):
        with safe_open(file, framework="numpy") as f:
            out |= {n: (f.get_tensor(n), f.get_slice(n).get_dtype()) for n in f.keys()}
    return out


def check_shards_and_bfloat16(
    path: pathlib.Path, shards: int, reference: Tensors, fp32: tuple[str, ...]
) -> Tensors:
    """``path`` holds exactly ``shards`` files and their index, which names each file's tensors and
    their total size; every tensor is ``reference``'s draw: float32 as it is for names ending in one
    of ``fp32``, rounded to bfloat16 for the others. -> the sharded checkpoint's tensors."""
    files = sorted(p.name for p in path.glob("model*"))
    names = [f"model-{i:05d}-of-{shards:05d}.safetensors" for i in range(1, shards + 1)]
    assert files == names + ["model.safetensors.index.json"]
    index = json.loads((path / "model.safetensors.index.json").read_text())
    tensors = read_tensors(path)
    assert set(index["weight_map"]) == set(tensors) == set(reference)
    for file in set(index["weight_map"].values()):
        with safe_open(path / file, framework="numpy") as f:
            assert set(f.keys()) == {n for n, v in index["weight_map"].items() if v == file}
    assert index["metadata"]["total_size"] == sum(v.nbytes for v, _ in tensors.values())
    for name, (value, dtype) in tensors.items():
        want = reference[name][0]
        if name.endswith(fp32):
            assert dtype == "F32" and np.array_equal(value, want), name
        else:  # the same draw, rounded to bfloat16
            assert dtype == "BF16" and np.array_equal(value, want.astype(ml_dtypes.bfloat16)), name
    return tensors
