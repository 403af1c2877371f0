"""The grouped MoE dispatch (tokens sorted by expert, grouped matmuls) equals the capacity one.

Both dispatches run in the same process on the same tokens and weights: outputs, input
gradients, gate and expert gradients, dropped counts and loads must agree, with tokens
dropped (a small capacity factor) and without (``drop_tks=False``), top-1 and top-2, at
expert parallel 1, 2 and 4 (ranks holding different numbers of tokens, so the capacity
agreement and uneven all-to-all splits are exercised). The two paths do the same float32
arithmetic per row, only the matmuls' row blocking differs: tolerances 1e-5 / 1e-6.
"""

import pytest
import torch
from helpers.harness import run_distributed

from gridtrain.parallel import moe
from gridtrain.parallel.moe.dispatch import expert_order
from gridtrain.parallel.moe.router import Assignment

HIDDEN, FFN, EXPERTS = 16, 24, 4


def _layer(router_cls, drop, factor, dispatch, matmul="bmm", ctx=None, seed=3):
    torch.manual_seed(seed)  # equal dense weights for both dispatches and every ep
    router = router_cls(
        capacity_factor_train=factor, min_capacity=1, drop_tks=drop, use_z_loss=True
    )
    experts = moe.Experts(EXPERTS, HIDDEN, FFN, ctx=ctx, matmul=matmul)
    return moe.MoeLayer(HIDDEN, EXPERTS, router, experts, ctx=ctx, dispatch=dispatch)


def _run(layer, x):
    x = x.clone().requires_grad_()
    out = layer(x)
    aux = torch.stack(layer.take_losses()).sum()
    (out.square().sum() + aux).backward()  # a loss that weighs every output element
    grads = {n: p.grad.clone() for n, p in layer.named_parameters()}
    return out.detach(), x.grad, grads, layer.last_dropped, layer.last_load


def _compare(got, ref, what):
    out, xg, grads, dropped, load = got
    r_out, r_xg, r_grads, r_dropped, r_load = ref
    assert dropped == r_dropped, what
    assert torch.equal(load, r_load), what
    # float32, the same products per row; only GEMM blocking over other row counts differs
    torch.testing.assert_close(out, r_out, rtol=0, atol=1e-5, msg=what)
    torch.testing.assert_close(xg, r_xg, rtol=0, atol=1e-5, msg=what)
    for n, g in grads.items():
        torch.testing.assert_close(g, r_grads[n], rtol=0, atol=1e-5, msg=f"{what} {n}")


CASES = [
    (moe.Top1Router, True, 0.5),
    (moe.Top2Router, True, 0.5),
    (moe.Top2Router, True, 1.25),
    (moe.Top1Router, False, 0.5),
    (moe.Top2Router, False, 0.5),
]


@pytest.mark.parametrize("matmul", ["bmm", "grouped_mm"])
@pytest.mark.parametrize("router_cls,drop,factor", CASES)
def test_grouped_equals_capacity_one_process(router_cls, drop, factor, matmul):
    x = torch.randn(3, 20, HIDDEN, generator=torch.Generator().manual_seed(1))
    ref = _run(_layer(router_cls, drop, factor, "capacity"), x)
    got = _run(_layer(router_cls, drop, factor, "grouped", matmul), x)
    if drop and factor < 1:
        assert ref[3] > 0, "the case must drop tokens"
    _compare(got, ref, f"{router_cls.__name__} drop={drop} {matmul}")


def test_dropped_tokens_output_zero():
    """Choices past capacity contribute nothing: with top-1 a dropped token's output is 0."""
    layer = _layer(moe.Top1Router, True, 0.25, "grouped")
    x = torch.randn(40, HIDDEN, generator=torch.Generator().manual_seed(2))
    out = layer(x)
    assert layer.last_dropped > 0
    zero_rows = (out == 0).all(-1).sum().item()
    assert zero_rows == layer.last_dropped


def test_expert_order_sorts_kept_choices_by_expert_then_slot():
    # 4 tokens x top-2 over 3 experts; capacity 2 drops expert 0's third choice
    expert = torch.tensor([0, 0, 1, 0, 2, 1, 0, 2])
    slot = torch.tensor([0, 1, 0, 2, 0, 1, 3, 1])
    token = torch.tensor([0, 1, 2, 3, 0, 1, 2, 3])
    load = torch.bincount(expert, minlength=3)
    a = Assignment(token, expert, slot, torch.ones(8), 2, torch.zeros(()), torch.zeros(()), load)
    kept = a.kept_counts()
    assert kept.tolist() == [2, 2, 2]
    order = expert_order(a, kept, 6)
    assert expert[order].tolist() == [0, 0, 1, 1, 2, 2]
    assert slot[order].tolist() == [0, 1, 0, 1, 0, 1]


def test_assignment_matches_capacity_masks():
    torch.manual_seed(4)
    logits = torch.randn(30, EXPERTS) * 2
    router = moe.Top2Router(capacity_factor_train=0.75, min_capacity=1)
    a, routed = router.assign(logits), router(logits)
    kept = a.slot < a.capacity
    mask = torch.zeros_like(routed.dispatch_mask)
    mask[a.token[kept], a.expert[kept], a.slot[kept]] = True
    assert torch.equal(mask, routed.dispatch_mask)
    assert routed.dropped == int((~kept).sum())


