"""Checkpoints: layout-free round trip, atomic writes, and stop-and-resume equal to one run."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F
from helpers.harness import run_distributed
from helpers.models import MLP, mlp
from helpers.runs import Normal, batches, engine_step
from torch.utils.data import TensorDataset

import gridtrain as gt
from gridtrain.amp import AMP_TYPE

PM = gt.ParallelMode
TP2 = dict(parallel=dict(tensor=dict(size=2, mode="1d")))


def _adam(params):
    return torch.optim.Adam(params, lr=1e-2)


def _sched(opt):
    return torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)


def _steps(engine, ctx, data):
    return [engine_step(engine, x, y, ctx) for x, y in data]


def _build(ctx, seed):
    """The dense MLP from ``seed``'s weights; the engine shards it as the config says."""
    model = mlp(seed)
    opt = _adam(model.parameters())
    engine, _, _, sched = gt.initialize(
        model,
        opt,
        criterion=F.mse_loss,
        lr_scheduler=_sched(opt),
        example_inputs=torch.zeros(8, MLP.D_IN),  # traced to plan the splits
    )
    return engine, sched


def _round_trip(ctx, path):
    data = batches(4, Normal((8, MLP.D_IN)), Normal((8, MLP.D_OUT)))
    engine, sched = _build(ctx, 0)
    _steps(engine, ctx, data[:3])
    gt.save_checkpoint(path, 7, engine.model, engine.optimizer, sched)
    saved_opt = gt.full_optimizer_state_dict(engine.model, engine.optimizer)
    fresh, fresh_sched = _build(ctx, 123)  # different weights before loading
    epoch = gt.load_checkpoint(path, fresh.model, fresh.optimizer, fresh_sched)
    loaded_opt = gt.full_optimizer_state_dict(fresh.model, fresh.optimizer)
    a, b = gt.full_state_dict(fresh.model), gt.full_state_dict(engine.model)
    same_model = a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # one more step from both: equal only if Adam's moments and step count came back
    _steps(engine, ctx, data[3:])
    _steps(fresh, ctx, data[3:])
    after = [gt.full_state_dict(e.model) for e in (engine, fresh)]
    return (
        epoch,
        same_model,
        saved_opt,
        loaded_opt,
        (sched.state_dict(), fresh_sched.state_dict()),
        after,
    )


def _load_dense(ctx, path):
    engine, sched = _build(ctx, 5)
    epoch = gt.load_checkpoint(path, engine.model, engine.optimizer, sched)
    return epoch, gt.full_optimizer_state_dict(engine.model, engine.optimizer)


def _assert_state_equal(a, b):
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].keys() == b[name].keys()
        for k in a[name]:
            assert torch.equal(torch.as_tensor(a[name][k]), torch.as_tensor(b[name][k])), (name, k)


def test_round_trip_under_tensor_parallelism_and_into_a_dense_model(tmp_path):
    path = str(tmp_path / "ckpt.pt")
    results = run_distributed(_round_trip, 2, path, config=TP2, timeout=300)
    for epoch, same_model, saved_opt, loaded_opt, (s1, s2), after in results:
        assert epoch == 7 and same_model
        _assert_state_equal(saved_opt["state"], loaded_opt["state"])  # exact copies
        assert saved_opt["state"]["fc1.weight"]["exp_avg"].shape == (16, 8), "stored dense"
        assert s1 == s2, "LR scheduler restored"
        for key in after[0]:
            assert torch.equal(after[0][key], after[1][key]), key  # bit-exact: same ops, same state
    # the same file loads into the model built with no parallelism
    ((epoch, dense_opt),) = run_distributed(_load_dense, 1, path, timeout=300)
    assert epoch == 7
    _assert_state_equal(dense_opt["state"], results[0][2]["state"])


