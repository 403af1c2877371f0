"""The tensor plan: gt.nn layers are plain modules; plans given, hinted or traced; clear errors
before any weight moves; the optimizer rebound in place; gt.lazy_init in every mode; dropout
masks drawn from the stream their activations' layout needs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers.harness import run_distributed
from helpers.models import TinyTransformer
from torch import nn

import gridtrain as gt


def test_gt_nn_layers_are_plain_modules_with_hints():
    lin = gt.nn.Linear(4, 6, split="row")
    assert isinstance(lin, nn.Linear) and lin.gt_style == "rowwise"
    assert gt.nn.Linear(4, 6, gather_output=True).gt_style == "colwise_gather_output"
    assert gt.nn.Linear(4, 12, packed=3).gt_style == "packed_colwise"
    assert isinstance(gt.nn.VocabParallelEmbedding(8, 4), nn.Embedding)
    assert isinstance(gt.nn.LayerNorm(4), nn.LayerNorm)
    x = torch.randn(2, 4)
    assert torch.equal(lin(x), F.linear(x, lin.weight, lin.bias)), "no context: plain math"
    with pytest.raises(ValueError, match="gather_output .* and parallel_input .* exclude"):
        gt.nn.Linear(4, 4, gather_output=True, parallel_input=True)
    with pytest.raises(ValueError, match="split must be 'column', 'row' or a Linear style"):
        gt.nn.Linear(4, 4, split="diagonal")


def _mlp():
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))


def _init(ctx, build, example=True, opt_groups=False):
    torch.manual_seed(0)
    model = build()
    params = {id(p) for p in model.parameters()}
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    make_x = getattr(build, "example", lambda: torch.randn(4, 8))
    x = make_x() if example else None
    try:
        gt.initialize(model, opt, nn.MSELoss(), example_inputs=x)
    except gt.PlanError as err:
        untouched = {id(p) for p in model.parameters()} == params
        return str(err), untouched
    return None, None


def _narrow_mlp():
    return nn.Sequential(nn.Linear(8, 6), nn.ReLU(), nn.Linear(6, 8))


class _Tied(nn.Module):
    @staticmethod
    def example():
        return torch.randint(0, 16, (4, 8))  # token ids

    def __init__(self):
        super().__init__()
        self.emb = gt.nn.Embedding(16, 8)  # hint: embedding dim split
        self.head = nn.Linear(8, 16, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids):
        return self.head(self.emb(ids))


class _TwoInputs(nn.Module):
    """A forward no single tensor built from the entry layer can call."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x, scale):
        return self.b(torch.relu(self.a(x))) * scale


ERRORS = {
    "pattern matches nothing": (
        2,
        dict(plan={"blocks.*.fc": "colwise"}),
        _mlp,
        r"pattern 'blocks.\*.fc' matches no layer",
    ),
    "style of another kind": (2, dict(plan={"0": "embedding_rowwise"}), _mlp, r"'0' is a linear"),
    "indivisible": (
        4,
        dict(plan={"0": "colwise", "2": "rowwise"}),
        _narrow_mlp,
        r"'0' as colwise: ColumnLinear: out_features=6 must be divisible by 4",
    ),
    "two column layers in a row": (
        2,
        dict(plan={"0": "colwise", "2": "colwise"}),
        _mlp,
        r"two column layers in a row: '0' \(colwise\) is read by '2' \(colwise\)",
    ),
    "no input can be built": (
        2,
        {},
        _TwoInputs,
        r"no input could be built for _TwoInputs.*pass example_inputs=",
    ),
    "tie cut two ways": (
        2,
        dict(plan={"head": "colwise_gather_output"}),
        _Tied,
        r"'head.weight' is tied to 'emb.weight'.*no style of 'head' cuts it the same way",
    ),
}


@pytest.mark.parametrize("name", list(ERRORS))
def test_a_plan_that_does_not_fit_fails_before_any_weight_moves(name):
    world, tensor, build, pattern = ERRORS[name]
    config = dict(parallel=dict(tensor=dict(size=world, mode="1d", **tensor)))
    example = name != "no input can be built"
    for err, untouched in run_distributed(_init, world, build, example, config=config):
        assert err is not None and __import__("re").search(pattern, err), err
        assert untouched, "no parameter was replaced"


