"""Differentiable collectives: every tensor-parallel mode is composed from these.

Each is a small autograd Function whose backward is the collective's adjoint,
named after the operator of the paper that uses it. All take a process group
(``ctx.group(mode)``) and are no-ops on a group of one, so a layer written with
them also runs unsharded. Only this file (and pipeline/p2p.py) talk to
``torch.distributed``.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import Tensor

Group = dist.ProcessGroup | None

# torch's flat-tensor collectives: torch >= 2.12 names them *_single, earlier releases have
# only the old names (the ZeRO buckets call them too, asynchronously)
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

# ---- byte accounting (benchmarks/comm_volume.py) -----------------------------------------
_COUNTER: Counter | None = None


@contextlib.contextmanager
def count_bytes() -> Iterator[Counter]:
    """Count, per collective name, the bytes each rank sends inside the block."""
    global _COUNTER
    saved, _COUNTER = _COUNTER, Counter()
    try:
        yield _COUNTER
    finally:
        _COUNTER = saved


def _count(name: str, t: Tensor, factor: float = 1.0) -> None:
    if _COUNTER is not None:
        _COUNTER[name] += int(t.numel() * t.element_size() * factor)


def world(group: Group) -> int:
    return dist.get_world_size(group)


def rank_in(group: Group) -> int:
    return dist.get_rank(group)


@torch.compiler.disable
def global_ranks(group: Group) -> list[int]:
    """The group's members' global ranks. Outside compiled graphs: torch 2.11's dynamo
    cannot trace the lookup on a process group written in Python (backend "staged")."""
    return dist.get_process_group_ranks(group)


# ---- raw (non-differentiable) collectives along a tensor dim ------------------------------
def _all_reduce(x: Tensor, group: Group, op=dist.ReduceOp.SUM) -> Tensor:
    n = world(group)
    if n == 1:
        return x
    x = x.contiguous()
    _count("all_reduce", x, 2 * (n - 1) / n)  # ring all-reduce
    dist.all_reduce(x, op=op, group=group)
    return x


def _all_gather(x: Tensor, dim: int, group: Group) -> Tensor:
    n = world(group)
    if n == 1:
        return x
    x0 = x.movedim(dim, 0).contiguous()
    out = torch.empty((n * x0.shape[0],) + tuple(x0.shape[1:]), dtype=x.dtype, device=x.device)
    _count("all_gather", x0, n - 1)
    all_gather_single(out, x0, group=group)
    return out.movedim(0, dim)


def _reduce_scatter(x: Tensor, dim: int, group: Group) -> Tensor:
    n = world(group)
    if n == 1:
        return x
    if x.shape[dim] % n:
        raise ValueError(
            f"reduce-scatter: dim {dim} of size {x.shape[dim]} does not split {n} ways"
        )
    x0 = x.movedim(dim, 0).contiguous()
    out = torch.empty((x0.shape[0] // n,) + tuple(x0.shape[1:]), dtype=x.dtype, device=x.device)
    _count("reduce_scatter", out, n - 1)
    reduce_scatter_single(out, x0, group=group)
    return out.movedim(0, dim)


def _split(x: Tensor, dim: int, group: Group) -> Tensor:
    n = world(group)
    if n == 1:
        return x
    if x.shape[dim] % n:
        raise ValueError(f"split: dim {dim} of size {x.shape[dim]} does not split {n} ways")
    return x.chunk(n, dim=dim)[rank_in(group)].contiguous()


def _broadcast(x: Tensor, src: int, group: Group) -> Tensor:
    """``src`` is a global rank, as torch.distributed wants."""
    if world(group) == 1:
        return x
    x = x.contiguous()
    _count("broadcast", x)
    dist.broadcast(x, src=src, group=group)
    return x


def _reduce(x: Tensor, dst: int, group: Group) -> Tensor:
    if world(group) == 1:
        return x
    x = x.contiguous()
    _count("reduce", x)
    dist.reduce(x, dst=dst, group=group)
    return x


def _all_to_all(x: Tensor, split_dim: int, cat_dim: int, group: Group) -> Tensor:
    n = world(group)
    if n == 1:
        return x
    if x.shape[split_dim] % n:  # uneven chunks would make gloo fail and NCCL hang or corrupt
        raise ValueError(
            f"all-to-all: dim {split_dim} of size {x.shape[split_dim]} does not split {n} ways"
        )
    inputs = [c.contiguous() for c in x.chunk(n, dim=split_dim)]
    outputs = [torch.empty_like(c) for c in inputs]
    _count("all_to_all", x, (n - 1) / n)
    dist.all_to_all(outputs, inputs, group=group)
    return torch.cat(outputs, dim=cat_dim)


# ---- Megatron's f and g -------------------------------------------------------------------
class _CopyToGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad.clone(), ctx.group), None


class _ReduceFromGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x.clone(), group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def copy_to_group(x: Tensor, group: Group) -> Tensor:
    """Megatron's *f*: identity forward, all-reduce (sum) of the gradient backward."""
    return _CopyToGroup.apply(x, group)


