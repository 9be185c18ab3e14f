"""Memory-mapped reading of safetensors files, single or sharded.

The ``safetensors`` package cannot return bfloat16 or float8 tensors as NumPy arrays, so the
(simple, documented) format is read here: an 8-byte little-endian header length, a JSON header
of ``{name: {dtype, shape, data_offsets}}`` and the raw data, which ``numpy.memmap`` maps lazily
with ``ml_dtypes`` for bf16 / fp8. Nothing is read until a tensor is sliced.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Callable
from functools import cached_property

import ml_dtypes
import numpy as np

from jaxdsa.checkpoints.errors import CheckpointError

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


def _checked_entries(path: str, header, data_size: int) -> dict[str, dict]:
    """The header's tensor entries, each checked against the format (a JSON object of ``{name:
    {"dtype", "shape", "data_offsets"}}``, offsets inside the data and not overlapping), so that
    a malformed header is a :class:`CheckpointError` naming the file and the tensor rather than a
    KeyError or TypeError later."""
    if not isinstance(header, dict):
        raise CheckpointError(
            path, "<header>", f"the header is a JSON {type(header).__name__}, not an object"
        )
    metadata = header.get("__metadata__", {})
    if not isinstance(metadata, dict):
        raise CheckpointError(path, "__metadata__", "must be an object of strings")
    entries = {name: entry for name, entry in header.items() if name != "__metadata__"}
    for name, entry in entries.items():
        _check_entry(path, name, entry, data_size)
    spans = sorted((e["data_offsets"][0], e["data_offsets"][1], n) for n, e in entries.items())
    for (_, end, before), (begin, _, name) in zip(spans, spans[1:]):
        if begin < end:
            raise CheckpointError(path, name, f"its bytes overlap those of '{before}' (data_offsets)")
    return entries


def _check_entry(path: str, name: str, entry, data_size: int) -> None:
    if not isinstance(entry, dict):
        raise CheckpointError(path, name, f"the entry is a JSON {type(entry).__name__}, not an object")
    missing = [key for key in ("dtype", "shape", "data_offsets") if key not in entry]
    if missing:
        raise CheckpointError(path, name, f"the entry has no {', '.join(missing)}")
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise CheckpointError(path, name, f"unsupported dtype {dtype!r}")
    if not isinstance(shape, list) or not all(_is_count(d) for d in shape):
        raise CheckpointError(path, name, f"shape {shape!r} is not a list of non-negative integers")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_count(o) for o in offsets)):
        raise CheckpointError(path, name, f"data_offsets {offsets!r} is not [begin, end] in bytes")
    begin, end = offsets
    if not begin <= end <= data_size:
        raise CheckpointError(
            path,
            name,
            f"data_offsets [{begin}, {end}] do not lie in the file's {data_size} data bytes: truncated?",
        )
    expected = math.prod(shape) * DTYPES[dtype].itemsize
    if end - begin != expected:
        raise CheckpointError(path, name, f"holds {end - begin} bytes, shape {shape} needs {expected}")


def _is_count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


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
            except (ValueError, RecursionError) as e:  # bad UTF-8 or JSON, a 5000-digit number, deep nesting
                raise CheckpointError(path, "<header>", f"unreadable header: {e}") from None
        self._data_start = 8 + header_len
        self._entries = _checked_entries(path, header, size - self._data_start)

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
    """All tensors of a checkpoint directory: ``model.safetensors`` or a sharded index.

    ``rename`` maps a stored name to the name readers ask for (a family whose checkpoints come in
    several naming forms reads them all under one); two stored tensors with one name are an error.
    """

    def __init__(self, directory: str, rename: Callable[[str], str] | None = None):
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
        for st in self._files.values():
            for name in st.keys():
                self._where[name] = st
        if weight_map is not None:
            for name, f in weight_map.items():
                if self._where.get(name) is not self._files[f]:
                    raise CheckpointError(
                        os.path.join(directory, f), name, f"listed in {INDEX_FILE} but not in that file"
                    )
        self._stored = {name: name for name in self._where}
        if rename is not None:
            where, self._stored = {}, {}
            for stored, st in self._where.items():
                name = rename(stored)
                if name in self._stored:
                    raise CheckpointError(
                        st.path, stored, f"is the same tensor as '{self._stored[name]}' ({name})"
                    )
                where[name], self._stored[name] = st, stored
            self._where = where

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
        return self._file(name).shape(self._stored[name])

    def dtype(self, name: str) -> np.dtype:
        return self._file(name).dtype(self._stored[name])

    def get(self, name: str) -> np.ndarray:
        return self._file(name).get(self._stored[name])
