"""Malformed safetensors headers are a CheckpointError naming the file and the tensor (issue 13: a
missing ``data_offsets`` or a list instead of an object used to raise a bare KeyError / TypeError)."""

import json
import struct

import numpy as np
import pytest

from jaxdsa.checkpoints import CheckpointError
from jaxdsa.checkpoints.safetensors_io import SafetensorsFile


def write(path, header, data: bytes) -> str:
    raw = json.dumps(header).encode() if not isinstance(header, bytes) else header
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    return str(path)


F32x2 = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}


@pytest.mark.parametrize(
    "header, tensor, message",
    [
        ({"w": {"dtype": "F32", "shape": [2]}}, "w", "no data_offsets"),
        ({"w": {"shape": [2]}}, "w", "no dtype, data_offsets"),
        ({"w": ["F32", [2], [0, 8]]}, "w", "a JSON list, not an object"),
        ({"w": None}, "w", "not an object"),
        ([F32x2], "<header>", "a JSON list, not an object"),
        ({"w": F32x2 | {"dtype": "F33"}}, "w", "unsupported dtype 'F33'"),
        ({"w": F32x2 | {"dtype": 5}}, "w", "unsupported dtype 5"),
        ({"w": F32x2 | {"shape": "2"}}, "w", "shape"),
        ({"w": F32x2 | {"shape": [-2]}}, "w", "shape"),
        ({"w": F32x2 | {"shape": [True, 2]}}, "w", "shape"),
        ({"w": F32x2 | {"data_offsets": [0]}}, "w", "data_offsets"),
        ({"w": F32x2 | {"data_offsets": ["0", "8"]}}, "w", "data_offsets"),
        ({"w": F32x2 | {"data_offsets": {"begin": 0}}}, "w", "data_offsets"),
        ({"w": F32x2 | {"data_offsets": [0, 800]}}, "w", "do not lie in the file's 12 data bytes"),
        ({"w": F32x2 | {"data_offsets": [8, 0]}}, "w", "do not lie"),
        ({"w": F32x2 | {"data_offsets": [0, 4]}}, "w", "holds 4 bytes, shape [2] needs 8"),
        (
            {
                "a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
                "b": F32x2 | {"data_offsets": [2, 10]},
            },
            "b",
            "overlap those of 'a'",
        ),
        ({"__metadata__": ["x"], "w": F32x2}, "__metadata__", "must be an object"),
        (b'{"w": ' + b"1" * 5000 + b"}", "<header>", "unreadable header"),
        (b"[" * 100000 + b"]" * 100000, "<header>", "unreadable header"),
    ],
)
def test_malformed_header_names_file_and_tensor(tmp_path, header, tensor, message):
    path = write(tmp_path / "model.safetensors", header, bytes(12))
    with pytest.raises(CheckpointError) as err:
        SafetensorsFile(path)
    assert (err.value.file, err.value.tensor) == (path, tensor) and message in str(err.value)


def test_a_well_formed_header_with_metadata_and_an_empty_tensor_reads(tmp_path):
    values = np.array([1.5, -2.0], np.float32)
    header = {
        "__metadata__": {"format": "pt"},
        "empty": {"dtype": "BF16", "shape": [0, 3], "data_offsets": [8, 8]},
        "w": F32x2,
    }
    st = SafetensorsFile(write(tmp_path / "model.safetensors", header, values.tobytes()))
    assert sorted(st.keys()) == ["empty", "w"] and st.get("empty").shape == (0, 3)
    np.testing.assert_array_equal(st.get("w"), values)
