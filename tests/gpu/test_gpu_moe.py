"""Grouped MoE dispatch on one device in bf16: ``torch._grouped_mm`` (Hopper, bf16; a padded
batched matmul elsewhere) against float64 on the CPU for the expert kernel itself, and the
whole grouped layer against the capacity dispatch on the same device (same routing)."""

from __future__ import annotations

import pytest
import torch
from gpu_env import ON_CUDA, is_hopper, rel_err

from gridtrain.parallel import moe
from gridtrain.parallel.moe.experts import grouped_mm_supported

HIDDEN, FFN, EXPERTS = 64, 128, 8
COUNTS = [40, 0, 17, 64, 3, 29, 1, 50]  # uneven, one expert idle: rows sorted by expert


def test_grouped_mm_is_chosen_on_hopper_in_bf16(device):
    if not ON_CUDA:
        pytest.skip("grouped_mm is a CUDA kernel")
    assert grouped_mm_supported(device, torch.bfloat16) == is_hopper()
    assert not grouped_mm_supported(device, torch.float32), "bf16 only"


def _grads(experts: moe.Experts, x: torch.Tensor, counts: torch.Tensor, w: torch.Tensor):
    x = x.clone().requires_grad_()
    y = experts.forward_grouped(x, counts, int(counts.max()))
    (y.float() * w).sum().backward()
    grads = {n: p.grad.clone() for n, p in experts.named_parameters()}
    return y.detach(), x.grad, grads


@pytest.mark.parametrize("matmul", ["auto", "bmm"])
def test_grouped_experts_bf16_track_float64(matmul, device):
    """``forward_grouped`` under bf16 autocast (auto = grouped_mm on Hopper) against the same
    weights and rows in float64 on the CPU: outputs, row gradients and weight gradients."""
    torch.manual_seed(0)
    ref = moe.Experts(EXPERTS, HIDDEN, FFN, dtype=torch.float64, matmul="bmm")
    experts = moe.Experts(EXPERTS, HIDDEN, FFN, matmul=matmul).to(device)
    experts.load_state_dict({k: v.float() for k, v in ref.state_dict().items()})
    g = torch.Generator().manual_seed(1)
    rows = sum(COUNTS)
    # inputs rounded to bf16 first, so the reference sees the values the kernel sees
    x = torch.randn(rows, HIDDEN, generator=g).bfloat16().double()
    w = torch.randn(rows, HIDDEN, generator=g, dtype=torch.float64)
    counts = torch.tensor(COUNTS)
    want = _grads(ref, x, counts, w)
    with torch.autocast(device.type, dtype=torch.bfloat16):
        got = _grads(experts, x.to(device, torch.float32), counts.to(device), w.to(device))
    assert got[0].dtype == torch.bfloat16, "the experts ran in bf16"
    # bf16 weights and hidden activations (8 mantissa bits, ~4e-3 per rounding), fp32 sums:
    # a few roundings along each path
    assert rel_err(got[0], want[0]) < 1.5e-2, rel_err(got[0], want[0])
    assert rel_err(got[1], want[1]) < 1.5e-2, rel_err(got[1], want[1])
    for name, g_want in want[2].items():
        err = rel_err(got[2][name], g_want)
        assert err < 1.5e-2, (matmul, name, err)
    idle = slice(1, 2)  # expert 1 got no rows: exactly zero gradient
    assert got[2]["w1"][idle].abs().max().item() == 0.0


def _layer(ctx, router_cls, drop, factor, dispatch, seed=3):
    torch.manual_seed(seed)  # equal gate and expert weights for both dispatches
    router = router_cls(
        capacity_factor_train=factor, min_capacity=1, drop_tks=drop, use_z_loss=True
    )
    experts = moe.Experts(EXPERTS, HIDDEN, FFN, ctx=ctx, matmul="auto")
    return moe.MoeLayer(HIDDEN, EXPERTS, router, experts, ctx=ctx, dispatch=dispatch)


def _run(layer, x, device):
    x = x.clone().requires_grad_()
    with torch.autocast(device.type, dtype=torch.bfloat16):
        out = layer(x)
        aux = torch.stack(layer.take_losses()).sum()
    (out.float().square().sum() + aux).backward()  # a loss weighing every output element
    grads = {n: p.grad.clone() for n, p in layer.named_parameters()}
    return out.detach(), x.grad, grads, layer.last_dropped, layer.last_load


CASES = [(moe.Top2Router, True, 0.5), (moe.Top1Router, True, 0.5), (moe.Top2Router, False, 1.0)]


@pytest.mark.parametrize("router_cls,drop,factor", CASES)
def test_grouped_dispatch_equals_capacity_in_bf16(router_cls, drop, factor, launch, device):
    ctx = launch({})  # one rank: the expert group is the NCCL world of one
    x = torch.randn(4, 64, HIDDEN, generator=torch.Generator().manual_seed(2)).to(device)
    ref = _run(_layer(ctx, router_cls, drop, factor, "capacity"), x, device)
    got = _run(_layer(ctx, router_cls, drop, factor, "grouped"), x, device)
    what = f"{router_cls.__name__} drop={drop}"
    # the same gate on the same tokens: the same choices kept and dropped
    assert got[3] == ref[3], (what, got[3], ref[3])
    assert torch.equal(got[4], ref[4]), what
    if drop:
        assert ref[3] > 0, "the case must drop tokens"
    # both bf16 with fp32 accumulation; they differ in GEMM kernels and in where the expert
    # bias is added (before or after rounding to bf16): ~1-2 bf16 roundings apart
    assert rel_err(got[0], ref[0]) < 1e-2, (what, rel_err(got[0], ref[0]))
    assert rel_err(got[1], ref[1]) < 1e-2, (what, rel_err(got[1], ref[1]))
    for name, g_ref in ref[2].items():
        err = rel_err(got[2][name], g_ref)
        assert err < 2e-2, (what, name, err)


@pytest.mark.parametrize("drop", [True, False])
def test_grouped_dispatch_never_waits_for_the_device(drop, launch, device):
    """All experts local with grouped_mm: forward and backward of a step launch without one
    host sync (torch's sync debug mode turns any into an error), dropping or not."""
    if not (ON_CUDA and is_hopper()):
        pytest.skip("the sync-free path is the grouped_mm one (Hopper, bf16)")
    ctx = launch({})
    layer = _layer(ctx, moe.Top2Router, drop, 0.5, "grouped")
    x = torch.randn(4, 64, HIDDEN, device=device, requires_grad=True)
    _run(layer, x, device)  # warm-up: the grouped_mm probe and allocator growth may sync
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.autocast(device.type, dtype=torch.bfloat16):
            out = layer(x)
            aux = torch.stack(layer.take_losses()).sum()
        (out.float().square().sum() + aux).backward()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    if drop:
        assert int(layer.last_dropped) > 0, "the case must drop tokens"
