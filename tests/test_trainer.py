"""Trainer and hooks on 1 and 2 gloo ranks, checked against a hand-written PyTorch loop.

The model is one Linear layer on a fixed synthetic set. The global batch is 8
on every world size (8 // world per data rank, unshuffled), so a data-parallel
step sees exactly the samples ``X[8k : 8k+8]`` of the reference loop and every
metric has one right value, computed here without gridtrain.
"""

import csv
import math

import pytest
import torch
import torch.nn.functional as F
from helpers.harness import run_distributed
from helpers.layouts import layout
from torch.utils.data import TensorDataset

import gridtrain as gt
from gridtrain.engine import (
    AccuracyHook,
    CSVLogHook,
    LoadCheckpointHook,
    LogMetricByEpochHook,
    LossCurveHook,
    LossHook,
    LRSchedulerHook,
    SaveCheckpointHook,
    TensorboardHook,
    ThroughputHook,
    Trainer,
)

IN, HIDDEN, CLASSES, N_TRAIN, N_TEST, GLOBAL_BATCH = 8, 16, 4, 32, 28, 8
EPOCHS, LR, GAMMA = 3, 0.5, 0.5
TIMEOUT = 300


def _data():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N_TRAIN + N_TEST, IN, generator=g)
    teacher = torch.randn(IN, CLASSES, generator=g)
    y = (x @ teacher + 0.5 * torch.randn(N_TRAIN + N_TEST, CLASSES, generator=g)).argmax(-1)
    return (x[:N_TRAIN], y[:N_TRAIN]), (x[N_TRAIN:], y[N_TRAIN:])


def _model():
    torch.manual_seed(3)
    return torch.nn.Sequential(
        torch.nn.Linear(IN, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, CLASSES)
    )


def _records(trainer):
    return {
        phase: {n: (r.step, r.step_at, r.epoch, r.epoch_step) for n, r in recs.items()}
        for phase, recs in trainer.states["metrics"].items()
    }


def _engine(ctx, model, optimizer, lr_scheduler=None):
    (xt, yt), (xs, ys) = _data()
    per_rank = GLOBAL_BATCH // ctx.data_parallel_size
    train_dl = gt.data.get_dataloader(TensorDataset(xt, yt), per_rank, drop_last=True)
    # 28 test samples: a short last batch (14 per data rank at world 2 -> 4,4,4,2)
    test_dl = gt.data.get_dataloader(TensorDataset(xs, ys), per_rank)
    engine, train_dl, test_dl, _ = gt.initialize(
        model, optimizer, torch.nn.CrossEntropyLoss(), train_dl, test_dl, lr_scheduler
    )
    return engine, train_dl, test_dl


def _fit_with_every_hook(ctx, out_dir):
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    sched = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=GAMMA)
    engine, train_dl, test_dl = _engine(ctx, model, optimizer)
    log = LogMetricByEpochHook()
    hooks = [
        log,
        CSVLogHook(f"{out_dir}/metrics.csv"),
        TensorboardHook(f"{out_dir}/tb"),
        LossCurveHook(f"{out_dir}/loss.png"),
        LossHook(),
        AccuracyHook(),
        ThroughputHook(),
        LRSchedulerHook(sched, by_epoch=True),
    ]
    trainer = Trainer(engine)
    summary = trainer.fit(
        train_dl, epochs=EPOCHS, test_dataloader=test_dl, hooks=hooks, display_progress=True
    )
    order = [type(h).__name__ for h in trainer.hooks]
    return dict(
        records=_records(trainer),
        summary=summary,
        lines=log.lines,
        order=order,
        final_lr=optimizer.param_groups[0]["lr"],
        state=gt.full_state_dict(engine.model),
        steps=trainer.cur_step,
    )


