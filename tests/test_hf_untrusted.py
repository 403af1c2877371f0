"""A crafted Hugging Face directory is input, not a way out: ``load_pretrained`` reads only the
directory's own regular files (an index entry that leaves it, or names a FIFO, is refused by
name, without blocking), a damaged safetensors file is an error naming it, and the Hugging
Face cache's own symbolic links (``snapshots/<rev>/x -> ../../blobs/<hash>``) still load.
One process, no context."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from helpers import forked
from test_hf_parity import tiny_model

import gridtrain.hf as gthf

INDEX = "model.safetensors.index.json"


@pytest.fixture(scope="module")
def export(tmp_path_factory) -> Path:
    """A tiny Llama saved as an index and several shards."""
    directory = tmp_path_factory.mktemp("hf") / "export"
    gthf.save_pretrained(tiny_model("llama"), directory, max_shard_size="40KB")
    assert (directory / INDEX).is_file()
    return directory


def _copy(export: Path, tmp_path: Path) -> tuple[Path, dict]:
    directory = tmp_path / "model"
    shutil.copytree(export, directory)
    return directory, json.loads((directory / INDEX).read_text())


def _point(directory: Path, index: dict, name: str) -> str:
    """Map the first key of the index to ``name``; returns that key."""
    key = sorted(index["weight_map"])[0]
    index["weight_map"][key] = name
    (directory / INDEX).write_text(json.dumps(index))
    return key


def _load(directory: Path) -> str | None:
    """load_pretrained's error (None: it loaded)."""
    try:
        gthf.load_pretrained(tiny_model("llama"), directory)
    except Exception as err:  # noqa: BLE001 - the error is what the test reads
        return f"{type(err).__name__}: {err}"
    return None


LOAD = """
import sys
from pathlib import Path
sys.path.insert(0, sys.argv[1])
from test_hf_untrusted import _load
print("ERROR " + " || ".join(str(_load(Path(d))) for d in sys.argv[2:]), flush=True)
"""


def _load_apart(*directories: Path, timeout: float = 120.0) -> str:
    """``_load`` of each directory in one process of its own (errors joined by `` || ``): a
    FIFO's open blocks inside safetensors holding the GIL, so only a process can be stopped
    when it hangs. The process is forked from the test pool's server (torch and gridtrain
    imported once, ``helpers.forked``): a real process, without a fresh interpreter's imports."""
    script = directories[0].parent / "load_apart.py"
    script.write_text(LOAD)
    try:
        proc = forked.run(
            [str(script), str(Path(__file__).parent), *map(str, directories)],
            cwd=script.parent,
            timeout=timeout,
        )
    except TimeoutError:
        raise AssertionError(f"load_pretrained blocked for {timeout:g} s") from None
    lines = [line for line in proc.stdout.splitlines() if line.startswith("ERROR ")]
    assert lines, proc.stdout + proc.stderr
    return lines[-1][len("ERROR ") :]


def test_index_entries_that_leave_the_directory_are_refused(export, tmp_path):
    directory, index = _copy(export, tmp_path)
    shard = sorted(set(index["weight_map"].values()))[0]
    shutil.copy(directory / shard, tmp_path / "outside.safetensors")
    for name in ("../outside.safetensors", str(tmp_path / "outside.safetensors")):
        key = _point(directory, index, name)
        error = _load(directory)
        assert error is not None and error.startswith("PretrainedFileError"), error
        assert name in error and "refused" in error and key in error, error
    os.symlink(tmp_path / "outside.safetensors", directory / "link.safetensors")
    _point(directory, index, "link.safetensors")
    error = _load(directory)
    assert error is not None and "leads out of the directory" in error, error
    assert "link.safetensors" in error


def test_a_fifo_is_refused_without_blocking(export, tmp_path):
    directory, index = _copy(export, tmp_path)
    os.mkfifo(directory / "pipe.safetensors")
    _point(directory, index, "pipe.safetensors")
    single = tmp_path / "single"
    single.mkdir()
    os.mkfifo(single / "model.safetensors")
    both = _load_apart(directory, single)
    for error in both.split(" || "):
        assert "a FIFO" in error, both
    assert "pipe.safetensors" in both, both


def test_a_damaged_safetensors_file_is_named(export, tmp_path):
    directory, index = _copy(export, tmp_path)
    shard = sorted(set(index["weight_map"].values()))[-1]
    os.truncate(directory / shard, (directory / shard).stat().st_size // 2)
    error = _load(directory)
    assert error is not None and f"model/{shard}'" in error, error
    assert "safetensors" in error


def test_the_hugging_face_cache_layout_loads(export, tmp_path):
    """snapshots/<rev>/<file> are links into the repository's blobs: they stay allowed."""
    repo = tmp_path / "models--tiny--llama"
    (repo / "blobs").mkdir(parents=True)
    snapshot = repo / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    for path in export.iterdir():
        blob = repo / "blobs" / f"blob_{path.name}"
        shutil.copy(path, blob)
        os.symlink(Path("../../blobs") / blob.name, snapshot / path.name)
    src = tiny_model("llama")
    dst = tiny_model("llama")
    with torch.no_grad():
        for p in dst.parameters():
            p.zero_()
    gthf.load_pretrained(dst, snapshot)
    for key, value in src.state_dict().items():
        assert torch.equal(dst.state_dict()[key], value), key
