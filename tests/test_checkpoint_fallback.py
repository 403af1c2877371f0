"""An automatic resume falls back past a damaged latest checkpoint to the newest intact one.

``gt.latest_checkpoint`` and ``LoadCheckpointHook(path="auto")`` verify every byte of the
checkpoint they pick; a damaged newer one (a flipped byte in one rank's shard, a truncated
dense file, a lost completion marker) is skipped with a warning naming it and why.
"""

from __future__ import annotations

import os
import shutil

import torch
from helpers.harness import run_distributed
from helpers.logs import gridtrain_warnings
from helpers.models import adamw_halving, classifier_net
from helpers.runs import start_engine
from torch.utils.data import TensorDataset

import gridtrain as gt
from gridtrain.engine import LoadCheckpointHook, LossHook, SaveCheckpointHook, Trainer
from gridtrain.engine.checkpoint import files

TIMEOUT = 300
TP2 = dict(parallel=dict(tensor=dict(size=2, mode="1d")))
D_IN, N_CLASSES, SAMPLES, BATCH = 16, 8, 16, 8


def _engine():
    torch.manual_seed(7)
    model = classifier_net(dropout=0.25)
    loss = gt.nn.CrossEntropyLoss()
    return start_engine(model, loss, adamw_halving, None, example_inputs=torch.zeros(8, D_IN))


def _fit(ctx, ckpt_dir, epochs, resume, sharded):
    """Train ``epochs`` epochs with a checkpoint after each; ``resume``: LoadCheckpointHook(auto)."""
    g = torch.Generator().manual_seed(3)
    data = TensorDataset(
        torch.randn(SAMPLES, D_IN, generator=g), torch.randint(N_CLASSES, (SAMPLES,), generator=g)
    )
    loader = gt.data.get_dataloader(data, BATCH, shuffle=True, seed=5)
    engine, _ = _engine()
    hooks = [LossHook(), SaveCheckpointHook(1, ckpt_dir, sharded=sharded)]
    if resume:
        hooks.append(LoadCheckpointHook(ckpt_dir, path="auto"))
    trainer = Trainer(engine)
    with gridtrain_warnings() as warnings:
        trainer.fit(loader, epochs=epochs, hooks=hooks)
    loaded = hooks[2].loaded_path if resume else None
    return dict(
        loaded=loaded.name if loaded else None,
        warnings=warnings,
        losses=list(trainer.states["metrics"]["train"]["loss"].step),
        state=gt.full_state_dict(engine.model),
    )


def _flip_byte(path, offset=-40):
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def test_a_damaged_shard_in_the_latest_sharded_checkpoint_falls_back(tmp_path):
    ckpt = tmp_path / "ckpt"
    full = run_distributed(_fit, 2, str(ckpt), 3, False, True, config=TP2, timeout=TIMEOUT)[0]
    shard = ckpt / "epoch_3" / "__1_0.distcp"
    assert shard.is_file(), "rank 1 wrote its own shards"
    _flip_byte(shard)
    with gridtrain_warnings() as warnings:
        assert gt.latest_checkpoint(ckpt) == ckpt / "epoch_2"
    assert any("epoch_3" in w and "__1_0.distcp" in w and "damaged" in w for w in warnings), (
        warnings
    )
    assert gt.latest_checkpoint(ckpt, verify=False) == ckpt / "epoch_3", "control: unread"
    # the hook resumes from epoch 2 by itself and replays epoch 3 exactly (dropout included)
    res = run_distributed(_fit, 2, str(ckpt), 3, True, True, config=TP2, timeout=TIMEOUT)[0]
    assert res["loaded"] == "epoch_2"
    assert any("epoch_3" in w and "__1_0.distcp" in w for w in res["warnings"]), res["warnings"]
    assert res["losses"] == full["losses"][-SAMPLES // BATCH :], "epoch 3 replayed bit for bit"
    for key, value in full["state"].items():
        assert torch.equal(res["state"][key], value), key
    assert gt.latest_checkpoint(ckpt) == ckpt / "epoch_3", "the replay saved an intact epoch 3"


def test_a_truncated_or_unmarked_latest_is_skipped_with_a_warning(tmp_path):
    ckpt = tmp_path / "ckpt"
    run_distributed(_fit, 2, str(ckpt), 2, False, False, config=TP2, timeout=TIMEOUT)
    latest = ckpt / "epoch_2.pt"
    os.truncate(latest, latest.stat().st_size // 2)  # a dense file cut short
    with gridtrain_warnings() as warnings:
        assert gt.latest_checkpoint(ckpt) == ckpt / "epoch_1.pt"
    assert len(warnings) == 1 and "epoch_2.pt" in warnings[0], warnings
    assert "not a complete gridtrain checkpoint" in warnings[0]
    # the resumed run replays epoch 2 and saves it again under the same name, over the file
    # cut short (it was refused as 'not a gridtrain checkpoint', which ended the resume)
    res = run_distributed(_fit, 2, str(ckpt), 2, True, False, config=TP2, timeout=TIMEOUT)[0]
    assert res["loaded"] == "epoch_1.pt"
    assert gt.latest_checkpoint(ckpt) == latest, "the replay's epoch 2 is whole"
    # a sharded directory that lost its completion marker is named too
    run_distributed(_fit, 2, str(tmp_path / "s"), 1, False, True, config=TP2, timeout=TIMEOUT)
    shutil.copytree(tmp_path / "s" / "epoch_1", ckpt / "epoch_3")
    (ckpt / "epoch_3" / files.MARKER).unlink()
    with gridtrain_warnings() as warnings:
        assert gt.latest_checkpoint(ckpt) == latest
    assert [w for w in warnings if "epoch_3" in w and files.MARKER in w], warnings
    for path in (ckpt / "epoch_1.pt", ckpt / "epoch_2.pt"):
        path.unlink()
    with gridtrain_warnings() as warnings:
        assert gt.latest_checkpoint(ckpt) is None
    assert "no intact checkpoint" in warnings[-1]