def _train_epochs(ctx, path, fp16, epochs, resume_from, sharded=False):
    g = torch.Generator().manual_seed(3)
    dataset = TensorDataset(torch.randn(32, 8, generator=g), torch.randn(32, 4, generator=g))
    loader = gt.data.get_dataloader(dataset, batch_size=4, shuffle=True, seed=11)
    engine, sched = _build(ctx, 0 if resume_from is None else 99)
    start = (
        0
        if resume_from is None
        else gt.load_checkpoint(path, engine.model, engine.optimizer, sched)
    )
    losses = {}
    for epoch in range(start, epochs):
        loader.sampler.set_epoch(epoch)
        losses[epoch] = _steps(engine, ctx, list(loader))
        gt.save_checkpoint(path, epoch + 1, engine.model, engine.optimizer, sched, sharded)
    scale = getattr(engine.optimizer, "scaler", None)
    return losses, scale.state_dict() if scale is not None else None


@pytest.mark.parametrize("sharded", [False, True], ids=["dense", "sharded"])
@pytest.mark.parametrize("fp16", [None, AMP_TYPE.NAIVE])
def test_stop_and_resume_equals_uninterrupted(tmp_path, fp16, sharded):
    config = dict(fp16=dict(mode=fp16, initial_scale=2.0**10, growth_interval=3)) if fp16 else {}
    args = dict(config=config, timeout=300)
    whole = run_distributed(_train_epochs, 2, str(tmp_path / "a"), fp16, 3, None, sharded, **args)
    part = str(tmp_path / "b")
    run_distributed(_train_epochs, 2, part, fp16, 1, None, sharded, **args)
    resumed = run_distributed(_train_epochs, 2, part, fp16, 3, 1, sharded, **args)
    for (full, full_scale), (rest, rest_scale) in zip(whole, resumed, strict=True):
        assert sorted(rest) == [1, 2]
        # deterministic CPU run, same weights (fp32 masters under naive fp16), optimizer,
        # scheduler, scaler and data order: the losses are bit-identical
        assert rest[1] == full[1] and rest[2] == full[2]
        assert rest_scale == full_scale
    assert sorted(os.listdir(tmp_path)) == ["a", "b"], "no temporary left"


def _save_twice_crash_second(ctx, path):
    model = MLP()
    engine, _, _, _ = gt.initialize(model, _adam(model.parameters()))
    gt.save_checkpoint(path, 1, engine.model, engine.optimizer)
    real_save = torch.save

    def crashing_save(obj, f, *args, **kwargs):
        f.write(b"partial checkpoint bytes")
        raise OSError("disk full (simulated)")

    torch.save = crashing_save
    try:
        with pytest.raises(OSError, match="simulated"):
            gt.save_checkpoint(path, 2, engine.model, engine.optimizer)
    finally:
        torch.save = real_save
    return gt.load_checkpoint(path, engine.model, engine.optimizer)


def test_failed_save_keeps_the_previous_checkpoint(tmp_path):
    path = tmp_path / "ckpt.pt"
    assert run_distributed(_save_twice_crash_second, 1, str(path), timeout=300) == [1]
    assert os.listdir(tmp_path) == ["ckpt.pt"], "the temporary file was removed"


def test_killed_mid_save_leaves_previous_checkpoint_and_the_next_save_cleans_up(tmp_path):
    path = tmp_path / "ckpt.pt"
    torch.save({"format": 1, "epoch": 1}, path)
    # a process killed while writing: no cleanup code runs at all
    script = textwrap.dedent(
        f"""
        import os, torch
        from pathlib import Path
        from gridtrain.engine.checkpoint import files
        def dying_save(obj, f, *a, **k):
            f.write(b"partial"); f.flush(); os._exit(9)
        torch.save = dying_save
        files.atomic_torch_save({{"epoch": 2}}, Path({str(path)!r}))
        """
    )
    proc = subprocess.run([sys.executable, "-c", script], check=False)
    assert proc.returncode == 9
    assert torch.load(path, weights_only=True)["epoch"] == 1, "the old checkpoint is intact"
    leftovers = [n for n in os.listdir(tmp_path) if n != "ckpt.pt"]
    assert len(leftovers) == 1 and leftovers[0].startswith(".ckpt.pt.tmp-gt."), leftovers
    # the next save (any name, same directory) removes the dead process's temporary
    run_distributed(_save_twice_crash_second, 1, str(tmp_path / "other.pt"), timeout=300)
    assert sorted(os.listdir(tmp_path)) == ["ckpt.pt", "other.pt"]
