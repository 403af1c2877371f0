"""Every collective in comm.py, on real gloo groups of 1, 2 and 4 ranks (contiguous and strided).

For each differentiable op every rank rebuilds all ranks' inputs (seeded by rank)
and computes the mathematically expected result with dense single-process torch:
the forward value of its own output, and the gradient of the *total* loss with
respect to its own input. The total loss is the sum of every rank's
``<y_rank, w_rank>`` when ranks compute different things after the op, or one
``<y, w>`` when the op's output is replicated and used identically (Megatron's
convention for ``g`` and the gather). float64 throughout: the only allowed
difference is the order of a sum, ~1e-15, so the 1e-12 tolerance catches any
wrong slice, missing reduction or wrong rank by 10 orders of magnitude.
"""

from __future__ import annotations

import pytest
import torch
from helpers.harness import run_distributed
from helpers.layouts import layout

import gridtrain as gt
from gridtrain.parallel import comm

PM = gt.ParallelMode
TOL = 1e-12  # float64, only summation order differs (see module docstring)
SHAPE = (4, 8)  # both dims split 1, 2 and 4 ways


def _rand(seed: int, shape=SHAPE) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=torch.float64)


def _cases(n: int, src_local: int):
    """(name, distributed fn(x, group), dense fn(xs) -> ys per rank, replicated_in, replicated_out)."""

    def total(xs):
        return torch.stack(xs).sum(0)

    def a2a(xs, split, cat):
        return [torch.cat([x.chunk(n, split)[j] for x in xs], cat) for j in range(n)]

    return [
        ("copy_to_group", comm.copy_to_group, lambda xs: [xs[0]] * n, True, False),
        ("reduce_from_group", comm.reduce_from_group, lambda xs: [total(xs)] * n, False, True),
        (
            "gather_from_group(dim=1)",
            lambda x, g: comm.gather_from_group(x, 1, g),
            lambda xs: [torch.cat(xs, 1)] * n,
            False,
            True,
        ),
        (
            "gather_from_group(dim=0, non-contiguous input)",
            lambda x, g: comm.gather_from_group(x.t(), 0, g),
            lambda xs: [torch.cat([x.t() for x in xs], 0)] * n,
            False,
            True,
        ),
        (
            "split_to_group(dim=-1)",
            lambda x, g: comm.split_to_group(x, -1, g),
            lambda xs: list(xs[0].chunk(n, -1)),
            True,
            False,
        ),
        (
            "all_gather(dim=0)",
            lambda x, g: comm.all_gather(x, 0, g),
            lambda xs: [torch.cat(xs, 0)] * n,
            False,
            False,
        ),
        (
            "all_gather(dim=-1)",
            lambda x, g: comm.all_gather(x, -1, g),
            lambda xs: [torch.cat(xs, -1)] * n,
            False,
            False,
        ),
        (
            "reduce_scatter(dim=1)",
            lambda x, g: comm.reduce_scatter(x, 1, g),
            lambda xs: list(total(xs).chunk(n, 1)),
            False,
            False,
        ),
        (
            f"broadcast(src=local {src_local})",
            None,  # needs the global source rank: filled in by the caller
            lambda xs: [xs[src_local]] * n,
            False,
            False,
        ),
        (
            "all_to_all(split=1, cat=0)",
            lambda x, g: comm.all_to_all(x, 1, 0, g),
            lambda xs: a2a(xs, 1, 0),
            False,
            False,
        ),
        (
            "all_to_all(split=0, cat=0)",
            lambda x, g: comm.all_to_all(x, 0, 0, g),
            lambda xs: a2a(xs, 0, 0),
            False,
            False,
        ),
        ("ring_pass", comm.ring_pass, lambda xs: [xs[(j - 1) % n] for j in range(n)], False, False),
        ("all_reduce", comm.all_reduce, lambda xs: [total(xs)] * n, False, False),
    ]


def _check_group(ctx, mode: PM, salt: int) -> dict[str, tuple[float, float]]:
    """Max |forward error| and |gradient error| of every op over ``mode``'s group, on this rank."""
    group, n, me = ctx.group(mode), ctx.world_size(mode), ctx.local_rank(mode)
    assert comm.world(group) == n and comm.rank_in(group) == me
    src_local = n - 1  # not local rank 0, so a global/local rank mix-up shows
    errors = {}
    for k, (name, fn, dense, rep_in, rep_out) in enumerate(_cases(n, src_local)):
        if fn is None:
            src = ctx.ranks(mode)[src_local]

            def fn(x, g, src=src):
                return comm.broadcast(x, src, g)

        seed = 1000 * salt + 100 * k
        xs = [_rand(seed + (0 if rep_in else r)).requires_grad_() for r in range(n)]
        if rep_in:
            xs = [xs[0]] * n  # one leaf, counted once
        ws = [_rand(seed + 50 + (0 if rep_out else r), (256,)) for r in range(n)]

        # dense reference: the total loss over ranks (or once, if the output is replicated)
        ys = dense(xs)
        weights = [ws[j][: ys[j].numel()].view_as(ys[j]) for j in range(n)]
        loss = sum((ys[j] * weights[j]).sum() for j in (range(1) if rep_out else range(n)))
        loss.backward()
        want_y = ys[me].detach()
        want_grad = (
            xs[me].grad if xs[me].grad is not None else torch.zeros(SHAPE, dtype=torch.float64)
        )

        x = xs[me].detach().clone().requires_grad_()
        y = fn(x, group)
        (y * weights[me]).sum().backward()
        assert y.shape == want_y.shape, (name, y.shape, want_y.shape)
        errors[name] = (
            (y.detach() - want_y).abs().max().item(),
            (x.grad - want_grad).abs().max().item(),
        )
    return errors


