"""A save never deletes what it did not write (issue 28 items 2, 3 and 4).

A target that exists and is not a gridtrain checkpoint (a directory of other files, a file
that is not one of our dense checkpoints, a symbolic link) is refused with an error naming the
path, before anything is written; replacing a checkpoint of ours stays atomic; and cleaning up
stale temporaries never follows a link, however it is named.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from helpers.checkpoint_forge import dead_pid, model_and_opt, temp_name
from helpers.harness import run_distributed

import gridtrain as gt

TIMEOUT = 300


def _save(ctx, path, sharded, epoch=1):
    """Save; returns None or the error's type name and message (every rank must agree)."""
    model, opt = model_and_opt()
    try:
        gt.save_checkpoint(path, epoch, model, opt, sharded=sharded)
    except Exception as err:  # noqa: BLE001 - the test inspects it
        return type(err).__name__, str(err)
    return None


def _epoch(ctx, path):
    model, opt = model_and_opt()
    return gt.load_checkpoint(path, model, opt)


def _tree(root: Path) -> dict[str, bytes | None]:
    """Every entry under ``root`` (not following links) and each file's bytes."""
    out: dict[str, bytes | None] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = Path(dirpath) / name
            rel = str(path.relative_to(root))
            out[rel] = path.read_bytes() if path.is_file() and not path.is_symlink() else None
    return out


def _foreign_directory(path: Path) -> Path:
    (path / "epoch_1").mkdir(parents=True)
    (path / "epoch_1" / "weights.bin").write_bytes(b"\x00" * 64)
    (path / "epoch_2.pt").write_bytes(b"an older run of another tool")
    (path / "important.txt").write_text("precious")
    return path


@pytest.mark.parametrize("sharded", [False, True], ids=["dense", "sharded"])
def test_a_directory_that_is_not_a_checkpoint_is_refused_and_left_alone(tmp_path, sharded):
    target = _foreign_directory(tmp_path / "ckF")
    before = _tree(tmp_path)
    results = run_distributed(_save, 2, str(target), sharded, timeout=TIMEOUT)
    assert results[0] == results[1], "every rank raises the same error"
    kind, message = results[0]
    assert kind == "CheckpointTargetError" and str(target) in message, message
    assert _tree(tmp_path) == before, "nothing was written, moved or deleted"


@pytest.mark.parametrize("sharded", [False, True], ids=["dense", "sharded"])
def test_a_file_that_is_not_a_checkpoint_is_refused(tmp_path, sharded):
    target = tmp_path / "notes.txt"
    target.write_text("precious")
    kind, message = run_distributed(_save, 1, str(target), sharded, timeout=TIMEOUT)[0]
    assert kind == "CheckpointTargetError" and str(target) in message, message
    assert target.read_text() == "precious" and os.listdir(tmp_path) == ["notes.txt"]


@pytest.mark.parametrize("sharded", [False, True], ids=["dense", "sharded"])
def test_a_link_at_the_target_is_refused_and_its_target_untouched(tmp_path, sharded):
    victim = tmp_path / "victim.pt"
    assert run_distributed(_save, 1, str(victim), False, timeout=TIMEOUT)[0] is None
    data = victim.read_bytes()
    link = tmp_path / "ckpt"
    link.symlink_to(victim)
    kind, message = run_distributed(_save, 1, str(link), sharded, timeout=TIMEOUT)[0]
    assert kind == "CheckpointTargetError" and str(link) in message, message
    assert link.is_symlink() and victim.read_bytes() == data


@pytest.mark.parametrize(
    "first,second", [(False, False), (True, True), (False, True), (True, False)]
)
def test_a_checkpoint_of_ours_is_replaced(tmp_path, first, second):
    """Either format over either format: the old one was ours, so it may go."""
    target = tmp_path / "ckpt"
    assert run_distributed(_save, 2, str(target), first, 1, timeout=TIMEOUT) == [None, None]
    assert run_distributed(_save, 2, str(target), second, 2, timeout=TIMEOUT) == [None, None]
    assert run_distributed(_epoch, 1, str(target), timeout=TIMEOUT) == [2]
    assert os.listdir(tmp_path) == ["ckpt"], "no temporary and no old copy left"


def test_an_empty_directory_is_replaced(tmp_path):
    (tmp_path / "ckpt").mkdir()
    assert run_distributed(_save, 1, str(tmp_path / "ckpt"), True, timeout=TIMEOUT) == [None]
    assert run_distributed(_epoch, 1, str(tmp_path / "ckpt"), timeout=TIMEOUT) == [1]


def test_a_planted_old_copy_link_moves_nothing(tmp_path):
    """`.victim.old-gt.<dead pid>@host.x -> outside/`, where outside/ckpt is a complete
    checkpoint: the next save removes the link and never moves what it points at."""
    outside = tmp_path / "outside"
    assert run_distributed(_save, 1, str(outside / "ckpt"), True, timeout=TIMEOUT)[0] is None
    before = _tree(outside)
    ckpts = tmp_path / "ckpts"
    ckpts.mkdir()
    planted = ckpts / temp_name("victim", dead_pid(), kind="old")
    planted.symlink_to(outside)
    tmp_planted = ckpts / temp_name("other", dead_pid())
    tmp_planted.symlink_to(outside / "ckpt")
    assert run_distributed(_save, 1, str(ckpts / "mine.pt"), False, timeout=TIMEOUT)[0] is None
    assert _tree(outside) == before, "the outside checkpoint was moved or changed"
    assert sorted(os.listdir(ckpts)) == ["mine.pt"], "the links themselves were removed"
