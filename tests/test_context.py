"""ParallelContext on real gloo processes: every group matches the grid formula and works."""

import pytest
import torch
import torch.distributed as dist
from helpers.harness import run_distributed
from helpers.layouts import layout

import gridtrain as gt
from gridtrain.parallel.topology import build_groups

PM = gt.ParallelMode

LAYOUTS = [
    layout(name)
    for name in (
        *("one process", "1d2", "pp2", "2d4", "sequence2-pp2", "ep2-dp4", "2.5d8", "3d8"),
        *("dp2-1d2-pp2", "dp2-sequence2-pp2"),
    )
]


def _groups_and_sums(ctx):
    """Each mode's ranks, and an all-reduce of global ranks over its group (proves it works)."""
    out = {}
    for mode in PM:
        if not ctx.is_initialized(mode):
            continue
        t = torch.tensor([float(ctx.global_rank)])
        dist.all_reduce(t, group=ctx.group(mode))
        out[mode] = (ctx.ranks(mode), ctx.local_rank(mode), ctx.world_size(mode), t.item())
    return out


@pytest.mark.parametrize(
    "world,config", LAYOUTS, ids=[f"w{w}-{i}" for i, (w, _) in enumerate(LAYOUTS)]
)
def test_groups_on_processes(world, config):
    results = run_distributed(_groups_and_sums, world, config=config)
    expected = build_groups(gt.Config.from_dict(config), world)
    for rank, per_mode in enumerate(results):
        assert set(per_mode) == set(expected), "every mode of the layout is built, no other"
        for mode, (ranks, local, size, total) in per_mode.items():
            assert rank in ranks and ranks in expected[mode]
            assert local == ranks.index(rank) and size == len(ranks)
            # the collective really ran over exactly these ranks
            assert total == sum(ranks), (mode, ranks, total)


def test_launch_rejects_bad_world_before_any_group():
    cfg = dict(parallel=dict(pipeline=2, tensor=dict(size=4, mode="1d")))
    with pytest.raises(
        gt.ConfigError, match="world size 6 is not divisible by pipeline 2 x tensor 4"
    ):
        gt.launch(cfg, rank=0, world_size=6, host="127.0.0.1", port=1)
    assert not dist.is_initialized()


def _dropout_masks(ctx):
    x = torch.ones(64)
    same = torch.nn.functional.dropout(x, 0.5)
    with ctx.fork_rng(PM.TENSOR):
        distinct = torch.nn.functional.dropout(x, 0.5)
    after = torch.nn.functional.dropout(x, 0.5)
    return same, distinct, after


def test_rng_states_same_or_distinct_across_tensor_group():
    a, b = run_distributed(
        _dropout_masks, 2, config=dict(parallel=dict(tensor=dict(size=2, mode="1d")))
    )
    assert torch.equal(a[0], b[0]), "default state is identical across the tensor group"
    assert not torch.equal(a[1], b[1]), "forked TENSOR state differs per tensor rank"
    assert torch.equal(a[2], b[2]), "forking does not disturb the default stream"


def _fails_on_rank_one(ctx):
    if ctx.global_rank == 1:
        raise ValueError("boom on purpose")
    dist.barrier()  # rank 0 would wait here forever


def test_harness_surfaces_failing_rank():
    with pytest.raises(RuntimeError, match=r"(?s)rank 1 of 2 failed.*boom on purpose"):
        run_distributed(_fails_on_rank_one, 2)