def _rebind(ctx):
    torch.manual_seed(0)
    model = _mlp()
    opt = torch.optim.SGD(
        [dict(params=model[0].parameters(), lr=0.5), dict(params=model[2].parameters())],
        lr=0.1,
        momentum=0.9,
    )
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
    engine, *_ = gt.initialize(model, opt, nn.MSELoss(), example_inputs=torch.randn(4, 8))
    same = engine.optimizer is opt
    groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    bound = [{id(p) for p in g["params"]} for g in opt.param_groups]
    layers = [{id(p) for p in engine.model[i].parameters()} for i in (0, 2)]
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    engine.zero_grad()
    engine.backward(engine.criterion(engine(x), y))
    engine.step()
    sched.step()
    return same, groups, bound == layers, opt.param_groups[0]["lr"], str(engine.plan)


def test_the_users_optimizer_is_rebound_in_place():
    for same, groups, bound, lr, plan in run_distributed(
        _rebind, 2, config=dict(parallel=dict(tensor=dict(size=2, mode="1d")))
    ):
        assert same, "the same optimizer object (an LR scheduler built on it keeps working)"
        assert groups[0]["lr"] == 0.5 and groups[1]["lr"] == 0.1 and groups[0]["momentum"] == 0.9
        assert bound, "each group holds its layer's new (sharded) parameters"
        assert lr == 0.25, "the scheduler drove the rebound optimizer"
        assert "ColumnLinear" in plan and "RowLinear" in plan, plan


def _lazy(ctx):
    with gt.lazy_init():
        model = TinyTransformer(vocab=64, seq=16)
    assert all(p.is_meta for p in model.parameters())
    torch.manual_seed(0)  # the draws happen at materialisation, in module order
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    engine, *_ = gt.initialize(model, opt, example_inputs=torch.zeros(8, 16, dtype=torch.long))
    local = {n: tuple(p.shape) for n, p in engine.model.named_parameters()}
    meta = any(p.is_meta for p in engine.model.parameters())
    return gt.full_state_dict(engine.model), local, meta


LAZY = {
    "1d": (2, dict(size=2, mode="1d"), (64, 32)),  # fc: [128, 32] split over 2
    "2d": (4, dict(size=4, mode="2d"), (64, 16)),
    "3d": (8, dict(size=8, mode="3d"), (32, 16)),
}


@pytest.mark.parametrize("mode", list(LAZY))
def test_lazy_init_materialises_only_this_ranks_shards(mode):
    world, tensor, fc_shape = LAZY[mode]
    torch.manual_seed(0)
    dense = TinyTransformer(vocab=64, seq=16).state_dict()
    for full, local, meta in run_distributed(
        _lazy, world, config=dict(parallel=dict(tensor=tensor))
    ):
        assert not meta
        assert local["blocks.0.fc.weight"] == fc_shape, local["blocks.0.fc.weight"]
        for k, v in dense.items():
            # each layer re-drew its dense init (same generator, same order) and kept its cut
            assert torch.equal(full[k], v), (mode, k)


def _dropout(ctx):
    model = nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.5), nn.Linear(16, 8), nn.Dropout(0.5))
    engine, *_ = gt.initialize(
        model, torch.optim.SGD(model.parameters(), lr=0.1), example_inputs=torch.zeros(4, 8)
    )
    flags = [engine.plan[n].options.get("sharded") for n in ("1", "3")]
    torch.manual_seed(0)
    inner = engine.model[1](torch.ones(64, 8))  # split activations: own mask per rank
    torch.manual_seed(0)
    outer = engine.model[3](torch.ones(64, 8))  # replicated activations: one mask
    return flags, inner, outer


def test_dropout_masks_follow_the_activation_layout():
    (f0, in0, out0), (f1, in1, out1) = run_distributed(
        _dropout, 2, config=dict(parallel=dict(tensor=dict(size=2, mode="1d")))
    )
    assert f0 == f1 == [True, False]
    assert torch.equal(out0, out1), "replicated activations draw one mask on every rank"
    assert not torch.equal(in0, in1), "split activations draw a different mask per rank"
