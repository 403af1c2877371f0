"""``save_pretrained`` replaces the whole export at once: a save killed partway leaves the previous
export whole for ``load_pretrained`` and ``transformers`` alike; a load that runs while saves
overwrite the directory reads one export, never files of two; files a user put beside the
export (a tokenizer, a README, a subdirectory) survive a save. (A full disk:
``test_disk_full.py``.)"""

from __future__ import annotations

import os
import random
import select
import signal
import time
import traceback
from pathlib import Path

import pytest
import torch
from helpers import forked
from helpers.harness import run_distributed
from test_hf_parity import tiny_model

import gridtrain.hf as gthf

TIMEOUT = 300
LOADS = 25
KILLS = 4


def _save_forever(model, directory: str, shard_size: str, ready: int) -> None:
    """Save ``model`` again and again, every weight equal to the save's number; writes a byte
    to the pipe ``ready`` after the first."""
    epoch = 0
    while True:
        epoch += 1
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(epoch)
        gthf.save_pretrained(model, directory, max_shard_size=shard_size)
        if epoch == 1:
            os.write(ready, b"1")
            os.close(ready)


def _fork_saver(model, directory: str, shard_size: str) -> int | str:
    """A saver forked from the host: its pid once its first save is done, else why not."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the saver: never returns into the host's loop
        os.close(read)
        try:
            _save_forever(model, directory, shard_size, write)
        except BaseException:  # noqa: BLE001 - shown, then the host reports no first save
            traceback.print_exc()
        finally:
            os._exit(1)
    os.close(write)
    done, _, _ = select.select([read], [], [], TIMEOUT)
    ok = bool(done) and os.read(read, 1) == b"1"
    os.close(read)
    if not ok:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        return "the saver never finished its first save"
    return pid


def _saver_host(conn) -> None:
    """Imports transformers and builds the tiny Llama once, then forks one saver per request:
    each saver is a real process of its own, killed by a real SIGKILL, without the 3-6 s of
    CPU that importing transformers' model code costs a fresh process (the forkserver does
    not preload it) paid once per kill. One intra-op thread: no OpenMP pool exists here to
    be broken by the forks."""
    torch.set_num_threads(1)
    model = tiny_model("llama")
    statuses: dict[int, int] = {}  # reaped savers' wait statuses
    while (request := conn.recv()) is not None:
        op, *args = request
        if op == "start":
            conn.send(_fork_saver(model, *args))
            continue
        pid = args[0]
        if pid not in statuses:
            done, status = os.waitpid(pid, 0 if op == "reap" else os.WNOHANG)
            if done:
                statuses[pid] = status
        conn.send(pid not in statuses if op == "alive" else statuses.pop(pid))


class _Savers:
    """The test's end of ``_saver_host`` (forked from the test pool's server, which has
    imported torch and gridtrain)."""

    def __init__(self):
        ctx = forked.context()
        self.conn, theirs = ctx.Pipe()
        self.host = ctx.Process(target=_saver_host, args=(theirs,))
        self.host.start()
        theirs.close()

    def _ask(self, *request):
        self.conn.send(request)
        if not self.conn.poll(TIMEOUT):
            raise AssertionError(f"the saver host did not answer {request[0]}")
        return self.conn.recv()

    def start(self, directory: Path, shard_size: str) -> int:
        pid = self._ask("start", str(directory), shard_size)
        if isinstance(pid, str):
            raise AssertionError(pid)
        return pid

    def alive(self, pid: int) -> bool:
        return self._ask("alive", pid)

    def kill(self, pid: int) -> None:
        os.kill(pid, signal.SIGKILL)
        status = self._ask("reap", pid)
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, status

    def close(self) -> None:
        self.conn.send(None)
        self.host.join(TIMEOUT)
        if self.host.is_alive():
            self.host.kill()


@pytest.fixture(scope="module")
def savers():
    host = _Savers()
    yield host
    host.close()


def _values(model: torch.nn.Module) -> list[float]:
    return torch.cat([p.detach().flatten() for p in model.parameters()]).unique().tolist()


def test_a_save_killed_partway_leaves_the_previous_export_whole(tmp_path, savers):
    import transformers as tf

    directory = tmp_path / "export"
    rng = random.Random(0)
    for _ in range(KILLS):
        saver = savers.start(directory, "8KB")
        time.sleep(rng.uniform(0.05, 0.6))  # somewhere inside a save of many small files
        savers.kill(saver)
        model = tiny_model("llama")
        gthf.load_pretrained(model, directory)
        values = _values(model)
        assert len(values) == 1, f"load_pretrained read a mix of exports: {values[:5]}"
        loaded = tf.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float64)
        assert _values(loaded) == values, "transformers reads the same whole export"


def _reader(ctx, directory: str, loads: int):
    model = tiny_model("llama")
    seen = []
    for _ in range(loads):
        gthf.load_pretrained(model, directory)
        seen.append(_values(model))
    return seen


def test_a_load_during_overwrites_reads_one_export(tmp_path, savers):
    directory = tmp_path / "export"
    saver = savers.start(directory, "40KB")
    try:
        time.sleep(0.2)
        per_rank = run_distributed(_reader, 2, str(directory), LOADS, timeout=TIMEOUT)
        assert savers.alive(saver), "the saver kept saving throughout"
    finally:
        savers.kill(saver)
    assert per_rank[0] == per_rank[1], "every rank read the same export"
    for values in per_rank[0]:
        assert len(values) == 1, f"a mix of exports: {values[:5]}"
    assert len({v[0] for v in per_rank[0]}) > 1, "control: the loads really overlapped saves"


def test_files_beside_the_export_survive_and_old_weight_files_go(tmp_path):
    directory = tmp_path / "export"
    gthf.save_pretrained(tiny_model("llama"), directory, max_shard_size="40KB")
    shards = sorted(p.name for p in directory.glob("model-*.safetensors"))
    assert len(shards) > 1
    (directory / "tokenizer.json").write_text("{}")
    (directory / "notes").mkdir()
    (directory / "notes" / "README.md").write_text("mine")
    gthf.save_pretrained(tiny_model("llama"), directory)  # one file now: shards and index go
    assert sorted(p.name for p in directory.iterdir()) == [
        "config.json",
        "model.safetensors",
        "notes",
        "tokenizer.json",
    ]
    assert (directory / "notes" / "README.md").read_text() == "mine"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")], "no temporary left"
