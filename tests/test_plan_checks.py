"""What the planner's dry run catches before any weight moves, and what the plan says it did.

* A model that reads its head size off an activation (the README's first script once did:
  ``head_dim = x.shape[-1] // heads``) would run other heads under 2d/2.5d/3d, where the
  hidden dim arrives split: the sharded trace sees another head size at attention.
* A head count the tensor size cannot split fails with ``gridtrain estimate``'s words,
  not inside the model's ``view`` at the first step.
* A CNN under 1d gets only its classifier sharded: the plan says how much, rank 0 says
  what would serve better; under 2d the error lists what cannot be sharded, then "... and
  N more" and the same advice. With no tensor mode the plan shows the layout.
"""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F
from helpers.harness import run_distributed
from helpers.logs import gridtrain_warnings
from torch import nn

import gridtrain as gt


class Block(nn.Module):
    """Attention whose head size comes from the activation (``from_activation``) or from the
    configuration; 4 heads of 16."""

    def __init__(self, from_activation: bool, d: int = 64, heads: int = 4):
        super().__init__()
        self.heads, self.head_dim, self.from_activation = heads, d // heads, from_activation
        self.ln = nn.LayerNorm(d)
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))

    def forward(self, x):
        b, s, _ = x.shape
        head_dim = x.shape[-1] // self.heads if self.from_activation else self.head_dim
        h = self.ln(x)
        q, k, v = (t(h).view(b, s, -1, head_dim).transpose(1, 2) for t in (self.q, self.k, self.v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.o(a.transpose(1, 2).reshape(b, s, -1))


class LM(nn.Module):
    def __init__(self, from_activation: bool = False):
        super().__init__()
        self.emb = nn.Embedding(64, 64)
        self.blocks = nn.Sequential(Block(from_activation), Block(from_activation))
        self.head = nn.Linear(64, 64, bias=False)

    def forward(self, ids):
        return self.head(self.blocks(self.emb(ids)))


def _init_error(ctx, from_activation):
    torch.manual_seed(0)
    model = LM(from_activation)
    params = {id(p) for p in model.parameters()}
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ids = torch.zeros(4, 8, dtype=torch.long)  # given: these tests are about the shapes
    try:
        gt.initialize(model, opt, gt.nn.CrossEntropyLoss(), example_inputs=ids)
    except gt.PlanError as err:
        return str(err), {id(p) for p in model.parameters()} == params
    return None, True


@pytest.mark.parametrize("tensor", [dict(size=4, mode="2d"), dict(size=8, mode="3d")])
def test_a_head_size_read_off_split_activations_is_caught(tensor):
    config = dict(parallel=dict(tensor=tensor))
    world = tensor["size"]
    for err, untouched in run_distributed(_init_error, world, True, config=config):
        assert err is not None, "the model would silently run 8 heads of 8"
        assert re.search(
            r"'blocks.0' calls scaled_dot_product_attention with head size 8 on this rank "
            r"under tensor mode '\dd', 16 in the dense model.*model's configuration",
            err,
        ), err
        assert untouched, "no parameter was replaced"
    # the same model with its head size from the configuration plans and runs
    for err, _ in run_distributed(_init_error, world, False, config=config):
        assert err is None, err


def test_a_head_count_the_tensor_size_cannot_split_is_caught():
    config = dict(parallel=dict(tensor=dict(size=8, mode="1d")))
    for err, untouched in run_distributed(_init_error, 8, False, config=config):
        assert err is not None and re.search(
            r"'blocks.0': 4 attention heads do not split over PARALLEL_1D \(8 ranks\): "
            r"4 % 8 != 0",
            err,
        ), err
        assert untouched, "no parameter was replaced"


class TinyCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16)
        self.conv2, self.bn2 = nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32)
        self.conv3 = nn.Conv2d(32, 32, 3, padding=1)
        self.fc = nn.Linear(32, 10)

    def forward(self, x):
        x = F.relu(self.bn1(self.conv1(x)))
        x = F.relu(self.bn2(self.conv2(x)))
        return self.fc(F.relu(self.conv3(x)).mean((2, 3)))


def _cnn(ctx):
    torch.manual_seed(0)
    model = TinyCNN()
    with gridtrain_warnings() as lines:
        try:
            engine, *_ = gt.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1))
        except gt.PlanError as err:
            return str(err), []
    return str(engine.plan), [m for m in lines if "shards" in m]


def test_a_cnn_under_1d_is_told_what_serves_it_better():
    config = dict(parallel=dict(tensor=dict(size=2, mode="1d")))
    dense = sum(p.numel() for p in TinyCNN().parameters())
    fc = 32 * 10 + 10
    for rank, (plan, notices) in enumerate(run_distributed(_cnn, 2, config=config)):
        # the fc weight is split, its bias too (colwise_gather_output); the convs stay whole
        want = f"{fc / dense:.1%} of {dense:,} parameters sharded"
        assert want in plan, plan
        if rank == 0:
            assert len(notices) == 1, notices
            assert re.match(
                rf"tensor mode '1d' shards {fc / dense:.1%} of TinyCNN's parameters \(fc\).*"
                r"convolutional model, data parallelism .* or ZeRO",
                notices[0],
            ), notices
        else:
            assert notices == [], "one notice, from rank 0"


def test_a_cnn_under_2d_names_what_cannot_be_sharded_and_what_serves_better():
    config = dict(parallel=dict(tensor=dict(size=4, mode="2d")))
    for err, _ in run_distributed(_cnn, 4, config=config):
        # 10 loose tensors: conv1-3 weight and bias, bn1-2 weight and bias
        assert re.search(r"these do not: conv1.weight, conv1.bias, .* \.\.\. and 2 more", err), err
        assert "convolutional model, data parallelism" in err and "ZeRO" in err, err


def test_the_plan_shows_the_layout_without_a_tensor_mode():
    config = dict(zero=dict(stage=1))
    for plan, notices in run_distributed(_cnn, 2, config=config):
        assert (
            plan.splitlines()[0]
            == "layout: data 2 x pipeline 1 x tensor 1 (no tensor mode); ZeRO stage 1"
        ), plan
        assert notices == [], "no tensor mode: nothing to say about its coverage"