def _check_raw(ctx, mode: PM) -> dict[str, float]:
    """The non-differentiable helpers, all_reduce_max and count_bytes."""
    group, n, me = ctx.group(mode), ctx.world_size(mode), ctx.local_rank(mode)
    xs = [_rand(7 + r) for r in range(n)]
    out = {}

    y = comm.all_reduce_max(xs[me].clone().requires_grad_(), group)
    assert not y.requires_grad, "all_reduce_max carries no gradient"
    out["all_reduce_max"] = (y - torch.stack(xs).amax(0)).abs().max().item()

    buf = xs[me].clone()
    res = comm.all_reduce_(buf, group)
    assert res is buf or n == 1, "all_reduce_ reduces in place"
    out["all_reduce_"] = (buf - torch.stack(xs).sum(0)).abs().max().item()

    base = xs[me].clone()
    view = base.t()  # a non-contiguous view must still be reduced in place
    comm.all_reduce_(view, group)
    out["all_reduce_(non-contiguous)"] = (base - torch.stack(xs).sum(0)).abs().max().item()

    buf = xs[me].clone()
    comm.broadcast_(buf, ctx.ranks(mode)[0], group)
    out["broadcast_"] = (buf - xs[0]).abs().max().item()

    base = xs[me].clone()
    comm.broadcast_(base.t(), ctx.ranks(mode)[0], group)
    out["broadcast_(non-contiguous)"] = (base - xs[0]).abs().max().item()

    base = xs[me].clone()
    comm.reduce_(base.t(), ctx.ranks(mode)[-1], group)  # a view, reduced to the last rank
    want = torch.stack(xs).sum(0) if me == n - 1 else base
    out["reduce_(non-contiguous)"] = (base - want).abs().max().item()

    objs = comm.all_gather_object({"rank": me}, group)
    out["all_gather_object"] = float(objs != [{"rank": r} for r in range(n)])

    out["all_gather_raw"] = (
        (comm.all_gather_raw(xs[me], 1, group) - torch.cat(xs, 1)).abs().max().item()
    )

    buf = xs[me].clone()
    work = comm.all_reduce_async(buf, group)
    if work is not None:
        work.wait()
    out["all_reduce_async"] = (buf - torch.stack(xs).sum(0)).abs().max().item()

    # bytes a rank sends: ring all-reduce 2(n-1)/n of the tensor, all-gather (n-1) shards
    nbytes = xs[me].numel() * 8
    with comm.count_bytes() as counted:
        comm.all_reduce(xs[me].clone(), group)
        comm.all_gather(xs[me], 0, group)
    want = {"all_reduce": int(nbytes * 2 * (n - 1) / n), "all_gather": nbytes * (n - 1)}
    out["count_bytes"] = float(dict(+counted) != {k: v for k, v in want.items() if v})
    return out


def _errors_raise_before_collectives(ctx, mode: PM) -> list[str]:
    """Bad shapes fail on every rank with a message naming the dim, before any collective."""
    group, n = ctx.group(mode), ctx.world_size(mode)
    x = torch.zeros(n + 1, 3)  # n + 1 never splits n ways for n >= 2
    messages = []
    for fn in (
        lambda: comm.split_to_group(x, 0, group),
        lambda: comm.reduce_scatter(x, 0, group),
        lambda: comm.all_to_all(x, 0, 1, group),
    ):
        with pytest.raises(ValueError, match=rf"dim 0 of size {n + 1} does not split {n} ways"):
            fn()
        messages.append("ok")
    return messages


def _run_all(ctx, modes):
    return {
        mode: (_check_group(ctx, mode, i), _check_raw(ctx, mode)) for i, mode in enumerate(modes)
    } | {"errors": _errors_raise_before_collectives(ctx, PM.GLOBAL)}


LAYOUTS = [
    # world 2: the whole world, and groups of one (no tensor parallelism: TENSOR = [r])
    (*layout("dp2"), [PM.GLOBAL, PM.TENSOR]),
    # world 4: the whole world, contiguous pairs [0,1],[2,3] and strided pairs [0,2],[1,3]
    (*layout("dp2-1d2"), [PM.GLOBAL, PM.TENSOR, PM.DATA]),
]


@pytest.mark.parametrize("world,config,modes", LAYOUTS, ids=["w2", "w4"])
def test_every_collective_matches_dense_math(world, config, modes):
    results = run_distributed(_run_all, world, modes, config=config, timeout=300)
    for rank, per_mode in enumerate(results):
        for mode in modes:
            diff, raw = per_mode[mode]
            assert len(diff) == 13 and len(raw) == 10, "every function is exercised"
            for name, (fwd, grad) in diff.items():
                assert fwd <= TOL, f"rank {rank} {mode.name} {name}: forward off by {fwd}"
                assert grad <= TOL, f"rank {rank} {mode.name} {name}: gradient off by {grad}"
            for name, err in raw.items():
                assert err <= TOL, f"rank {rank} {mode.name} {name}: off by {err}"