def test_bad_dispatch_is_named():
    with pytest.raises(ValueError, match="dispatch must be one of"):
        _layer(moe.Top2Router, True, 1.0, "sorted")
    with pytest.raises(ValueError, match="matmul must be one of"):
        moe.Experts(EXPERTS, HIDDEN, FFN, matmul="loop")


def _both_dispatches(ctx, router_name, drop, factor):
    router_cls = getattr(moe, router_name)
    rank = ctx.global_rank
    # ranks hold different numbers of tokens: capacity agreement and uneven splits
    x = torch.randn(12 + 5 * rank, HIDDEN, generator=torch.Generator().manual_seed(10 + rank))
    ref = _run(_layer(router_cls, drop, factor, "capacity", ctx=ctx), x)
    got = _run(_layer(router_cls, drop, factor, "grouped", ctx=ctx), x)
    return got, ref


@pytest.mark.parametrize("ep", [2, 4])
@pytest.mark.parametrize(
    "router_name,drop,factor", [("Top2Router", True, 0.5), ("Top2Router", False, 0.5)]
)
def test_grouped_equals_capacity_expert_parallel(ep, router_name, drop, factor):
    results = run_distributed(
        _both_dispatches,
        ep,
        router_name,
        drop,
        factor,
        config=dict(moe=dict(expert_parallel_size=ep)),
        timeout=300,
    )
    for rank, (got, ref) in enumerate(results):
        if drop:
            assert sum(r[1][3] for r in results) > 0, "the case must drop tokens"
        _compare(got, ref, f"ep{ep} rank {rank} drop={drop}")


def test_throughput_benchmark_cpu_tiny(capsys):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import moe_throughput

    moe_throughput.main(
        ["--device", "cpu", "--steps", "1", "--rounds", "1", "--hidden", "16", "--depth", "1",
         "--batch", "2", "--matmul", "bmm", "grouped_mm"]
    )  # fmt: skip
    out = capsys.readouterr().out
    for name in ("grouped/bmm", "grouped/grouped_mm", "capacity", "dense"):
        assert f"cpu    {name}" in out, out


def test_grouped_mm_experts_equal_the_padded_batched_matmul():
    """``forward_grouped`` through grouped_mm (bias rows added as one_hot @ bias) against the
    padded bmm, float32, uneven counts with one idle expert: outputs and every gradient; the
    idle expert's bias gradient is exactly zero."""
    counts = torch.tensor([3, 0, 5, 1])
    g = torch.Generator().manual_seed(5)
    x = torch.randn(int(counts.sum()), HIDDEN, generator=g)
    w = torch.randn(int(counts.sum()), HIDDEN, generator=g)
    results = []
    for matmul in ("grouped_mm", "bmm"):
        torch.manual_seed(6)
        experts = moe.Experts(4, HIDDEN, FFN, matmul=matmul)
        xi = x.clone().requires_grad_()
        y = experts.forward_grouped(xi, counts, int(counts.max()))
        (y * w).sum().backward()
        results.append((y.detach(), xi.grad, {n: p.grad for n, p in experts.named_parameters()}))
    (y, gx, grads), (ry, rx, ref) = results
    # float32, the same products; only the matmuls' blocking differs
    torch.testing.assert_close(y, ry, rtol=0, atol=1e-5)
    torch.testing.assert_close(gx, rx, rtol=0, atol=1e-5)
    for name in ref:
        torch.testing.assert_close(grads[name], ref[name], rtol=0, atol=1e-5, msg=name)
    assert torch.equal(grads["b1"][1], torch.zeros(FFN))


@pytest.mark.parametrize("router_cls", [moe.Top1Router, moe.Top2Router])
def test_sync_free_path_takes_an_empty_batch(router_cls):
    layer = _layer(router_cls, True, 1.0, "grouped", matmul="grouped_mm")
    x = torch.zeros(0, HIDDEN, requires_grad=True)
    out = layer(x)
    out.sum().backward()
    assert out.shape == (0, HIDDEN) and x.grad.shape == (0, HIDDEN)


def test_top2_ties_go_to_the_lowest_experts():
    """Equal logits (common in bf16) pick the lowest indices on every device; a second
    choice whose probability underflows to 0 is still ranked by its logit."""
    router = moe.Top2Router(min_capacity=1)
    a = router.assign(torch.zeros(3, 8))
    assert a.expert.view(2, 3).t().tolist() == [[0, 1]] * 3
    a = router.assign(torch.tensor([[200.0, 0.0, 0.0, 10.0]]))
    assert a.expert.tolist() == [0, 3]


def test_dropped_count_is_never_updated_in_place():
    """The sync-free path counts drops in a device tensor: a later forward adds to a new
    one, so a count taken earlier (or made under inference_mode) stays valid."""
    layer = _layer(moe.Top1Router, True, 0.25, "grouped", matmul="grouped_mm")
    x = torch.randn(40, HIDDEN, generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        layer(x)
    first = layer.last_dropped
    before = int(first)
    assert before > 0, "the case must drop tokens"
    layer(x.clone().requires_grad_())  # a training forward after an inference one
    assert int(first) == before and int(layer.last_dropped) == 2 * before
