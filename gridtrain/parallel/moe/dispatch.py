"""Grouped dispatch: tokens sorted by expert, sent as they are (no capacity slots), back again.

Per forward, with ``E`` experts over ``ep`` ranks (``E / ep`` local), from a router's
``Assignment`` (one entry per token and choice, with its expert and its slot in that
expert's queue):

    kept choices ordered by (expert, slot)        rows [N, d] (a gather; dropped ones left out)
    ep > 1: counts per expert to every rank       all-to-all of [ep, E/ep] ints
            rows to the ranks of their experts    all-to-all with those counts as splits
            received rows regrouped by expert     (they arrive by source rank)
    experts on rows sorted by expert              grouped matmuls (Experts.forward_grouped)
    the same way back; y = sum of gate * row      [T, d] (a scatter-add)

The result equals the capacity dispatch's (the same choices are kept, each token's
rows see the same weights); the capacity dispatch moves and multiplies
``E x capacity`` slots per rank whatever the load, this one only the kept rows.

With every expert local (ep 1) and ``torch._grouped_mm``, the kept counts never reach
the host: all ``k x T`` choices run, sorted by expert, dropped ones with a zero gate
(``_dispatch_without_sync``), so the step launches without waiting for the router.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.distributed as dist
from torch import Tensor

from gridtrain.parallel import comm
from gridtrain.parallel.moe.experts import compute_dtype
from gridtrain.parallel.moe.router import Assignment


class GroupedExperts(Protocol):
    """What the dispatch runs rows through: this rank's experts (``Experts``, or a Hugging Face
    model's fused experts, ``gridtrain.hf.moe``)."""

    num_local_experts: int

    def uses_grouped_mm(self, x: Tensor) -> bool:
        """Whether ``forward_grouped`` needs no host-side row counts for rows like ``x``."""

    def forward_grouped(self, x: Tensor, counts: Tensor, max_count: int | None) -> Tensor:
        """Rows ``x`` sorted by local expert, ``counts[e]`` of them for expert e -> outputs."""


# Uneven all-to-all: comm.py has only even splits. It belongs there (principle 4) and is kept
# here, private, until it moves; it counts its bytes the way comm's collectives do.
def _all_to_all_rows(x: Tensor, send: list[int], recv: list[int], group) -> Tensor:
    out = x.new_empty((sum(recv), *x.shape[1:]))
    me = comm.rank_in(group)
    comm._count("all_to_all", x, (x.shape[0] - send[me]) / max(x.shape[0], 1))
    dist.all_to_all_single(out, x.contiguous(), recv, send, group=group)
    return out


class _AllToAllRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, send, recv, group):
        ctx.splits, ctx.group = (send, recv), group
        return _all_to_all_rows(x, send, recv, group)

    @staticmethod
    def backward(ctx, grad):
        send, recv = ctx.splits
        return _all_to_all_rows(grad, recv, send, ctx.group), None, None, None


def all_to_all_rows(x: Tensor, send: list[int], recv: list[int], group) -> Tensor:
    """Expert dispatch with uneven splits: ``send[j]`` leading rows of ``x`` (in order) to
    rank j of ``group``; returns the ``recv[i]`` rows from each rank i, stacked by source."""
    return _AllToAllRows.apply(x, send, recv, group)


def expert_order(a: Assignment, kept: Tensor, total: int) -> Tensor:
    """Indices into ``a``'s choices of the ``total`` kept ones, by expert then slot.

    A kept choice's row is its expert's first row plus its slot (slots of kept choices
    run 0, 1, ... per expert); dropped choices take the rows after ``total``, so the
    rows form a permutation and one scatter sorts them (no argsort).
    """
    row = _row_by_expert(a, kept)
    if a.capacity is not None:
        dropped = a.slot >= a.capacity
        row = torch.where(dropped, total + torch.cumsum(dropped, 0) - 1, row)
    return _inverse_permutation(row)[:total]


def _row_by_expert(a: Assignment, counts: Tensor) -> Tensor:
    """Each choice's row when ``counts[e]`` rows go to expert e, by expert then slot."""
    start = torch.cumsum(counts, 0) - counts
    return start[a.expert] + a.slot


def _inverse_permutation(perm: Tensor) -> Tensor:
    """``inv`` with ``inv[perm[i]] = i``: one scatter, no argsort."""
    return torch.empty_like(perm).scatter_(0, perm, torch.arange(perm.numel(), device=perm.device))


