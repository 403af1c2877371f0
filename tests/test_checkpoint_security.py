"""Checkpoint files as an attacker would craft or plant them (issue 11 items 4 and 6).

A pickle whose ``__reduce__`` calls ``os.system`` is refused with the file's name, in the dense
file, in a sharded directory's ``.metadata`` and in one of its plain values, and the command
never runs. Temporary files are exclusive and random, a link planted at the target or at a
temporary's name is replaced or unlinked and never written through, and temporaries left by
dead processes are removed (or finished) by the next save.
"""

from __future__ import annotations

import os
import pickle
import shutil
import time
from pathlib import Path

import pytest
import torch
from helpers.checkpoint_forge import dead_pid, forge_marker, model_and_opt, temp_name
from helpers.harness import run_distributed

import gridtrain as gt
from gridtrain.engine.checkpoint import CheckpointTargetError, files

TIMEOUT = 300


class Evil:
    """Unpickling this runs ``touch <marker>``."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _try_load(ctx, path, with_extra=False):
    model, opt = model_and_opt()
    try:
        gt.load_checkpoint(path, model, opt, extra={} if with_extra else None)
    except Exception as err:  # noqa: BLE001 - the test inspects it
        return type(err).__name__, str(err)
    return None, "loaded"


def _save(ctx, path, sharded, evil_marker=None):
    model, opt = model_and_opt()
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    # built here: passing it to the worker would unpickle (run) it on the way
    extra = {"evil": Evil(evil_marker)} if evil_marker else None
    gt.save_checkpoint(path, 1, model, opt, sharded=sharded, extra=extra)


def test_a_live_payload_runs_under_plain_pickle(tmp_path):
    """The payload used below is real: unpickled without restrictions it does run."""
    marker = tmp_path / "RAN"
    pickle.loads(pickle.dumps(Evil(marker)))
    assert marker.exists()


def test_malicious_dense_files_are_refused_and_nothing_runs(tmp_path):
    marker = tmp_path / "PWNED"
    plain = tmp_path / "plain_pickle.pt"
    plain.write_bytes(pickle.dumps({"format": 1, "model": Evil(marker)}))
    kind, message = run_distributed(_try_load, 1, str(plain), timeout=TIMEOUT)[0]
    assert kind == "CorruptCheckpointError", message  # not even torch's zip: never unpickled
    assert str(plain) in message and "not a complete gridtrain checkpoint" in message, message
    # torch's zip without gridtrain's seal (as files from before the seal): unpickled, refused
    zipped = tmp_path / "torch_save.pt"
    torch.save({"format": 1, "epoch": 1, "model": {"w": Evil(marker)}}, zipped)
    kind, message = run_distributed(_try_load, 1, str(zipped), timeout=TIMEOUT)[0]
    assert kind == "UnsafeCheckpointError", message
    assert str(zipped) in message and "nothing was executed" in message
    assert "Refused:" in message and "nsupported" in message, "says what it refused"
    assert "posix.system" in message or "os.system" in message, message  # the zip names it
    assert not marker.exists(), "the payload ran"


def test_malicious_sharded_checkpoints_are_refused_and_nothing_runs(tmp_path):
    marker = tmp_path / "PWNED"
    good = tmp_path / "good"
    run_distributed(_save, 1, str(good), True, timeout=TIMEOUT)
    assert run_distributed(_try_load, 1, str(good), timeout=TIMEOUT)[0] == (None, "loaded")
    # DCP's .metadata is a plain pickle: only DCP's metadata classes may appear in it
    bad_meta = tmp_path / "bad_metadata"
    shutil.copytree(good, bad_meta)
    (bad_meta / ".metadata").write_bytes(pickle.dumps(Evil(marker)))
    kind, message = run_distributed(_try_load, 1, str(bad_meta), timeout=TIMEOUT)[0]
    assert kind == "CorruptCheckpointError" and ".metadata" in message, "its CRC-32 differs"
    forge_marker(bad_meta)
    kind, message = run_distributed(_try_load, 1, str(bad_meta), timeout=TIMEOUT)[0]
    assert kind == "UnsafeCheckpointError" and str(bad_meta) in message, message
    # a plain value (extra) holding an object: refused when read, naming the key and the path
    bad_extra = tmp_path / "bad_extra"
    run_distributed(_save, 1, str(bad_extra), True, str(marker), timeout=TIMEOUT)
    kind, message = run_distributed(_try_load, 1, str(bad_extra), True, timeout=TIMEOUT)[0]
    assert kind == "UnsafeCheckpointError", message
    assert "'extra'" in message and str(bad_extra) in message, message
    assert not marker.exists(), "the payload ran"


# ---- temporary files ---------------------------------------------------------------------------
def test_links_at_the_target_or_a_temporary_name_are_never_written_through(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    victim_dir = tmp_path / "victim_dir"
    victim_dir.mkdir()
    (victim_dir / "data").write_text("precious too")
    ckpt_dir = tmp_path / "ckpts"
    ckpt_dir.mkdir()
    target = ckpt_dir / "ckpt.pt"
    target.symlink_to(victim)
    # the names the old code used (".NAME.tmp-PID"), for every pid near ours
    for pid in range(os.getpid() - 5, os.getpid() + 50):
        (ckpt_dir / f".ckpt.pt.tmp-{pid}").symlink_to(victim)
    # a link named like an abandoned temporary of ours, pointing at a directory
    stale_link = ckpt_dir / temp_name("ckpt.pt", dead_pid())
    stale_link.symlink_to(victim_dir)

    files.clean_stale(ckpt_dir)
    with pytest.raises(CheckpointTargetError, match="is a symbolic link"):
        files.atomic_torch_save({"epoch": 3}, target)  # a link is not a checkpoint of ours
    files.atomic_torch_save({"epoch": 3}, ckpt_dir / "other.pt")

    assert victim.read_text() == "precious"
    assert (victim_dir / "data").read_text() == "precious too", "cleaning followed the link"
    assert not os.path.lexists(stale_link), "the link itself was removed"
    assert target.is_symlink(), "the link was left as it was"
    assert torch.load(ckpt_dir / "other.pt", weights_only=True)["epoch"] == 3


def test_temporaries_are_created_exclusively(tmp_path, monkeypatch):
    """mkstemp (O_CREAT | O_EXCL) with a random part: a planted entry is never opened."""
    seen = []
    real = files.tempfile.mkstemp

    def spy(*args, **kwargs):
        fd, name = real(*args, **kwargs)
        seen.append(name)
        return fd, name

    monkeypatch.setattr(files.tempfile, "mkstemp", spy)
    files.atomic_torch_save({"x": 1}, tmp_path / "a.pt")
    files.atomic_torch_save({"x": 2}, tmp_path / "a.pt")
    assert len(set(seen)) == 2 and all(Path(n).parent == tmp_path for n in seen)
    assert all(Path(n).name.startswith(".a.pt.tmp-gt.") for n in seen)
    assert sorted(os.listdir(tmp_path)) == ["a.pt"]


def test_stale_temporaries_are_removed_by_the_next_save(tmp_path):
    dead, alive = dead_pid(), os.getppid()
    partial_file = tmp_path / temp_name("ckpt.pt", dead)
    partial_file.write_bytes(b"partial")
    partial_dir = tmp_path / temp_name("epoch_3", dead)
    partial_dir.mkdir()
    (partial_dir / "__0_0.distcp").write_bytes(b"partial")
    newline = tmp_path / temp_name("a\nname.pt", dead)  # any character but '/' may name a target
    newline.write_bytes(b"partial")
    live = tmp_path / temp_name("other.pt", alive)  # a save in flight in another process
    live.write_bytes(b"in flight")
    foreign_new = tmp_path / temp_name("x.pt", 1, host="otherhost")
    foreign_new.write_bytes(b"?")
    foreign_old = tmp_path / temp_name("y.pt", 1, host="otherhost")
    foreign_old.write_bytes(b"?")
    old = time.time() - 2 * files.STALE_S
    os.utime(foreign_old, (old, old))
    unrelated = tmp_path / ".unrelated.tmp-1234"
    unrelated.write_bytes(b"not ours")

    run_distributed(_save, 1, str(tmp_path / "ckpt.pt"), False, timeout=TIMEOUT)

    left = sorted(os.listdir(tmp_path))
    assert left == sorted(["ckpt.pt", live.name, foreign_new.name, unrelated.name]), left


def _complete_dir(path: Path, tag: str) -> Path:
    path.mkdir()
    (path / files.MARKER).write_text("{}")
    (path / "tag").write_text(tag)
    return path


def test_a_replacement_cut_between_its_renames_is_finished_by_the_next_save(tmp_path):
    dead = dead_pid()
    # a finished save whose rename never happened, the target gone (put aside and lost)
    _complete_dir(tmp_path / temp_name("a", dead), "new a")
    # the fallback's copy put aside, the new one never arrived
    aside = tmp_path / temp_name("b", dead, kind="old")
    aside.mkdir()
    _complete_dir(aside / "ckpt", "old b")
    # an unfinished temporary (no marker): only deleted
    (tmp_path / temp_name("c", dead)).mkdir()
    files.clean_stale(tmp_path)
    assert sorted(os.listdir(tmp_path)) == ["a", "b"]
    assert (tmp_path / "a" / "tag").read_text() == "new a"
    assert (tmp_path / "b" / "tag").read_text() == "old b"


@pytest.mark.parametrize("exchange", [True, False], ids=["renameat2", "rename-aside"])
def test_replacing_a_directory_leaves_only_the_new_one(tmp_path, monkeypatch, exchange):
    if not exchange:
        monkeypatch.setattr(files, "_exchange", lambda a, b: False)
    _complete_dir(tmp_path / "ckpt", "old")
    new = _complete_dir(tmp_path / temp_name("ckpt", os.getpid()), "new")
    files.replace(new, tmp_path / "ckpt")
    assert os.listdir(tmp_path) == ["ckpt"]
    assert (tmp_path / "ckpt" / "tag").read_text() == "new"


class Call:
    """Pickles as ``fn(*args)``: a pickle built only from names the loader may allow."""

    def __init__(self, fn, *args):
        self.fn, self.args = fn, args

    def __reduce__(self):
        return self.fn, self.args

    def __call__(self, *args):  # pickle wants a callable; only its unpickled form is called
        raise AssertionError("never called here")


def test_metadata_built_from_allowed_names_cannot_call_a_method(tmp_path):
    """Issue 28 item 1: getattr(PosixPath, "write_text")(PosixPath(x), ...) wrote any file."""
    good = tmp_path / "good"
    run_distributed(_save, 1, str(good), True, timeout=TIMEOUT)
    written = tmp_path / "written.pth"
    write = Call(getattr, Path, "write_text")
    payload = (Call(write, Call(Path, str(written)), "import os"),)
    (good / ".metadata").write_bytes(pickle.dumps(payload, protocol=4))
    forge_marker(good)
    kind, message = run_distributed(_try_load, 1, str(good), timeout=TIMEOUT)[0]
    assert not written.exists(), "the pickle wrote a file"
    assert kind == "UnsafeCheckpointError" and str(good) in message, message
    assert "getattr" in message, message
