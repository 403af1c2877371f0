"""Resuming: RNG states come back (dropout draws the same masks), the Trainer's hooks save sharded
checkpoints and resume from the newest by themselves, ``latest_checkpoint`` finds it."""

from __future__ import annotations

import os
import time

import torch
from helpers.harness import run_distributed
from helpers.models import adamw_halving, classifier_net
from helpers.runs import Ints, Normal, batches, engine_step, start_engine
from torch.utils.data import TensorDataset

import gridtrain as gt
from gridtrain.engine import LoadCheckpointHook, LossHook, SaveCheckpointHook, Trainer
from gridtrain.engine.checkpoint import files

TIMEOUT = 300
TP2 = dict(parallel=dict(tensor=dict(size=2, mode="1d")))
D_IN, N_CLASSES = 16, 8


def _engine(dropout: float, state=None):
    """Engine with AdamW and a halving LR, weights from ``state`` (else a seed-7 init)."""
    torch.manual_seed(7)
    model = classifier_net(dropout=dropout)
    example = torch.zeros(8, D_IN)  # the engine traces the data flow to plan the splits
    loss = gt.nn.CrossEntropyLoss()
    return start_engine(model, loss, adamw_halving, state, example_inputs=example)


def _dense_state(dropout: float) -> dict:
    torch.manual_seed(0)
    return classifier_net(dropout=dropout).state_dict()


def _dropout_run(ctx, path, sharded, resume):
    """Dropout 0.5 inside the tensor-parallel MLP: (loss of step 3, losses of steps 1-2)."""
    data = batches(3, Normal((8, D_IN)), Ints(N_CLASSES, (8,)))
    engine, sched = _engine(0.5, None if resume else _dense_state(0.5))
    if resume:
        gt.load_checkpoint(path, engine.model, engine.optimizer, sched)
        return engine_step(engine, *data[2], ctx), None
    first = [engine_step(engine, x, y, ctx) for x, y in data[:2]]
    gt.save_checkpoint(path, 2, engine.model, engine.optimizer, sched, sharded)
    return engine_step(engine, *data[2], ctx), first


def test_resume_with_dropout_gives_the_bit_identical_next_loss(tmp_path):
    for sharded in (True, False):
        path = str(tmp_path / ("sharded" if sharded else "dense.pt"))
        whole = run_distributed(_dropout_run, 2, path, sharded, False, config=TP2, timeout=TIMEOUT)
        resumed = run_distributed(_dropout_run, 2, path, sharded, True, config=TP2, timeout=TIMEOUT)
        for (want, first), (got, _) in zip(whole, resumed, strict=True):
            assert first[0] != first[1]
            if sharded:  # every rank's generators restored: the same masks, the same bits
                assert got == want, (got, want)
            else:  # the dense file holds no RNG state: the masks differ (the test can tell)
                assert got != want, "control: without RNG states the step differs"


# ---- the Trainer's hooks -----------------------------------------------------------------------
EPOCHS, SAMPLES, BATCH = 3, 32, 8


def _fit(ctx, ckpt_dir, epochs, auto_resume, async_save):
    g = torch.Generator().manual_seed(3)
    data = TensorDataset(
        torch.randn(SAMPLES, D_IN, generator=g), torch.randint(N_CLASSES, (SAMPLES,), generator=g)
    )
    loader = gt.data.get_dataloader(data, BATCH, shuffle=True, seed=5)
    engine, _ = _engine(0.25, _dense_state(0.25))  # the engine steps its LR scheduler
    hooks = [LossHook(), SaveCheckpointHook(1, ckpt_dir, async_save=async_save)]
    if auto_resume:
        hooks.append(LoadCheckpointHook(ckpt_dir, path="auto"))
    trainer = Trainer(engine)
    trainer.fit(loader, epochs=epochs, hooks=hooks)
    losses = trainer.states["metrics"]["train"]["loss"].step
    return dict(
        state=gt.full_state_dict(engine.model),
        losses=list(losses),
        steps=trainer.cur_step,
        global_step=engine.global_step,
        resumed_from=hooks[2].loaded_path.name if auto_resume and hooks[2].loaded_path else None,
        saved=[p.name for p in hooks[1].saved],
    )


def test_hooks_save_sharded_and_resume_from_the_latest_by_themselves(tmp_path):
    full = run_distributed(
        _fit, 2, str(tmp_path / "a"), EPOCHS, True, False, config=TP2, timeout=TIMEOUT
    )[0]
    assert full["resumed_from"] is None, "an empty directory: training starts from scratch"
    assert full["saved"] == ["epoch_1", "epoch_2", "epoch_3"]
    ckpt = str(tmp_path / "b")
    run_distributed(_fit, 2, ckpt, 1, False, True, config=TP2, timeout=TIMEOUT)  # a run cut short
    res = run_distributed(_fit, 2, ckpt, EPOCHS, True, True, config=TP2, timeout=TIMEOUT)[0]
    assert res["resumed_from"] == "epoch_1"
    assert res["steps"] == full["steps"] and res["global_step"] == full["global_step"]
    per_epoch = SAMPLES // BATCH
    # epochs 2-3 replayed from weights, Adam moments, LR, RNG states (dropout) and the sampler's
    # epoch: the same float ops in the same order, the same bits
    assert res["losses"] == full["losses"][per_epoch:]
    for key, value in full["state"].items():
        assert torch.equal(res["state"][key], value), key
    assert sorted(os.listdir(ckpt)) == ["epoch_1", "epoch_2", "epoch_3"]


def _save_both(ctx, dense: str, sharded: str) -> None:
    model = torch.nn.Linear(2, 2)
    gt.save_checkpoint(dense, 1, model)
    time.sleep(0.01)
    gt.save_checkpoint(sharded, 1, model, sharded=True)


def test_latest_checkpoint_is_the_newest_complete_one(tmp_path):
    assert gt.latest_checkpoint(tmp_path / "missing") is None
    assert gt.latest_checkpoint(tmp_path) is None
    dense, sharded = tmp_path / "b.pt", tmp_path / "a"
    run_distributed(_save_both, 1, str(dense), str(sharded), timeout=TIMEOUT)
    assert gt.latest_checkpoint(tmp_path) == sharded, "newest by completion, not by name"
    time.sleep(0.01)
    (tmp_path / "c").mkdir()  # no marker: an incomplete or foreign directory
    (tmp_path / ".d.tmp-gt.1@h.x").mkdir()  # a temporary in flight
    (tmp_path / ".d.tmp-gt.1@h.x" / files.MARKER).write_text("{}")
    (tmp_path / "notes.txt").write_text("not a checkpoint")
    (tmp_path / "link.pt").symlink_to(dense)
    assert gt.latest_checkpoint(tmp_path) == sharded
    os.utime(dense)  # rewritten later
    assert gt.latest_checkpoint(tmp_path) == dense