def run_experts(
    experts: GroupedExperts, x: Tensor, kept: Tensor, counts: list[int], group, ep: int
) -> Tensor:
    """Rows ``x`` sorted by expert (``counts[e]`` kept rows for expert e, ``kept`` the same
    on the device) through their experts, wherever they live; returns rows in x's order."""
    if ep == 1:
        return experts.forward_grouped(x, kept, max(counts, default=0))
    local = experts.num_local_experts
    # counts first: rank j learns how many rows each source sends to each of its experts
    recv_counts = comm.all_to_all(kept.view(ep, local).contiguous(), 0, 0, group)  # [src, local]
    received = recv_counts.tolist()
    send = [sum(counts[j * local : (j + 1) * local]) for j in range(ep)]
    recv = [sum(r) for r in received]
    rows = all_to_all_rows(x, send, recv, group)  # by source, then expert
    # regroup by expert, then source (a stable sort keeps each block's order)
    n = rows.shape[0]
    block = torch.repeat_interleave(
        torch.arange(ep * local, device=x.device), recv_counts.flatten(), output_size=n
    )
    perm = torch.argsort((block % local) * ep + block // local, stable=True)
    per_expert = recv_counts.sum(0)
    busiest = max((sum(r[e] for r in received) for e in range(local)), default=0)
    out = experts.forward_grouped(rows.index_select(0, perm), per_expert, busiest)
    return all_to_all_rows(out.index_select(0, _inverse_permutation(perm)), recv, send, group)


def grouped_dispatch(
    tokens: Tensor, a: Assignment, experts: GroupedExperts, group, ep: int
) -> tuple[Tensor, Tensor | int]:
    """The MoE output for ``tokens`` [T, d] routed as ``a``; also the dropped choices' count."""
    if ep == 1 and tokens.shape[0] > 0 and experts.uses_grouped_mm(tokens):
        return _dispatch_without_sync(tokens, a, experts)
    kept = a.kept_counts()  # [E] on the device
    counts = kept.tolist()  # the one host sync: shapes of the gather and the all-to-all
    total = sum(counts)
    order = expert_order(a, kept, total)
    token = a.token[order]
    # index_select, not tokens[token]: its backward is an index_add, where advanced
    # indexing's is a sort-based accumulate (5 ms per call at 16k tokens on an H200)
    y = run_experts(experts, tokens.index_select(0, token), kept, counts, group, ep)
    gate = a.gate.index_select(0, order).to(tokens.dtype).unsqueeze(1)
    out = tokens.new_zeros(tokens.shape).index_add(0, token, (gate * y).to(tokens.dtype))
    return out, a.token.numel() - total


def _dispatch_without_sync(
    tokens: Tensor, a: Assignment, experts: GroupedExperts
) -> tuple[Tensor, Tensor]:
    """All experts local and ``torch._grouped_mm``: every choice, dropped ones included, runs
    through its expert and a dropped one's gate is zeroed, so every shape follows from the
    token count and the host never waits for the router (each wait stalls the launch queue;
    8 per WideNet step cost more than its matmuls). Rows past capacity are computed and
    discarded: at most the ``drop_tks=False`` cost. The result equals the kept-rows path's:
    a zero gate gives a dropped row zero output and zero gradient (unless that row's expert
    output overflows to inf: 0 * inf is NaN, where the kept-rows path never computes it).

    Every token has exactly k rows, so rows move by gathers both ways (no atomic
    ``index_add``) and the combine is a weighted sum over the k choices."""
    n, num_tokens = a.token.numel(), tokens.shape[0]
    row = _row_by_expert(a, a.load)  # every choice has a row: a permutation
    order = _inverse_permutation(row)
    k = n // num_tokens
    rows = _GatherChoices.apply(tokens, order, row, k, compute_dtype(tokens))
    y = experts.forward_grouped(rows, a.load, None)
    y = _Permute.apply(y, row, order)  # back to choice order: [k, tokens] flattened
    gate, dropped = a.gate, tokens.new_zeros((), dtype=torch.long)
    if a.capacity is not None:
        kept = a.slot < a.capacity
        gate, dropped = gate * kept, n - kept.sum()
    # weighted in the experts' dtype (a dense MLP's output is rounded the same), summed in
    # the tokens' dtype: half the bytes of an fp32 product under bf16
    weighted = gate.to(y.dtype).view(k, num_tokens, 1) * y.view(k, num_tokens, -1)
    return weighted.sum(0, dtype=tokens.dtype), dropped


class _Permute(torch.autograd.Function):
    """``x[perm]`` for a permutation ``perm`` whose inverse is ``inverse``: a gather both ways
    (advanced indexing's backward would be an atomic scatter-add)."""

    @staticmethod
    def forward(ctx, x: Tensor, perm: Tensor, inverse: Tensor) -> Tensor:
        ctx.save_for_backward(inverse)
        return x.index_select(0, perm)

    @staticmethod
    def backward(ctx, grad: Tensor):
        (inverse,) = ctx.saved_tensors
        return grad.index_select(0, inverse), None, None


class _GatherChoices(torch.autograd.Function):
    """Token rows [T, d] -> one row per choice in ``order`` (choice c is token ``c % T``), cast
    to ``dtype`` before the gather (half the bytes moved under bf16 autocast); backward
    gathers the rows back to choice order and sums each token's k of them in x's dtype."""

    @staticmethod
    def forward(ctx, x: Tensor, order: Tensor, inverse: Tensor, k: int, dtype) -> Tensor:
        ctx.save_for_backward(inverse)
        ctx.k, ctx.dtype = k, x.dtype
        return x.to(dtype).index_select(0, order % x.shape[0])

    @staticmethod
    def backward(ctx, grad: Tensor):
        (inverse,) = ctx.saved_tensors
        by_choice = grad.index_select(0, inverse).view(ctx.k, -1, grad.shape[-1])
        return by_choice.sum(0, dtype=ctx.dtype), None, None, None, None