def _reference():
    """The same training written as a plain single-process PyTorch loop."""
    (xt, yt), (xs, ys) = _data()
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    step_loss, step_lr, train_loss, train_acc, test_loss, test_acc, lrs = ([] for _ in range(7))
    for _ in range(EPOCHS):
        correct = 0
        for k in range(N_TRAIN // GLOBAL_BATCH):
            xb, yb = xt[k * 8 : k * 8 + 8], yt[k * 8 : k * 8 + 8]
            out = model(xb)
            loss = F.cross_entropy(out, yb)
            correct += int((out.argmax(-1) == yb).sum())
            step_loss.append(loss.item())
            step_lr.append(optimizer.param_groups[0]["lr"])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        lrs.append(optimizer.param_groups[0]["lr"])
        for group in optimizer.param_groups:
            group["lr"] *= GAMMA
        n = N_TRAIN // GLOBAL_BATCH
        train_loss.append(sum(step_loss[-n:]) / n)
        train_acc.append(correct / N_TRAIN)
        with torch.no_grad():
            out = model(xs)
        test_loss.append(F.cross_entropy(out, ys).item())  # mean over all 28 samples
        test_acc.append(int((out.argmax(-1) == ys).sum()) / N_TEST)
    return dict(
        step_loss=step_loss,
        step_lr=step_lr,
        train_loss=train_loss,
        train_acc=train_acc,
        test_loss=test_loss,
        test_acc=test_acc,
        lr=lrs,
        state=model.state_dict(),
        final_lr=optimizer.param_groups[0]["lr"],
    )


LAYOUTS = [layout("one process"), layout("dp2"), layout("dp2-pp2", num_microbatches=2)]


@pytest.mark.parametrize("world,config", LAYOUTS, ids=["w1", "dp2", "dp2-pp2"])
def test_fit_records_the_reference_metrics_on_every_rank(world, config, tmp_path):
    results = run_distributed(
        _fit_with_every_hook, world, str(tmp_path), config=config, timeout=TIMEOUT
    )
    for r in results[1:]:
        # every rank reads the same all-reduced float64 numbers: bitwise equal
        assert r["records"] == results[0]["records"]
    ref = _reference()
    res = results[0]
    train, test = res["records"]["train"], res["records"]["test"]
    steps = EPOCHS * N_TRAIN // GLOBAL_BATCH
    assert res["steps"] == steps
    # float32 forward/backward; world 2 averages two half-batch gradients instead of one
    # full-batch one (different summation order), so allow a few float32 ulps of drift
    tol = dict(rel_tol=1e-5, abs_tol=1e-6)
    loss_step, loss_at, loss_epoch, _ = train["loss"]
    assert loss_at == list(range(1, steps + 1))
    assert all(math.isclose(a, b, **tol) for a, b in zip(loss_step, ref["step_loss"], strict=True))
    assert all(
        math.isclose(a, b, **tol) for a, b in zip(loss_epoch, ref["train_loss"], strict=True)
    )
    # test loss: the mean over all 28 samples although the last batches are short
    assert all(
        math.isclose(a, b, **tol) for a, b in zip(test["loss"][2], ref["test_loss"], strict=True)
    )
    # accuracies are counts / total: exact once the argmaxes agree (no near-ties in this data)
    assert train["accuracy"][2] == ref["train_acc"]
    assert test["accuracy"][2] == ref["test_acc"]
    assert test["loss"][3] == [N_TRAIN // GLOBAL_BATCH * e for e in range(1, EPOCHS + 1)]
    # LR: stepped once per epoch by the hook, recorded per step and per epoch
    assert train["lr"][0] == pytest.approx(ref["step_lr"], rel=1e-12)
    assert train["lr"][2] == pytest.approx(ref["lr"], rel=1e-12)
    assert res["final_lr"] == pytest.approx(ref["final_lr"], rel=1e-12)
    for key, value in ref["state"].items():
        torch.testing.assert_close(res["state"][key], value, rtol=1e-5, atol=1e-6)  # as above
    # throughput: a positive rate per train epoch and per evaluation
    assert len(train["throughput"][2]) == EPOCHS and min(train["throughput"][2]) > 0
    assert len(test["throughput"][2]) == EPOCHS
    assert res["summary"]["test"]["accuracy"] == ref["test_acc"][-1]
    # hooks run by priority: metric hooks (0) and LR (1) before the loggers (10, 11)
    assert res["order"][:4] == ["LossHook", "AccuracyHook", "ThroughputHook", "LRSchedulerHook"]
    assert len(res["lines"]) == 2 * EPOCHS and res["lines"][0].startswith("epoch 1/3 train:")
    _check_files(tmp_path, res["records"])


def _check_files(out_dir, records):
    with open(out_dir / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    loss_rows = [r for r in rows if r["phase"] == "train" and r["metric"] == "loss"]
    steps = [float(r["value"]) for r in loss_rows if r["kind"] == "step"]
    assert steps == records["train"]["loss"][0], "CSV holds every step's loss, exactly"
    test_acc = [
        float(r["value"]) for r in rows if r["phase"] == "test" and r["metric"] == "accuracy"
    ]
    assert test_acc == records["test"]["accuracy"][2]

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(out_dir / "tb"))
    events.Reload()
    scalars = events.Scalars("train/loss")
    assert [e.step for e in scalars] == records["train"]["loss"][1]
    assert [e.value for e in scalars] == pytest.approx(records["train"]["loss"][0], rel=1e-6)  # f32
    assert "test/accuracy" in events.Tags()["scalars"]

    png = (out_dir / "loss.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 1000


def _train_with_checkpoints(ctx, ckpt_dir, resume_epoch):
    model = _model()
    if resume_epoch is not None:  # start from other weights: the checkpoint must replace them
        torch.nn.init.normal_(model[0].weight)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.05)
    sched = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=GAMMA)
    engine, train_dl, _ = _engine(ctx, model, optimizer)
    hooks = [LossHook(), LRSchedulerHook(sched), SaveCheckpointHook(1, ckpt_dir, suffix="_t")]
    if resume_epoch is not None:
        hooks.append(LoadCheckpointHook(ckpt_dir, epoch=resume_epoch, suffix="_t"))
    trainer = Trainer(engine)
    trainer.fit(train_dl, epochs=EPOCHS, hooks=hooks)
    return dict(
        state=gt.full_state_dict(engine.model),
        records=_records(trainer),
        saved=[p.name for p in hooks[2].saved],
        steps=trainer.cur_step,
    )


def test_save_checkpoint_hook_writes_and_load_checkpoint_hook_resumes(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    full = run_distributed(_train_with_checkpoints, 2, ckpt, None, timeout=TIMEOUT)[0]
    assert full["saved"] == ["epoch_1_t", "epoch_2_t", "epoch_3_t"]  # sharded directories
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == full["saved"]
    resumed = run_distributed(_train_with_checkpoints, 2, ckpt, 1, timeout=TIMEOUT)
    assert resumed[0]["records"] == resumed[1]["records"]
    res = resumed[0]
    per_epoch = N_TRAIN // GLOBAL_BATCH
    assert res["steps"] == EPOCHS * per_epoch, "step counter resumes from the checkpoint"
    assert res["records"]["train"]["loss"][1] == list(range(per_epoch + 1, EPOCHS * per_epoch + 1))
    # epochs 2-3 replayed from model + Adam moments + LR of epoch 1: the same float ops in the
    # same order, so the same bits (a lost Adam state or LR would differ at the 1e-2 level)
    assert res["records"]["train"]["loss"][0] == full["records"]["train"]["loss"][0][per_epoch:]
    assert res["records"]["train"]["lr"][2] == full["records"]["train"]["lr"][2][1:]
    for key, value in full["state"].items():
        torch.testing.assert_close(res["state"][key], value, rtol=0, atol=0)


def _lr_per_step_and_bad_args(ctx):
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    sched = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=GAMMA)
    engine, train_dl, _ = _engine(ctx, model, optimizer)
    trainer = Trainer(engine)
    trainer.fit(train_dl, epochs=5, max_steps=6, hooks=[LRSchedulerHook(sched, by_epoch=False)])
    stepped = (trainer.cur_step, trainer.cur_epoch, trainer.states["metrics"]["train"]["lr"].step)

    errors = []
    for call in (
        lambda: trainer.fit(train_dl, epochs=0),
        lambda: trainer.fit(train_dl, epochs=1, max_steps=0),
        lambda: trainer.fit(train_dl, epochs=1, hooks=[object()]),
        lambda: Trainer(object()),
    ):
        try:
            call()
        except (ValueError, TypeError) as err:
            errors.append(str(err))
    # a scheduler the engine already steps cannot also be stepped per epoch
    engine2, *_ = _engine(ctx, model, optimizer, lr_scheduler=sched)
    try:
        Trainer(engine2).fit(train_dl, epochs=1, hooks=[LRSchedulerHook(sched, by_epoch=True)])
    except ValueError as err:
        errors.append(str(err))
    return stepped, errors


def test_lr_scheduler_steps_per_step_max_steps_and_clear_errors():
    (steps, epochs, lrs), errors = run_distributed(_lr_per_step_and_bad_args, 1, timeout=TIMEOUT)[0]
    assert steps == 6 and epochs == 2, "max_steps=6 stops in the second 4-step epoch"
    assert lrs == pytest.approx([GAMMA**k for k in range(6)], rel=1e-12)
    assert len(errors) == 5
    assert "epochs must be a positive int, got 0" in errors[0]
    assert "max_steps must be None or a positive int, got 0" in errors[1]
    assert "hooks[0] must be a gridtrain.engine.BaseHook, got object" in errors[2]
    assert "missing train()" in errors[3]
    assert "already steps it" in errors[4]
