"""Sharded (DCP) checkpoints: written under one layout, resumed under others, one copy on disk.

Two AdamW steps under 2d on 4 ranks, saved sharded; loaded under 3d on 8 ranks,
1d x pipeline on 4 and one process, the third step lands where the dense
single-process run's third step does. The directory holds one copy of the state
whatever the number of replicas; expert shards reshard between expert-parallel
sizes; an asynchronous save writes the state of the moment it was called.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch
from helpers.harness import run_distributed
from helpers.layouts import layout
from helpers.models import adamw_halving, classifier_net
from helpers.runs import Ints, Normal, batches, data_rows, engine_step, reference_run, start_engine
from torch.distributed.checkpoint import FileSystemReader

import gridtrain as gt
from gridtrain.parallel.sharding import shard_tensor
from gridtrain.parallel.tags import set_shard_spec

TIMEOUT = 300
D_IN, BATCH = 16, 8


def _data(steps: int) -> list:
    return batches(steps, Normal((BATCH, D_IN)), Ints(8, (BATCH,)))


def _net(seed: int = 7, hidden: int = 32):
    torch.manual_seed(seed)
    return classifier_net(hidden)


def dense_state(seed: int = 0, hidden: int = 32) -> dict:
    return _net(seed, hidden).state_dict()


def build(ctx, state=None, hidden: int = 32):
    """Engine with AdamW and a halving LR, weights from ``state`` (else a seed-7 init)."""
    example = torch.zeros(BATCH, D_IN)  # the engine traces the data flow to plan the splits
    model = _net(7, hidden)
    return start_engine(
        model, gt.nn.CrossEntropyLoss(), adamw_halving, state, example_inputs=example
    )


def step(engine, ctx, x, y) -> float | None:
    """One optimizer step on the whole global batch (every data-parallel replica the same)."""
    return engine_step(engine, x, y, ctx)


def load_and_continue(ctx, path, data):
    """Load into a fresh model (another init), then train on ``data``: (epoch, losses, dense
    state after loading, dense optimizer state after loading, dense state at the end, lr)."""
    engine, sched = build(ctx)
    epoch = gt.load_checkpoint(path, engine.model, engine.optimizer, sched)
    loaded = gt.full_state_dict(engine.model)
    loaded_opt = gt.full_optimizer_state_dict(engine.model, engine.optimizer)["state"]
    lr = engine.optimizer.param_groups[0]["lr"]
    losses = [step(engine, ctx, x, y) for x, y in data]
    return epoch, losses, loaded, loaded_opt, gt.full_state_dict(engine.model), lr


LAYOUTS = {
    "3d-8": layout("3d8"),
    "1d2-x-pp2": layout("1d2-pp2", num_microbatches=2),
    "one-process": (1, None),
}


def _close(got, want, what):
    # float32; the layouts reorder sums (sharded matmuls, LayerNorm statistics over the grid),
    # so gradients differ by ulps, and Adam's m / sqrt(v) amplifies relative differences where
    # v is tiny: measured <= 1.4e-5 relative after three steps. rtol 1e-4 leaves margin and
    # still catches a wrong chunk, a lost moment or a missing step count by orders of magnitude.
    assert got.keys() == want.keys(), what
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=1e-4, atol=1e-6, msg=f"{what} {key}")


def _train_2d_and_save(ctx, state, data, path):
    engine, sched = build(ctx, state)
    losses = [step(engine, ctx, x, y) for x, y in data]
    gt.save_checkpoint(path, len(data), engine.model, engine.optimizer, sched, sharded=True)
    return losses


def test_2d_checkpoint_resumes_under_3d_pipeline_and_one_process(tmp_path):
    state, data = dense_state(0), _data(3)
    loss = gt.nn.CrossEntropyLoss()
    ref = reference_run(lambda: _net(0), data, loss, adamw_halving)  # plain PyTorch
    ref_opt = reference_run(lambda: _net(0), data[:2], loss, adamw_halving).optim["state"]
    path = str(tmp_path / "ckpt")
    two_d = dict(parallel=dict(tensor=dict(size=4, mode="2d")))
    run_distributed(_train_2d_and_save, 4, state, data[:2], path, config=two_d, timeout=TIMEOUT)
    assert sorted(os.listdir(tmp_path)) == ["ckpt"], "no temporary left beside it"
    for name, (world, config) in LAYOUTS.items():
        results = run_distributed(
            load_and_continue, world, path, data[2:], config=config, timeout=TIMEOUT
        )
        for epoch, _, loaded, loaded_opt, final, lr in results:
            assert epoch == 2 and lr == pytest.approx(1e-2 * 0.5**2), name  # scheduler resumed
            _close(loaded, ref.states[2], f"{name}: weights after loading")
            assert loaded_opt.keys() == ref_opt.keys(), name
            for param, moments in ref_opt.items():
                _close(loaded_opt[param], moments, f"{name}: {param} optimizer state")
            _close(final, ref.states[3], f"{name}: weights after the third step")
        # the last rank sees the loss in every layout (a pipeline's last stage)
        assert results[-1][1][0] == pytest.approx(ref.losses[2], rel=1e-5), name


def _save_replicated(ctx, state, path):
    engine, sched = build(ctx, state, hidden=4096)
    step(engine, ctx, *_data(1)[0])
    gt.save_checkpoint(path, 1, engine.model, engine.optimizer, sched, sharded=True)
    full = gt.full_state_dict(engine.model)
    opt = gt.full_optimizer_state_dict(engine.model, engine.optimizer)["state"]
    return sum(t.numel() * t.element_size() for t in full.values()) + sum(
        t.numel() * t.element_size() for s in opt.values() for t in s.values()
    )


def test_written_bytes_are_one_copy_of_the_state(tmp_path):
    """dp 2 x 2d 4 = 8 ranks, every weight held by two replicas: written once."""
    path = tmp_path / "ckpt"
    config = dict(parallel=dict(tensor=dict(size=4, mode="2d")))
    state = dense_state(0, hidden=4096)
    one_copy = run_distributed(
        _save_replicated, 8, state, str(path), config=config, timeout=TIMEOUT
    )[0]
    # exactly: the chunks DCP recorded tile each dense tensor once
    metadata = FileSystemReader(path).read_metadata().state_dict_metadata
    recorded = sum(
        chunk.sizes.numel() * meta.properties.dtype.itemsize
        for meta in metadata.values()
        if hasattr(meta, "chunks")
        for chunk in meta.chunks
    )
    assert recorded == one_copy, (recorded, one_copy)
    # on disk: one copy plus torch.save's framing of each chunk (~2.5 KB); writing every replica
    # would double the data (ratio >= 2)
    sizes = {p.name: p.stat().st_size for p in path.glob("*.distcp")}
    assert len(sizes) == 8
    chunks = sum(len(m.chunks) for m in metadata.values() if hasattr(m, "chunks"))
    framing = (sum(sizes.values()) - one_copy) / chunks
    ratio = sum(sizes.values()) / one_copy
    print(
        f"{sum(sizes.values())} bytes on disk for a {one_copy}-byte state ({ratio:.3f}x, "
        f"{chunks} chunks, {framing:.0f} bytes of framing each)"
    )
    assert 0 < framing < 4096 and ratio < 1.3, sizes
    # spread: the dedup hands each replicated chunk to the replica writing least
    assert sum(1 for s in sizes.values() if s > 0.05 * one_copy) >= 4, sizes


# ---- packed blocks (fused q/k/v) -----------------------------------------------------------------
class _Fused(torch.nn.Module):
    """A fused q/k/v weight: each of the 3 packed blocks is split over TENSOR (3 chunks a rank)."""

    def __init__(self, ctx, dense):
        super().__init__()
        spec = ((0, gt.ParallelMode.TENSOR, 3),)
        self.qkv = torch.nn.Parameter(shard_tensor(dense, spec, ctx))
        set_shard_spec(self.qkv, *spec)


def _fused_save(ctx, dense, path):
    model = _Fused(ctx, dense)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    (model.qkv * (ctx.global_rank + 1)).sum().backward()
    opt.step()
    gt.save_checkpoint(path, 1, model, opt, sharded=True)
    return gt.full_state_dict(model), gt.full_optimizer_state_dict(model, opt)["state"]


def _fused_load(ctx, path):
    model = _Fused(ctx, torch.zeros(24, 8))
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    gt.load_checkpoint(path, model, opt)
    return gt.full_state_dict(model), gt.full_optimizer_state_dict(model, opt)["state"]


def test_packed_blocks_are_saved_as_one_chunk_per_block_and_reshard(tmp_path):
    path = str(tmp_path / "fused")
    tp = lambda n: dict(parallel=dict(tensor=dict(size=n, mode="1d")))  # noqa: E731
    dense = torch.randn(24, 8, generator=torch.Generator().manual_seed(0))
    saved, saved_opt = run_distributed(_fused_save, 2, dense, path, config=tp(2), timeout=TIMEOUT)[
        0
    ]
    chunks = FileSystemReader(path).read_metadata().state_dict_metadata["model/qkv"].chunks
    assert sorted(c.offsets[0] for c in chunks) == [0, 4, 8, 12, 16, 20], "3 blocks x 2 ranks"
    for world in (4, 1):
        for got, got_opt in run_distributed(
            _fused_load, world, path, config=tp(world), timeout=TIMEOUT
        ):
            assert torch.equal(got["qkv"], saved["qkv"]), world
            for key, value in saved_opt["qkv"].items():
                assert torch.equal(torch.as_tensor(got_opt["qkv"][key]), torch.as_tensor(value))


# ---- expert shards -----------------------------------------------------------------------------
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def _moe_model(seed):
    from demos.moe.model import MoeCriterion, WideNet, WideNetConfig

    cfg = WideNetConfig(img_size=8, patch_size=4, depth=2, hidden=16, heads=2, ffn=16,
                        num_experts=4, top_k=2, capacity_factor_train=16.0,
                        capacity_factor_eval=16.0)  # fmt: skip
    torch.manual_seed(seed)
    model = WideNet(cfg)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    engine, *_ = gt.initialize(model, opt, criterion=MoeCriterion(model))
    return engine


def _moe_save(ctx, path):
    engine = _moe_model(5)
    (batch,) = batches(1, Normal((8, 3, 8, 8)), Ints(10, (8,)), seed=11)
    engine_step(engine, *data_rows(batch, ctx), ctx)
    gt.save_checkpoint(path, 1, engine.model, engine.optimizer, sharded=True)
    return (
        gt.full_state_dict(engine.model),
        gt.full_optimizer_state_dict(engine.model, engine.optimizer)["state"],
    )


def _moe_load(ctx, path):
    engine = _moe_model(99)  # another init: everything must come from the checkpoint
    gt.load_checkpoint(path, engine.model, engine.optimizer)
    return (
        gt.full_state_dict(engine.model),
        gt.full_optimizer_state_dict(engine.model, engine.optimizer)["state"],
    )


def test_expert_shards_reshard_between_expert_parallel_sizes(tmp_path):
    path = str(tmp_path / "moe")
    ep = lambda n: dict(moe=dict(expert_parallel_size=n))  # noqa: E731
    saved, saved_opt = run_distributed(_moe_save, 4, path, config=ep(4), timeout=TIMEOUT)[0]
    assert saved["moe.experts.w1"].shape == (4, 16, 16), "the dense experts, all four"
    for n in (2, 1):
        for got, got_opt in run_distributed(_moe_load, 4, path, config=ep(n), timeout=TIMEOUT):
            for key, value in saved.items():
                assert torch.equal(got[key], value), (n, key)  # a copy: exact
            for name, moments in saved_opt.items():
                for k, v in moments.items():
                    assert torch.equal(torch.as_tensor(got_opt[name][k]), torch.as_tensor(v))


# ---- asynchronous save -------------------------------------------------------------------------
def _async_save_then_train(ctx, state, path):
    engine, sched = build(ctx, state)
    data = _data(3)
    for x, y in data[:2]:
        step(engine, ctx, x, y)
    at_save = gt.full_state_dict(engine.model)
    handle = gt.save_checkpoint(
        path, 2, engine.model, engine.optimizer, sched, sharded=True, async_save=True
    )
    step(engine, ctx, *data[2])  # training goes on while the shards are written
    assert handle.wait() == Path(path) and handle.done()
    fresh, fresh_sched = build(ctx)
    epoch = gt.load_checkpoint(path, fresh.model, fresh.optimizer, fresh_sched)
    loaded = gt.full_state_dict(fresh.model)
    same = all(torch.equal(loaded[k], v) for k, v in at_save.items())
    # and the resumed third step equals the one taken after the save
    step(fresh, ctx, *data[2])
    after = [gt.full_state_dict(e.model) for e in (engine, fresh)]
    resumed = all(torch.equal(after[0][k], after[1][k]) for k in after[0])
    return epoch, same, resumed, handle.stall_s


def test_async_save_writes_the_state_of_the_call(tmp_path):
    path = str(tmp_path / "ckpt")
    config = dict(parallel=dict(tensor=dict(size=2, mode="1d")))
    for epoch, same, resumed, stall in run_distributed(
        _async_save_then_train, 2, dense_state(0), path, config=config, timeout=TIMEOUT
    ):
        assert epoch == 2 and same, "the snapshot is the state when save_checkpoint was called"
        assert resumed, "same layout, same ops: the resumed step is bit-identical"
        assert stall >= 0
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]
