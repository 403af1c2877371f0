"""Routers on hand-built logits: capacity formula, dropped tokens, aux/z losses, gates, noise."""

import math

import pytest
import torch

from gridtrain.parallel.moe import (
    Top1Router,
    Top2Router,
    capacity,
    load_balancing_loss,
    router_z_loss,
)
from gridtrain.parallel.moe.experts import check_num_experts


def test_capacity_formula():
    assert capacity(12, 4, 1, 1.0, 1) == 3  # 1 * 1.0 * 12 / 4
    assert capacity(10, 4, 2, 1.25, 1) == math.ceil(2 * 1.25 * 10 / 4) == 7
    assert capacity(4, 8, 1, 1.0, 4) == 4, "min_capacity floors it"
    router = Top2Router(capacity_factor_train=1.0, capacity_factor_eval=3.0, min_capacity=1)
    assert router.capacity(16, 4) == 8
    router.eval()
    assert router.capacity(16, 4) == 24, "eval uses capacity_factor_eval"


def _expected_drops(choices: list[torch.Tensor], num_experts: int, cap: int) -> int:
    """Choices fill each expert in order: all top-1 choices by token, then the top-2 ones."""
    used = [0] * num_experts
    dropped = 0
    for index in choices:
        for e in index.tolist():
            if used[e] < cap:
                used[e] += 1
            else:
                dropped += 1
    return dropped


def test_top1_drops_tokens_beyond_capacity():
    # 12 tokens, 4 experts: 9 want expert 0, 3 want expert 1; capacity 1.0 * 12 / 4 = 3
    logits = torch.full((12, 4), -5.0)
    logits[:9, 0] = 5.0
    logits[9:, 1] = 5.0
    out = Top1Router(capacity_factor_train=1.0, min_capacity=1)(logits)
    assert out.dispatch_mask.shape == (12, 4, 3)
    assert out.dropped == 6, "expert 0 keeps 3 of 9"
    assert out.dispatch_mask[:3, 0].any(-1).all() and not out.dispatch_mask[3:9].any()
    assert out.load.tolist() == [9, 3, 0, 0]
    # each kept token holds exactly one slot and no two tokens share one
    assert out.dispatch_mask.sum().item() == 6
    assert out.dispatch_mask.sum(0).max().item() == 1


@pytest.mark.parametrize("router_cls,k", [(Top1Router, 1), (Top2Router, 2)])
@pytest.mark.parametrize("factor", [0.5, 1.0, 2.0])
def test_dropped_count_matches_capacity(router_cls, k, factor):
    torch.manual_seed(0)
    tokens, experts = 40, 4
    logits = torch.randn(tokens, experts) * 2
    router = router_cls(capacity_factor_train=factor, min_capacity=1)
    out = router(logits)
    cap = capacity(tokens, experts, k, factor, 1)
    assert out.dispatch_mask.shape[-1] == cap
    order = logits.argsort(dim=-1, descending=True)
    choices = [order[:, i] for i in range(k)]
    assert out.dropped == _expected_drops(choices, experts, cap)
    assert out.dispatch_mask.sum().item() == tokens * k - out.dropped
    assert out.dispatch_mask.sum(0).max().item() <= 1, "one token per slot"


def test_no_drop_mode_keeps_every_token():
    torch.manual_seed(1)
    logits = torch.randn(30, 4) * 3
    out = Top2Router(capacity_factor_train=0.1, min_capacity=1, drop_tks=False)(logits)
    assert out.dropped == 0
    assert out.dispatch_mask.shape[-1] == out.load.max().item(), "capacity = busiest expert"
    assert out.dispatch_mask.sum().item() == 60


def test_aux_loss_hand_computed_top1():
    # probs [[.9,.1],[.6,.4],[.3,.7]]: choices 0, 0, 1 -> f = [2/3, 1/3]; P = [0.6, 0.4]
    # aux = E * sum f * P = 2 * (0.4 + 0.4/3) = 16/15
    probs = torch.tensor([[0.9, 0.1], [0.6, 0.4], [0.3, 0.7]])
    out = Top1Router(min_capacity=1)(probs.log())
    # float32 softmax of log-probs round-trips to ~1 ulp
    assert out.aux_loss.item() == pytest.approx(16 / 15, abs=1e-6)


