"""The bundled default model (``jaxdsa.serve.default_model``): written once with a long enough context,
reused while its stamp is current, rewritten when it is not (an older jaxdsa's 256-token model, a
foreign or damaged directory)."""

from __future__ import annotations

import json
import os
import pathlib

import pytest

from jaxdsa.serve import default_model


def snapshot(directory: pathlib.Path) -> dict[str, tuple[int, int]]:
    """Each file's (inode, mtime): what changes when a file is rewritten."""
    return {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in directory.iterdir()}


@pytest.fixture
def made(tmp_path, monkeypatch) -> list[str]:
    """JAXDSA_CACHE_DIR in tmp_path; the list of directories make_tiny was asked to write."""
    monkeypatch.setenv("JAXDSA_CACHE_DIR", str(tmp_path))
    calls, make = [], default_model.make_tiny

    def counted(family, out_dir, **kwargs):
        calls.append(out_dir)
        return make(family, out_dir, **kwargs)

    monkeypatch.setattr(default_model, "make_tiny", counted)
    return calls


def test_written_with_a_context_for_tools_and_reused_without_rewriting(tmp_path, made):
    path = pathlib.Path(default_model.ensure_default_model())
    assert path == tmp_path / "default-model" and len(made) == 1
    config = json.loads((path / "config.json").read_text())
    assert config["max_position_embeddings"] == default_model.CONTEXT >= 4096
    assert json.loads((path / "tokenizer_config.json").read_text())["model_max_length"] == 4096
    assert json.loads((path / default_model.STAMP).read_text()) == default_model.stamp()
    assert sorted(os.listdir(tmp_path)) == ["default-model"]  # no staging directory left behind
    before = snapshot(path)
    assert default_model.ensure_default_model() == str(path)
    assert len(made) == 1 and snapshot(path) == before


@pytest.mark.parametrize(
    "damage",
    ["old 256-token model, no stamp", "stamp of another maker version", "stamp not JSON", "file missing"],
)
def test_stale_or_foreign_content_is_replaced(tmp_path, made, damage):
    path = pathlib.Path(default_model.ensure_default_model())
    stamp = path / default_model.STAMP
    if damage.startswith("old"):  # what jaxdsa wrote before the stamp: the preset's 256 positions
        config = json.loads((path / "config.json").read_text())
        (path / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 256}))
        stamp.unlink()
    elif damage.startswith("stamp of"):
        stamp.write_text(json.dumps({**default_model.stamp(), "maker_version": 0}))
    elif damage == "stamp not JSON":
        stamp.write_text("{")
    else:
        (path / "model.safetensors").unlink()
    (path / "foreign.txt").write_text("not the maker's")
    assert default_model.ensure_default_model() == str(path) and len(made) == 2
    assert json.loads((path / "config.json").read_text())["max_position_embeddings"] == 4096
    assert json.loads(stamp.read_text()) == default_model.stamp()
    assert not (path / "foreign.txt").exists() and (path / "model.safetensors").is_file()
    assert sorted(os.listdir(tmp_path)) == ["default-model"]