def reduce_from_group(x: Tensor, group: Group) -> Tensor:
    """Megatron's *g*: all-reduce (sum) forward, identity backward."""
    return _ReduceFromGroup.apply(x, group)


# ---- gather / scatter pairs ----------------------------------------------------------------
class _GatherThenSplit(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return _all_gather(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return _split(grad, ctx.dim, ctx.group), None, None


class _SplitThenGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return _split(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, ctx.dim, ctx.group), None, None


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return _all_gather(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter(grad, ctx.dim, ctx.group), None, None


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return _reduce_scatter(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, ctx.dim, ctx.group), None, None


def gather_from_group(x: Tensor, dim: int, group: Group) -> Tensor:
    """Megatron's gather of a sharded activation: all-gather forward, keep own slice backward.

    Right when every rank uses the gathered tensor identically (replicated compute after it).
    """
    return _GatherThenSplit.apply(x, dim, group)


def split_to_group(x: Tensor, dim: int, group: Group) -> Tensor:
    """Keep this rank's slice of a replicated tensor forward; all-gather the gradient backward."""
    return _SplitThenGather.apply(x, dim, group)


def all_gather(x: Tensor, dim: int, group: Group) -> Tensor:
    """All-gather forward, reduce-scatter backward (3D's input/weight gather, Bian et al.).

    Right when each rank uses the gathered tensor for a *different* partial product.
    """
    return _AllGather.apply(x, dim, group)


def reduce_scatter(x: Tensor, dim: int, group: Group) -> Tensor:
    """Reduce-scatter forward, all-gather backward (3D's output reduce-scatter)."""
    return _ReduceScatter.apply(x, dim, group)


# ---- broadcast / reduce (SUMMA) -----------------------------------------------------------
class _Broadcast(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, src, group):
        ctx.src, ctx.group = src, group
        return _broadcast(x.clone(), src, group)

    @staticmethod
    def backward(ctx, grad):
        grad = _reduce(grad.clone(), ctx.src, ctx.group)
        if dist.get_rank() != ctx.src:
            grad = torch.zeros_like(grad)  # only the source's input reached the output
        return grad, None, None


def broadcast(x: Tensor, src: int, group: Group) -> Tensor:
    """SUMMA's panel broadcast (Optimus, Xu et al.): broadcast forward, reduce to src backward.

    ``src`` is a global rank. Non-source ranks pass a tensor of the right shape
    (its values are ignored) and receive a zero gradient for it.
    """
    return _Broadcast.apply(x, src, group)


# ---- all-to-all and ring pass -------------------------------------------------------------
class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, split_dim, cat_dim, group):
        ctx.dims, ctx.group = (split_dim, cat_dim), group
        return _all_to_all(x, split_dim, cat_dim, group)

    @staticmethod
    def backward(ctx, grad):
        split_dim, cat_dim = ctx.dims
        return _all_to_all(grad, cat_dim, split_dim, ctx.group), None, None, None


def all_to_all(x: Tensor, split_dim: int, cat_dim: int, group: Group) -> Tensor:
    """Expert dispatch/combine (GShard): chunk ``split_dim`` out to the group, concat on ``cat_dim``."""
    return _AllToAll.apply(x, split_dim, cat_dim, group)


def _ring_shift(x: Tensor, group: Group, step: int) -> Tensor:
    """Send to local rank + step, receive from local rank - step (wrapping)."""
    n = world(group)
    if n == 1:
        return x
    ranks = global_ranks(group)
    me = ranks.index(dist.get_rank())
    x = x.contiguous()
    out = torch.empty_like(x)
    _count("ring_pass", x)
    ops = [
        dist.P2POp(dist.isend, x, ranks[(me + step) % n], group),
        dist.P2POp(dist.irecv, out, ranks[(me - step) % n], group),
    ]
    for req in dist.batch_isend_irecv(ops):
        req.wait()
    return out


class _RingPass(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _ring_shift(x, group, +1)

    @staticmethod
    def backward(ctx, grad):
        return _ring_shift(grad, ctx.group, -1), None


def ring_pass(x: Tensor, group: Group) -> Tensor:
    """Ring self-attention's block pass (Li et al. 2021): send to the next rank, receive from the previous."""
    return _RingPass.apply(x, group)


# ---- plain differentiable all-reduce ------------------------------------------------------
class _AllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _all_reduce(x.clone(), group)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad.clone(), ctx.group), None


def all_reduce(x: Tensor, group: Group) -> Tensor:
    """All-reduce (sum) forward and backward: for a sum every rank then uses differently."""
    return _AllReduce.apply(x, group)


def all_reduce_max(x: Tensor, group: Group) -> Tensor:
    """Element-wise max over the group, no gradient (e.g. the logit max of vocab-parallel CE)."""
    return _all_reduce(x.detach().clone(), group, op=dist.ReduceOp.MAX)


# non-differentiable in-place helpers for engine code (gradients, buffers); the collectives
# run on a contiguous copy when handed a view, so write the result back into the caller's tensor
def _in_place(x: Tensor, out: Tensor) -> Tensor:
    if out is not x:
        x.copy_(out)
    return x


def all_reduce_(x: Tensor, group: Group, op=dist.ReduceOp.SUM) -> Tensor:
    """In-place all-reduce of ``x`` (a non-contiguous view too); returns ``x``."""
    return _in_place(x, _all_reduce(x, group, op))


def broadcast_(x: Tensor, src: int, group: Group) -> Tensor:
    """In-place broadcast of ``x`` from global rank ``src`` (a view too); returns ``x``."""
    return _in_place(x, _broadcast(x, src, group))


def reduce_(x: Tensor, dst: int, group: Group) -> Tensor:
    """SUMMA's in-place reduce of partial products to the block owner (``dst`` = global rank)."""
    return _in_place(x, _reduce(x, dst, group))


all_gather_raw = _all_gather


def all_gather_flat(x: Tensor, group: Group) -> Tensor:
    """Every rank's 1-D ``x`` (equal lengths), stacked: ``(world, numel)``. One collective
    for many tensors flattened into ``x`` (the dense-state gathers)."""
    n = world(group)
    if n == 1:
        return x.view(1, -1)
    x = x.contiguous()
    out = torch.empty((n, x.numel()), dtype=x.dtype, device=x.device)
    _count("all_gather", x, n - 1)
    all_gather_single(out.view(-1), x, group=group)
    return out


def all_reduce_async(x: Tensor, group: Group, op=dist.ReduceOp.SUM):
    """Start an in-place all-reduce of contiguous ``x``; returns the work handle (None on a group of one).

    For the engine's overlapped data-parallel gradient sync: call ``.wait()`` before reading ``x``.
    """
    n = world(group)
    if n == 1:
        return None
    if not x.is_contiguous():
        raise ValueError("all_reduce_async needs a contiguous tensor (it reduces in place)")
    _count("all_reduce", x, 2 * (n - 1) / n)
    return dist.all_reduce(x, op=op, group=group, async_op=True)


def all_gather_object(obj, group: Group) -> list:
    """Every rank's picklable ``obj``, in local-rank order (checkpoint metadata across stages)."""
    n = world(group)
    if n == 1:
        return [obj]
    out = [None] * n
    dist.all_gather_object(out, obj, group=group)
    return out