def test_aux_loss_hand_computed_top2():
    # 2 tokens, 3 experts. token 0 picks 0 then 1, token 1 picks 2 then 1:
    # choice fraction per expert = [1/2, 2/2, 1/2]; P = [(.5+.1)/2, (.3+.3)/2, (.2+.6)/2]
    # aux = E/k * sum = 3/2 * (0.5*0.3 + 1*0.3 + 0.5*0.4) = 3/2 * 0.65 = 0.975
    probs = torch.tensor([[0.5, 0.3, 0.2], [0.1, 0.3, 0.6]])
    out = Top2Router(min_capacity=1)(probs.log())
    assert out.aux_loss.item() == pytest.approx(0.975, abs=1e-6)  # float32 round-off
    # kept gates renormalised: token 0 -> 0.5/0.8 and 0.3/0.8
    gates = out.combine_weights.sum(-1)
    torch.testing.assert_close(gates[0], torch.tensor([0.625, 0.375, 0.0]))
    torch.testing.assert_close(gates[1], torch.tensor([0.0, 1 / 3, 2 / 3]))


def test_load_balancing_loss_is_one_when_uniform():
    probs = torch.full((8, 4), 0.25)
    load = torch.eye(4).repeat(2, 1).sum(0)  # each of the 4 experts chosen by 2 of 8 tokens
    assert load_balancing_loss(probs, load, 8, 1).item() == pytest.approx(1.0)


def test_z_loss():
    logits = torch.tensor([[1.0, 2.0], [0.0, -1.0]])
    expected = (torch.logsumexp(logits, -1) ** 2).mean()
    out = Top1Router(use_z_loss=True, min_capacity=1)(logits)
    assert out.z_loss.item() == pytest.approx(expected.item(), rel=1e-6)
    assert router_z_loss(logits).item() == pytest.approx(expected.item(), rel=1e-6)
    assert Top1Router(min_capacity=1)(logits).z_loss.item() == 0.0, "off unless use_z_loss"


def test_top1_combine_weight_is_the_gate_probability():
    torch.manual_seed(2)
    logits = torch.randn(6, 3)
    out = Top1Router(capacity_factor_train=10.0)(logits)
    probs = logits.softmax(-1)
    torch.testing.assert_close(out.combine_weights.sum((1, 2)), probs.max(-1).values)


def test_noise_only_in_training():
    torch.manual_seed(3)
    logits = torch.randn(16, 4)
    clean = Top2Router(capacity_factor_train=4.0, capacity_factor_eval=4.0)(logits)
    for policy in ("Gaussian", "Jitter"):
        router = Top2Router(
            capacity_factor_train=4.0, capacity_factor_eval=4.0, noisy_policy=policy
        )
        router.eval()
        assert torch.equal(router.noisy_input(logits), logits)
        assert torch.equal(router(logits).combine_weights, clean.combine_weights)
        router.train()
        if policy == "Gaussian":
            assert not torch.equal(router.noisy_logits(logits), logits)
        else:
            jittered = router.noisy_input(logits)
            assert not torch.equal(jittered, logits)
            assert ((jittered / logits - 1).abs() <= router.jitter_eps + 1e-6).all()


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="noisy_policy"):
        Top1Router(noisy_policy="Uniform")
    with pytest.raises(ValueError, match="capacity_factor_train"):
        Top1Router(capacity_factor_train=0)
    with pytest.raises(ValueError, match="min_capacity"):
        Top1Router(min_capacity=0)
    with pytest.raises(ValueError, match="num_experts 6 is not divisible by .* 4"):
        check_num_experts(6, 4)
    with pytest.raises(ValueError, match="at least 2 experts"):
        Top2Router()(torch.randn(3, 1))
