"""``save_pretrained`` replaces the whole export at once: a save killed partway leaves the previous
export whole for ``load_pretrained`` and ``transformers`` alike; a load that runs while saves
overwrite the directory reads one export, never files of two; files a user put beside the
export (a tokenizer, a README, a subdirectory) survive a save. (A full disk:
``test_disk_full.py``.)"""

from __future__ import annotations

import os
import random
import signal
import time
from pathlib import Path

import torch
from helpers import forked
from helpers.harness import run_distributed
from test_hf_parity import tiny_model

import gridtrain.hf as gthf

TIMEOUT = 300
LOADS = 25
KILLS = 4


def _save_forever(directory: str, shard_size: str, ready) -> None:
    """Save the tiny Llama again and again, every weight equal to the save's number; says
    ``ready`` after the first. Run as a process of its own (forked from the test pool's
    server, which has imported torch and gridtrain: a killed save is a real process's death,
    without a fresh interpreter's imports for each of the ``KILLS``)."""
    model = tiny_model("llama")
    epoch = 0
    while True:
        epoch += 1
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(epoch)
        gthf.save_pretrained(model, directory, max_shard_size=shard_size)
        if epoch == 1:
            ready.send(True)
            ready.close()


def _start_saver(directory: Path, shard_size: str):
    ctx = forked.context()
    ready, send = ctx.Pipe(duplex=False)
    saver = ctx.Process(target=_save_forever, args=(str(directory), shard_size, send))
    saver.start()
    send.close()
    if not ready.poll(TIMEOUT):
        saver.kill()
        raise AssertionError("the saver never finished its first save")
    return saver


def _values(model: torch.nn.Module) -> list[float]:
    return torch.cat([p.detach().flatten() for p in model.parameters()]).unique().tolist()


def test_a_save_killed_partway_leaves_the_previous_export_whole(tmp_path):
    import transformers as tf

    directory = tmp_path / "export"
    rng = random.Random(0)
    for _ in range(KILLS):
        saver = _start_saver(directory, "8KB")
        time.sleep(rng.uniform(0.05, 0.6))  # somewhere inside a save of many small files
        os.kill(saver.pid, signal.SIGKILL)
        saver.join()
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


def test_a_load_during_overwrites_reads_one_export(tmp_path):
    directory = tmp_path / "export"
    saver = _start_saver(directory, "40KB")
    try:
        time.sleep(0.2)
        per_rank = run_distributed(_reader, 2, str(directory), LOADS, timeout=TIMEOUT)
        assert saver.is_alive(), "the saver kept saving throughout"
    finally:
        saver.kill()
        saver.join()
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
