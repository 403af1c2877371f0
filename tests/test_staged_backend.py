"""``backend="staged"`` (several ranks on one GPU): every collective torch.distributed offers,
run by real gloo processes through the staged group and through a plain gloo group on the
same inputs, must give the same results; and ``launch``'s choice of backend.

The staged group stages CUDA tensors only; here it is registered to stage CPU tensors too
(``register(staged=("cpu",))``), so each collective really runs on separate host buffers
and is copied back: an asynchronous collective's result reaches the caller's tensor only
when it is waited for, which the tests check as the proof that the staging happened.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from helpers.harness import run_distributed
from helpers.runs import (
    dense_lm_loss,
    engine_run,
    global_losses,
    reference_run,
    start_engine,
    token_batches,
)
from helpers.tiny_lm import build_model, dense_numel, lm_loss, optimizer_and_scheduler

import gridtrain as gt
from gridtrain.parallel import staged_backend
from gridtrain.parallel.staged_backend import NAME, pick_backend

DTYPES = (torch.float32, torch.bfloat16, torch.int64)


def _x(rank: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    """Rank-dependent values, exact in every dtype."""
    return (torch.arange(n) + 10 * rank + 1).to(dtype)


def _collectives(group, rank: int, world: int, dtype) -> dict[str, object]:
    """Every collective on ``group`` from the same inputs; the results by name."""
    out: dict[str, object] = {}
    x = _x(rank, 2 * world, dtype)
    for op in ("SUM", "MAX", "AVG") if dtype.is_floating_point else ("SUM", "MAX"):
        t = x.clone()
        dist.all_reduce(t, op=getattr(dist.ReduceOp, op), group=group)
        out[f"all_reduce {op}"] = t
    t = x.clone()
    dist.broadcast(t, group_src=1, group=group)
    out["broadcast"] = t
    t = x.clone()
    dist.reduce(t, group_dst=0, group=group)
    out["reduce to 0"] = t if rank == 0 else None
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x, group=group)
    out["all_gather"] = parts
    flat = torch.empty(world * x.numel(), dtype=dtype)
    dist.all_gather_into_tensor(flat, x, group=group)
    out["all_gather_into_tensor"] = flat
    mine = torch.empty(2, dtype=dtype)
    dist.reduce_scatter(mine, list(x.chunk(world)), group=group)
    out["reduce_scatter"] = mine
    mine = torch.empty(2, dtype=dtype)
    dist.reduce_scatter_tensor(mine, x, group=group)
    out["reduce_scatter_tensor"] = mine
    outs = [torch.empty(2, dtype=dtype) for _ in range(world)]
    dist.all_to_all(outs, [c.clone() for c in x.chunk(world)], group=group)
    out["all_to_all"] = outs
    t = torch.empty_like(x)
    dist.all_to_all_single(t, x, group=group)
    out["all_to_all_single"] = t
    # uneven: rank r sends r + 1 elements to each peer
    send = _x(rank, (rank + 1) * world, dtype)
    recv = torch.empty(sum(r + 1 for r in range(world)), dtype=dtype)
    dist.all_to_all_single(recv, send, [r + 1 for r in range(world)], [rank + 1] * world, group)
    out["all_to_all_single uneven"] = recv
    gathered = [torch.empty_like(x) for _ in range(world)] if rank == 0 else None
    dist.gather(x, gathered, group_dst=0, group=group)
    out["gather"] = gathered
    t = torch.empty_like(x)
    dist.scatter(t, [x + i for i in range(world)] if rank == 0 else None, group_src=0, group=group)
    out["scatter"] = t
    out.update(_point_to_point(group, rank, x))
    pair = [x.clone(), x.clone() * 2]
    dist.all_reduce_coalesced(pair, group=group)
    out["all_reduce_coalesced"] = pair
    out.update(_coalesced(group, world, x))
    return out


def _coalesced(group, world: int, x: torch.Tensor) -> dict[str, object]:
    """Compiled code's coalesced gathers and reduce-scatters (torch's coalescing manager
    calls the group's ``*_coalesced`` methods, which gloo names differently per release)."""
    gathered = [torch.empty(x.numel() * world, dtype=x.dtype) for _ in range(2)]
    with dist._coalescing_manager(group):
        for out, scale in zip(gathered, (1, 2)):
            dist.all_gather_into_tensor(out, x * scale, group=group)
    scattered = [torch.empty(x.numel() // world, dtype=x.dtype) for _ in range(2)]
    with dist._coalescing_manager(group):
        for out, scale in zip(scattered, (1, 3)):
            dist.reduce_scatter_tensor(out, x * scale, group=group)
    return {"all_gather_into_tensor coalesced": gathered, "reduce_scatter coalesced": scattered}


def _point_to_point(group, rank: int, x: torch.Tensor) -> dict[str, object]:
    out: dict[str, object] = {}
    t = x.clone()
    if rank == 0:
        dist.send(x * 3, group_dst=1, group=group)
    elif rank == 1:
        dist.recv(t, group_src=0, group=group)
    out["send/recv"] = t
    got = torch.zeros_like(x)  # rank 2 takes no part: compared as it is
    peer = 1 - rank if rank < 2 else rank
    if rank < 2:
        ops = [dist.P2POp(dist.isend, x.clone(), group=group, group_peer=peer)]
        ops.append(dist.P2POp(dist.irecv, got, group=group, group_peer=peer))
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    out["batch_isend_irecv"] = got
    return out


def _functional(group, x: torch.Tensor) -> dict[str, object]:
    """DTensor's and compiled code's collectives (``_c10d_functional`` ops on the group)."""
    return {
        "funcol all_gather": funcol.all_gather_tensor(x, 0, group),
        "funcol reduce_scatter": funcol.reduce_scatter_tensor(x, "sum", 0, group),
        "funcol all_reduce": funcol.all_reduce(x, "sum", group),
        "funcol all_to_all": funcol.all_to_all_single(x, None, None, group),
    }


def _objects(group, rank: int, world: int) -> dict[str, object]:
    """The object collectives (DCP's metadata exchange)."""
    out: dict[str, object] = {}
    box = [{"from": rank}]
    dist.broadcast_object_list(box, group_src=1, group=group)
    out["broadcast_object_list"] = box
    every = [None] * world
    dist.all_gather_object(every, ("rank", rank), group=group)
    out["all_gather_object"] = every
    got = [None] * world if rank == 0 else None
    dist.gather_object(rank * 7, got, group_dst=0, group=group)
    out["gather_object"] = got
    mine = [None]
    dist.scatter_object_list(mine, [f"to {i}" for i in range(world)], group_src=0, group=group)
    out["scatter_object_list"] = mine
    return out


def _compare(rank: int, world: int, port: int) -> dict[str, object]:
    """Each collective through the staged world group and a plain gloo group: their results,
    and what an asynchronous staged all-reduce's tensor holds before and after its wait."""
    warnings.simplefilter("ignore", FutureWarning)  # torch 2.14 renames some of them
    staged_backend.register(staged=("cpu",))
    dist.init_process_group(
        NAME, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    try:
        staged, gloo = dist.group.WORLD, dist.new_group(backend="gloo")
        results = {"backend": dist.get_backend(staged)}
        for dtype in DTYPES:
            for name, group in (("staged", staged), ("gloo", gloo)):
                results[name, dtype] = _collectives(group, rank, world, dtype)
        for name, group in (("staged", staged), ("gloo", gloo)):
            results[name, "functional"] = _functional(group, _x(rank, 2 * world, torch.float32))
            results[name, "objects"] = _objects(group, rank, world)
        t = _x(rank, 4, torch.float32)
        before = t.clone()
        work = dist.all_reduce(t, async_op=True, group=staged)
        dist.barrier(group=gloo)  # the gloo work has finished on every rank by now
        unchanged = torch.equal(t, before)
        work.wait()
        results["async"] = (unchanged, t.clone())
        dist.monitored_barrier(group=staged)
        sub = dist.new_group([0, 1])  # a subgroup is a staged group too
        t = _x(rank, 4, torch.float32)
        if rank < 2:
            dist.all_reduce(t, group=sub)
        results["subgroup"] = (dist.get_backend(sub) if rank < 2 else None, t)
        return results
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def compared():
    return run_distributed(_compare, 3, launch=False, timeout=240)


def test_every_collective_through_the_staged_group_equals_gloo(compared):
    for rank, results in enumerate(compared):
        assert results["backend"] == NAME
        keys = [k for k in results if isinstance(k, tuple) and k[0] == "staged"]
        assert len(keys) == len(DTYPES) + 2
        for _, what in keys:
            staged, gloo = results["staged", what], results["gloo", what]
            assert staged.keys() == gloo.keys()
            for name in staged:  # the same inputs, the same gloo algorithm: exactly equal
                assert_same(staged[name], gloo[name], f"rank {rank} {what} {name}")


def assert_same(got, want, msg: str) -> None:
    if isinstance(want, list | tuple):
        assert type(got) is type(want) and len(got) == len(want), msg
        for g, w in zip(got, want, strict=True):
            assert_same(g, w, msg)
    elif isinstance(want, torch.Tensor):
        torch.testing.assert_close(got, want, rtol=0, atol=0, msg=msg)
    else:
        assert got == want, msg


def test_an_async_result_reaches_the_tensor_when_waited_for(compared):
    world = len(compared)
    want = sum(_x(r, 4, torch.float32) for r in range(world))
    for rank, results in enumerate(compared):
        unchanged, after = results["async"]
        assert unchanged, f"rank {rank}: the tensor changed before wait(): nothing was staged"
        torch.testing.assert_close(after, want, rtol=0, atol=0)


def test_subgroups_are_staged_groups(compared):
    want = _x(0, 4, torch.float32) + _x(1, 4, torch.float32)
    for rank, results in enumerate(compared):
        backend, t = results["subgroup"]
        assert backend == (NAME if rank < 2 else None)
        expected = want if rank < 2 else _x(rank, 4, torch.float32)
        torch.testing.assert_close(t, expected, rtol=0, atol=0)


# ---- the engine through the staged backend: FSDP2, DTensor and DCP ----------------------------
def _zero3_on_staged(rank: int, world: int, port: int, batches, directory):
    """ZeRO 3 (FSDP2's DTensors) trained on the staged backend, then its sharded (DCP)
    checkpoint loaded into an engine started from other weights."""
    staged_backend.register(staged=("cpu",))
    ctx = gt.launch(dict(zero=dict(stage=3)), rank, world, "127.0.0.1", port, backend=NAME)

    def resave(engine):
        gt.save_checkpoint(directory, 1, engine.model, engine.optimizer, sharded=True)
        fresh, _ = start_engine(build_model(seed=1), lm_loss, optimizer_and_scheduler)
        gt.load_checkpoint(directory, fresh.model, fresh.optimizer)
        return gt.full_state_dict(fresh.model)

    try:
        run = engine_run(ctx, build_model, batches, lm_loss, optimizer_and_scheduler, probe=resave)
        return dict(backend=dist.get_backend(), run=run)
    finally:
        gt.destroy()


def test_zero3_trains_and_checkpoints_through_the_staged_backend(tmp_path):
    batches = token_batches(3, 8, 8, 64, seed=1)
    ref = reference_run(build_model, batches, dense_lm_loss, optimizer_and_scheduler)
    ranks = run_distributed(_zero3_on_staged, 2, batches, tmp_path, launch=False, timeout=240)
    runs = [r["run"] for r in ranks]
    assert all(r["backend"] == NAME for r in ranks)
    for run in runs:  # FSDP2 shards every parameter over the 2 ranks
        assert run.held / dense_numel() <= 0.5 + 448 / 8640, run.held
    # float64: the staged and plain runs differ only in the order of sums (as in conformance)
    torch.testing.assert_close(global_losses(runs), ref.losses, rtol=1e-9, atol=1e-9)
    for key, value in runs[0].state.items():
        torch.testing.assert_close(value, ref.state[key], rtol=1e-9, atol=1e-9, msg=key)
        loaded = runs[0].probed[key]  # DCP's copy of the trained shards, read back exactly
        torch.testing.assert_close(loaded, value, rtol=0, atol=0, msg=key)


# ---- which backend launch picks ---------------------------------------------------------------
def test_the_backend_is_picked_from_ranks_and_gpus():
    assert pick_backend(None, 2, 0) == "gloo", "no GPU: gloo"
    assert pick_backend(None, 2, 2) == "nccl", "a GPU per rank: nccl"
    assert pick_backend(None, 8, 8) == "nccl"
    assert pick_backend(None, 2, 1) == NAME, "more ranks than GPUs: they share them"
    assert pick_backend(None, 8, 2) == NAME
    assert pick_backend(None, None, 1) == "nccl", "ranks per machine unknown: one GPU each"
    assert pick_backend("gloo", 4, 1) == "gloo", "an explicit backend wins"
    assert pick_backend(NAME, 1, 1) == NAME
    with pytest.raises(ValueError, match=f"nccl.*2 ranks share 1 GPU.*backend '{NAME}'"):
        pick_backend("nccl", 2, 1)


def test_launch_refuses_an_unknown_backend_naming_staged():
    with pytest.raises(ValueError, match=f"one of nccl, gloo, mpi, {NAME}, got 'ncl'"):
        gt.launch({}, 0, 1, "127.0.0.1", 1, backend="ncl")
