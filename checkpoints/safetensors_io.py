"""Memory-mapped reading of safetensors files, single or sharded.

The ``safetensors`` package cannot return bfloat16 or float8 tensors as NumPy arrays, so the
(simple, documented) format is read here: an 8-byte little-endian header length, a JSON header
of ``{name: {dtype, shape, data_offsets}}`` and the raw data, which ``numpy.memmap`` maps lazily
with ``ml_dtypes`` for bf16 / fp8. Nothing is read until a tensor is sliced.
"""

from __future__ import annotations

import json
import os
import struct
from functools import cached_property

import ml_dtypes
import numpy as np

from checkpoints.errors import CheckpointError

DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "F8_E8M0": np.dtype(ml_dtypes.float8_e8m0fnu),
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}

INDEX_FILE = "model.safetensors.index.json"


class SafetensorsFile:
    """One ``.safetensors`` file: header parsed eagerly, tensors mapped on demand."""

    def __init__(self, path: str):
        self.path = path
        size = os.path.getsize(path)
        with open(path, "rb") as fh:
            raw = fh.read(8)
            if len(raw) < 8:
                raise CheckpointError(path, "<header>", "file too short to hold a safetensors header")
            (header_len,) = struct.unpack("<Q", raw)
            if header_len > size - 8:
                raise CheckpointError(
                    path,
                    "<header>",
                    f"header of {header_len} bytes exceeds the file ({size} bytes): truncated?",
                )
            try:
                header = json.loads(fh.read(header_len))
            except (UnicodeDecodeError, json.JSONDecodeError) as e:
                raise CheckpointError(path, "<header>", f"unreadable header: {e}") from None
        header.pop("__metadata__", None)
        self._data_start = 8 + header_len
        self._entries = header
        for name, entry in header.items():
            if entry.get("dtype") not in DTYPES:
                raise CheckpointError(path, name, f"unsupported dtype {entry.get('dtype')!r}")
            begin, end = entry["data_offsets"]
            expected = int(np.prod(entry["shape"], dtype=np.int64)) * DTYPES[entry["dtype"]].itemsize
            if end - begin != expected:
                raise CheckpointError(
                    path, name, f"holds {end - begin} bytes, shape {entry['shape']} needs {expected}"
                )
            if self._data_start + end > size:
                raise CheckpointError(
                    path,
                    name,
                    f"ends at byte {self._data_start + end} but the file has {size} bytes: truncated",
                )

    def keys(self) -> list[str]:
        return list(self._entries)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._entries[name]["shape"])

    def dtype(self, name: str) -> np.dtype:
        return DTYPES[self._entries[name]["dtype"]]

    @cached_property
    def _mmap(self) -> np.memmap:
        return np.memmap(self.path, dtype=np.uint8, mode="r")

    def get(self, name: str) -> np.ndarray:
        """A read-only, lazily mapped view of the tensor."""
        entry = self._entries[name]
        begin, end = entry["data_offsets"]
        buf = self._mmap[self._data_start + begin : self._data_start + end]
        return buf.view(self.dtype(name)).reshape(entry["shape"])


class CheckpointReader:
    """All tensors of a checkpoint directory: ``model.safetensors`` or a sharded index."""

    def __init__(self, directory: str):
        self.directory = directory
        index = os.path.join(directory, INDEX_FILE)
        if os.path.exists(index):
            try:
                with open(index, encoding="utf-8") as fh:
                    weight_map = json.load(fh)["weight_map"]
            except (KeyError, json.JSONDecodeError) as e:
                raise CheckpointError(index, "weight_map", f"unreadable index: {e}") from None
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(f for f in os.listdir(directory) if f.endswith(".safetensors"))
            if not files:
                raise CheckpointError(
                    directory, "*", "no .safetensors files and no model.safetensors.index.json"
                )
            weight_map = None
        self._files = {}
        for f in files:
            path = os.path.join(directory, f)
            if not os.path.exists(path):
                raise CheckpointError(path, "*", f"listed in {INDEX_FILE} but missing")
            self._files[f] = SafetensorsFile(path)
        self._where: dict[str, SafetensorsFile] = {}
        for _f, st in self._files.items():
            for name in st.keys():
                self._where[name] = st
        if weight_map is not None:
            for name, f in weight_map.items():
                if self._where.get(name) is not self._files[f]:
                    raise CheckpointError(
                        os.path.join(directory, f), name, f"listed in {INDEX_FILE} but not in that file"
                    )

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def keys(self) -> list[str]:
        return list(self._where)

    def file_of(self, name: str) -> str:
        return self._where[name].path if name in self._where else self.directory

    def _file(self, name: str) -> SafetensorsFile:
        if name not in self._where:
            raise CheckpointError(self.directory, name, "missing from the checkpoint")
        return self._where[name]

    def shape(self, name: str) -> tuple[int, ...]:
        return self._file(name).shape(name)

    def dtype(self, name: str) -> np.dtype:
        return self._file(name).dtype(name)

    def get(self, name: str) -> np.ndarray:
        return self._file(name).get(name)
