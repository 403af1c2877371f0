"""``save_pretrained`` replaces the whole export at once: a save killed partway leaves the previous
export whole for ``load_pretrained`` and ``transformers`` alike; a load that runs while saves
overwrite the directory reads one export, never files of two; files a user put beside the
export (a tokenizer, a README, a subdirectory) survive a save. (A full disk:
``test_disk_full.py``.)"""

from __future__ import annotations

import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import torch
from helpers.harness import run_distributed
from test_hf_parity import tiny_model

import gridtrain.hf as gthf

TIMEOUT = 300
LOADS = 25
KILLS = 4
REPO = Path(__file__).resolve().parents[1]

SAVER = textwrap.dedent(
    """
    import sys, torch
    sys.path.insert(0, sys.argv[2])
    import gridtrain.hf as gthf
    from test_hf_parity import tiny_model
    model = tiny_model("llama")
    epoch = 0
    while True:
        epoch += 1
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(epoch)
        gthf.save_pretrained(model, sys.argv[1], max_shard_size="40KB")
        if epoch == 1:
            print("ready", flush=True)
    """
)


def _values(model: torch.nn.Module) -> list[float]:
    return torch.cat([p.detach().flatten() for p in model.parameters()]).unique().tolist()


def test_a_save_killed_partway_leaves_the_previous_export_whole(tmp_path):
    import transformers as tf

    directory = tmp_path / "export"
    rng = random.Random(0)
    for _ in range(KILLS):
        saver = subprocess.Popen(
            [
                sys.executable,
                "-c",
                SAVER.replace("40KB", "8KB"),
                str(directory),
                str(REPO / "tests"),
            ],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert saver.stdout.readline().strip() == "ready"
        time.sleep(rng.uniform(0.05, 0.6))  # somewhere inside a save of many small files
        saver.send_signal(signal.SIGKILL)
        saver.wait()
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
    saver = subprocess.Popen(
        [sys.executable, "-c", SAVER, str(directory), str(REPO / "tests")],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert saver.stdout.readline().strip() == "ready"
        time.sleep(0.2)
        per_rank = run_distributed(_reader, 2, str(directory), LOADS, timeout=TIMEOUT)
        assert saver.poll() is None, "the saver kept saving throughout"
    finally:
        saver.kill()
        saver.wait()
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
