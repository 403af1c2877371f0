"""The Trainer drives a ZeRO engine like any other: the same per-step losses and weights as plain
data parallelism, and SaveCheckpointHook / LoadCheckpointHook resume a ZeRO run bit for bit."""

from __future__ import annotations

import pytest
import torch
from helpers.harness import run_distributed
from test_trainer import EPOCHS, GAMMA, GLOBAL_BATCH, N_TRAIN, TIMEOUT, _engine, _model, _records

import gridtrain as gt
from gridtrain.engine import (
    LoadCheckpointHook,
    LossHook,
    LRSchedulerHook,
    SaveCheckpointHook,
    Trainer,
)


def _fit(ctx, ckpt_dir, resume_epoch):
    model = _model()
    if resume_epoch is not None:  # start from other weights: the checkpoint must replace them
        torch.nn.init.normal_(model[0].weight)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.05)
    sched = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=GAMMA)
    engine, train_dl, _ = _engine(ctx, model, optimizer)
    hooks = [LossHook(), LRSchedulerHook(sched), SaveCheckpointHook(1, ckpt_dir, suffix="_z")]
    if resume_epoch is not None:
        hooks.append(LoadCheckpointHook(ckpt_dir, epoch=resume_epoch, suffix="_z"))
    trainer = Trainer(engine)
    trainer.fit(train_dl, epochs=EPOCHS, hooks=hooks)
    return dict(state=gt.full_state_dict(engine.model), records=_records(trainer))


@pytest.mark.parametrize("stage", [2, 3])
def test_trainer_with_zero_resumes_and_matches_plain_data_parallel(stage, tmp_path):
    plain = run_distributed(_fit, 2, str(tmp_path / "plain"), None, timeout=TIMEOUT)[0]
    ckpt = str(tmp_path / "zero")
    config = dict(zero=stage)
    full = run_distributed(_fit, 2, ckpt, None, config=config, timeout=TIMEOUT)[0]
    # fp32; two ranks' gradients sum alike reduce-scattered or all-reduced, Adam elementwise
    assert full["records"]["train"]["loss"][0] == pytest.approx(
        plain["records"]["train"]["loss"][0], rel=1e-6
    )
    for key, value in plain["state"].items():
        torch.testing.assert_close(full["state"][key], value, rtol=1e-5, atol=1e-6)
    resumed = run_distributed(_fit, 2, ckpt, 1, config=config, timeout=TIMEOUT)[0]
    per_epoch = N_TRAIN // GLOBAL_BATCH
    # epochs 2-3 replayed from the sharded weights, Adam rows and LR of epoch 1: same bits
    assert resumed["records"]["train"]["loss"][0] == full["records"]["train"]["loss"][0][per_epoch:]
    for key, value in full["state"].items():
        torch.testing.assert_close(resumed["state"][key], value, rtol=0, atol=0)
