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
from helpers.checkpoint_models import (
    batches,
    build,
    dense_run,
    dense_state,
    load_and_continue,
    step,
)
from helpers.harness import run_distributed

import gridtrain as gt
from gridtrain.engine.checkpoint import load_checkpoint, save_checkpoint
from gridtrain.engine.checkpoint.dense import dense_optimizer_state
from gridtrain.engine.checkpoint.sharded import _SafeReader
from gridtrain.parallel.sharding import shard_tensor
from gridtrain.parallel.tags import set_shard_spec

TIMEOUT = 300
LAYOUTS = {
    "3d-8": (8, dict(parallel=dict(tensor=dict(size=8, mode="3d")))),
    "1d2-x-pp2": (
        4,
        dict(parallel=dict(pipeline=2, tensor=dict(size=2, mode="1d")), num_microbatches=2),
    ),
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
    losses = [step(engine, x, y) for x, y in data]
    save_checkpoint(path, len(data), engine.model, engine.optimizer, sched, sharded=True)
    return losses


def test_2d_checkpoint_resumes_under_3d_pipeline_and_one_process(tmp_path):
    state, data = dense_state(0), batches(3)
    ref = run_distributed(dense_run, 1, state, data, timeout=TIMEOUT)[0]
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
            _close(loaded, ref[1][1], f"{name}: weights after loading")
            assert loaded_opt.keys() == ref[1][2].keys(), name
            for param, moments in ref[1][2].items():
                _close(loaded_opt[param], moments, f"{name}: {param} optimizer state")
            _close(final, ref[2][1], f"{name}: weights after the third step")
        # the last rank sees the loss in every layout (a pipeline's last stage)
        assert results[-1][1][0] == pytest.approx(ref[2][0], rel=1e-5), name


def _save_replicated(ctx, state, path):
    engine, sched = build(ctx, state, hidden=4096)
    step(engine, *batches(1)[0])
    save_checkpoint(path, 1, engine.model, engine.optimizer, sched, sharded=True)
    full = gt.full_state_dict(engine.model, ctx)
    opt = dense_optimizer_state(engine.optimizer, engine.model, ctx)["state"]
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
    metadata = _SafeReader(path).read_metadata().state_dict_metadata
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
    save_checkpoint(path, 1, model, opt, sharded=True)
    return gt.full_state_dict(model, ctx), dense_optimizer_state(opt, model, ctx)["state"]


def _fused_load(ctx, path):
    model = _Fused(ctx, torch.zeros(24, 8))
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    load_checkpoint(path, model, opt)
    return gt.full_state_dict(model, ctx), dense_optimizer_state(opt, model, ctx)["state"]


def test_packed_blocks_are_saved_as_one_chunk_per_block_and_reshard(tmp_path):
    path = str(tmp_path / "fused")
    tp = lambda n: dict(parallel=dict(tensor=dict(size=n, mode="1d")))  # noqa: E731
    dense = torch.randn(24, 8, generator=torch.Generator().manual_seed(0))
    saved, saved_opt = run_distributed(_fused_save, 2, dense, path, config=tp(2), timeout=TIMEOUT)[
        0
    ]
    chunks = _SafeReader(path).read_metadata().state_dict_metadata["model/qkv"].chunks
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


def _moe_step(engine, ctx):
    g = torch.Generator().manual_seed(11)
    x, y = torch.randn(8, 3, 8, 8, generator=g), torch.randint(0, 10, (8,), generator=g)
    d, r = ctx.world_size(gt.ParallelMode.DATA), ctx.local_rank(gt.ParallelMode.DATA)
    engine.zero_grad()
    engine.backward(engine.criterion(engine(x.chunk(d)[r]), y.chunk(d)[r]))
    engine.step()


def _moe_save(ctx, path):
    engine = _moe_model(5)
    _moe_step(engine, ctx)
    save_checkpoint(path, 1, engine.model, engine.optimizer, sharded=True)
    return (
        gt.full_state_dict(engine.model, ctx),
        dense_optimizer_state(engine.optimizer, engine.model, ctx)["state"],
    )


def _moe_load(ctx, path):
    engine = _moe_model(99)  # another init: everything must come from the checkpoint
    load_checkpoint(path, engine.model, engine.optimizer)
    return (
        gt.full_state_dict(engine.model, ctx),
        dense_optimizer_state(engine.optimizer, engine.model, ctx)["state"],
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
    data = batches(3)
    for x, y in data[:2]:
        step(engine, x, y)
    at_save = gt.full_state_dict(engine.model, ctx)
    handle = save_checkpoint(path, 2, engine.model, engine.optimizer, sched, True, True)
    step(engine, *data[2])  # training goes on while the shards are written
    assert handle.wait() == Path(path) and handle.done()
    fresh, fresh_sched = build(ctx)
    epoch = load_checkpoint(path, fresh.model, fresh.optimizer, fresh_sched)
    loaded = gt.full_state_dict(fresh.model, ctx)
    same = all(torch.equal(loaded[k], v) for k, v in at_save.items())
    # and the resumed third step equals the one taken after the save
    step(fresh, *data[2])
    after = [gt.full_state_dict(e.model, ctx) for e in (engine, fresh)]
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
