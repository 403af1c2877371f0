"""A disk that fills up during a save (``save_checkpoint`` dense and sharded, ``save_pretrained``):
every rank's error names the path and says the disk is full, and what was saved there before
still loads, whole.

The saves write into a 512 KiB tmpfs mounted in a mount namespace of its own (``unshare -m``,
as root or with user namespaces), in a subprocess that starts two gloo ranks.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

SCRIPT = textwrap.dedent(
    """
    import os, socket, sys
    import torch, torch.multiprocessing as mp
    sys.path.insert(0, sys.argv[2])
    # imported once here, before the ranks fork (spawned ranks imported them again, each)
    import gridtrain as gt
    import gridtrain.hf as gthf
    from test_hf_parity import tiny_model

    def rank(r, port, target, q):
        gt.launch({}, r, 2, "127.0.0.1", port, backend="gloo")
        small, big = torch.nn.Linear(4, 4), torch.nn.Linear(512, 512)  # 4 KB, 1 MB
        for name, sharded in (("dense.pt", False), ("sharded", True)):
            path = os.path.join(target, name)
            gt.save_checkpoint(path, 1, small, sharded=sharded)
            try:
                gt.save_checkpoint(path, 2, big, sharded=sharded)
                out = "saved"
            except OSError as err:
                out = str(err)
            epoch = gt.load_checkpoint(path, torch.nn.Linear(4, 4))
            listing = sorted(os.listdir(target))  # before the next save starts a temporary
            torch.distributed.barrier()
            q.put((name, r, out, epoch == 1, listing))
        q.put(("hf", r, *save_pretrained(target)))
        gt.destroy()

    def save_pretrained(target):
        path = os.path.join(target, "hf")
        old = tiny_model("llama", dtype=torch.bfloat16)  # 180 KB
        gthf.save_pretrained(old, path, max_shard_size="40KB")
        try:
            gthf.save_pretrained(tiny_model("llama"), path, max_shard_size="40KB")  # 720 KB
            out = "saved"
        except OSError as err:
            out = str(err)
        back = tiny_model("llama", dtype=torch.bfloat16)
        with torch.no_grad():
            for p in back.parameters():
                p.zero_()
        gthf.load_pretrained(back, path)
        same = all(torch.equal(a, b) for a, b in zip(old.parameters(), back.parameters()))
        listing = sorted(os.listdir(target))
        torch.distributed.barrier()
        return out, same, listing

    if __name__ == "__main__":
        s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
        ctx = mp.get_context("fork")  # nothing but imports has run: no thread pool to break
        q = ctx.Queue()
        procs = [ctx.Process(target=rank, args=(r, port, sys.argv[1], q)) for r in range(2)]
        for p in procs:
            p.start()
        for _ in range(6):
            print(repr(q.get(timeout=240)), flush=True)
        for p in procs:
            p.join()
    """
)


def _in_small_tmpfs(tmp_path: Path, script: str) -> list[tuple]:
    """Run ``script DIR`` with DIR a fresh 512 KiB tmpfs; the tuples it printed."""
    if shutil.which("unshare") is None:
        pytest.skip("needs util-linux's unshare to mount a small tmpfs")
    mount = tmp_path / "disk"
    mount.mkdir()
    (tmp_path / "run.py").write_text(script)
    shell = (
        f"mount -t tmpfs -o size=512k tmpfs {mount} && "
        f"exec {sys.executable} {tmp_path / 'run.py'} {mount} {REPO / 'tests'}"
    )
    proc = subprocess.run(
        ["unshare", "-m", "--map-root-user", "sh", "-c", shell],
        capture_output=True,
        text=True,
        timeout=400,
        cwd=REPO,
    )
    if proc.returncode != 0 and "mount" in proc.stderr and "permission" in proc.stderr.lower():
        pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.strip()[:200]}")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [eval(line) for line in proc.stdout.splitlines() if line.startswith("(")]  # noqa: S307


def test_disk_full_during_a_save_is_named_on_every_rank(tmp_path):
    results = _in_small_tmpfs(tmp_path, SCRIPT)
    assert sorted((name, r) for name, r, *_ in results) == [
        (name, r) for name in ("dense.pt", "hf", "sharded") for r in (0, 1)
    ]
    for name, rank, message, previous_loads, listing in results:
        what = "save_pretrained" if name == "hf" else "save_checkpoint"
        assert message.startswith(f"[Errno 28] {what}: the disk holding"), (name, rank, message)
        assert f"disk/{name}'" in message and "is full" in message, (name, rank, message)
        assert "No space left on device" in message, message
        assert previous_loads, f"{name}: what was saved before still loads, whole (rank {rank})"
        assert not [n for n in listing if n.startswith(".")], f"a temporary was left: {listing}"
