"""Partitioning (no processes): which layers a model has, where the cut goes (balanced by
parameters and compute, a tied weight counted on each stage), the stage table; and the
pipeline's clear errors (gloo, before any collective)."""

from __future__ import annotations

import pytest
import torch
from helpers.harness import run_distributed
from helpers.models import LMLoss, tied_lm
from helpers.runs import Ints, batches
from torch import nn

import gridtrain as gt
from gridtrain.parallel.materialize import lazy_init
from gridtrain.parallel.optimizer_rebind import rebind_optimizer
from gridtrain.parallel.pipeline import build_stage, layer_list, partition
from gridtrain.parallel.pipeline.balance import layer_costs
from gridtrain.parallel.pipeline.table import compress
from gridtrain.parallel.tags import is_pipeline_shared


def test_uniform_partition_gives_earlier_parts_the_remainder():
    assert partition([5] * 10, 4, "uniform") == [(0, 3), (3, 6), (6, 8), (8, 10)]


def test_parameter_partition_minimises_the_largest_part():
    # heavy embedding and head: each alone, the light middle layers together
    assert partition([100, 1, 1, 1, 1, 100], 3, "parameters") == [(0, 1), (1, 5), (5, 6)]
    assert partition([1, 1, 1, 9], 2, "parameters") == [(0, 3), (3, 4)]


def test_partition_errors_name_the_numbers():
    with pytest.raises(gt.PlanError, match=r"cannot cut 3 layers into 4 pipeline parts"):
        partition([1, 1, 1], 4)
    with pytest.raises(ValueError, match=r"partition must be one of .*'uniform'.*got 'greedy'"):
        partition([1, 1], 2, "greedy")


class Blocks(nn.Module):
    """A non-Sequential model exposing its layers, with nested dotted names."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(4, 4)
        self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))
        self.out = nn.Linear(4, 2)

    def pipeline_layers(self):
        return [self.inp, *self.blocks, self.out]


def test_stage_state_dict_keys_are_the_dense_keys():
    model = Blocks()
    dense = model.state_dict()
    keys = []
    for stage in range(2):
        module, _ = build_stage(model, stage, 2, method="uniform")
        keys.append(list(module.state_dict()))
        for k, v in module.state_dict().items():
            assert torch.equal(v, dense[k])
    assert keys[0] == [
        "inp.weight",
        "inp.bias",
        "blocks.0.weight",
        "blocks.0.bias",
        "blocks.1.weight",
        "blocks.1.bias",
    ]
    assert keys[1] == ["blocks.2.weight", "blocks.2.bias", "out.weight", "out.bias"]
    x = torch.randn(3, 4)
    first, _ = build_stage(model, 0, 2, method="uniform")
    last, _ = build_stage(model, 1, 2, method="uniform")
    torch.testing.assert_close(
        last(first(x)),
        model.out(model.blocks[2](model.blocks[1](model.blocks[0](model.inp(x))))),
        rtol=0,
        atol=0,
    )


def test_interleaved_chunks_are_virtual_stages():
    model = nn.Sequential(*[nn.Linear(2, 2) for _ in range(8)])
    module, _ = build_stage(model, 1, 2, num_chunks=2, method="uniform")
    # 8 layers, 4 parts: part c * P + s, so stage 1 holds parts 1 and 3
    assert module.chunk_layer_names == [["2", "3"], ["6", "7"]]


def test_unpartitionable_models_are_refused():
    class Plain(nn.Module):
        def forward(self, x):
            return x

    with pytest.raises(gt.PlanError, match="nn.Sequential, or give it a pipeline_layers"):
        build_stage(Plain(), 0, 2)

    class Loose(nn.Sequential):
        def __init__(self):
            super().__init__(nn.Linear(2, 2), nn.Linear(2, 2))
            self.scale = nn.Parameter(torch.ones(1))

    with pytest.raises(gt.PlanError, match=r"outside the pipeline layers.*\['scale'\]"):
        build_stage(Loose(), 0, 2)


def test_ties_between_middle_stages_are_refused():
    a, b, c, d = (nn.Linear(2, 2) for _ in range(4))
    c.weight = b.weight  # stages 1 and 2 of 4
    with pytest.raises(gt.PlanError, match=r"shared by pipeline stages \[1, 2\]"):
        build_stage(nn.Sequential(a, b, c, d), 0, 4)


def test_lazy_init_materialises_only_the_kept_layers():
    with lazy_init():
        model = tied_lm()
    assert all(p.is_meta for p in model.parameters())
    opt = torch.optim.SGD([dict(params=list(model.parameters()), lr=0.3)], lr=0.1, momentum=0.5)
    module, new_of = build_stage(model, 1, 2, method="uniform")  # layers 5..9, the tied head
    assert not any(p.is_meta for p in module.parameters())
    assert all(p.is_meta for p in model[0].parameters()), "other stages' layers stay on meta"
    head = module.get_submodule("9")
    assert is_pipeline_shared(head.weight) and head.weight.shape == (16, 8)
    # Linear.reset_parameters re-ran; the tied classifier's reset leaves its weight to the
    # embedding's owner and zeroes its bias
    assert module.get_submodule("5").weight.abs().sum() > 0
    assert torch.equal(head.bias, torch.zeros(16))
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
    rebound = rebind_optimizer(opt, new_of, drop_missing=True)
    assert rebound is opt, "same object: the LR scheduler still drives it"
    (group,) = opt.param_groups
    assert group["lr"] == 0.3 and group["momentum"] == 0.5
    opt.step()  # no gradients yet: moves nothing, but orders the scheduler's step after it
    sched.step()
    assert group["lr"] == 0.15
    assert {id(p) for p in group["params"]} == {id(p) for p in module.parameters()}


def _init(ctx, model_kind="lm", batch=8):
    model = tied_lm() if model_kind == "lm" else nn.Sequential(nn.Linear(2, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    engine, *_ = gt.initialize(model, opt, LMLoss(), ctx=ctx)
    x, y = batches(1, Ints(16, (batch, 3)), Ints(16, (batch, 3)))[0]
    engine.execute_schedule(iter([(x, y)]))


@pytest.mark.parametrize(
    "config,kwargs,match",
    [
        (dict(parallel=dict(pipeline=2)), {}, r"parallel.pipeline = 2 needs num_microbatches"),
        (
            dict(parallel=dict(pipeline=dict(size=2, num_chunks=2)), num_microbatches=3),
            {},
            r"num_microbatches 3 % pipeline 2 != 0",
        ),
        (
            dict(parallel=dict(pipeline=2), num_microbatches=3),
            {},
            r"batch size 8 \(this rank's inputs\) is not divisible by num_microbatches 3",
        ),
        (
            dict(parallel=dict(pipeline=2), num_microbatches=2),
            dict(model_kind="one-layer"),
            r"cannot cut 1 layers into 2 pipeline parts",
        ),
    ],
    ids=["no-microbatches", "interleaved-divisibility", "batch-divisibility", "too-few-layers"],
)
def test_clear_errors_before_any_collective(config, kwargs, match):
    with pytest.raises(RuntimeError, match=match):
        run_distributed(_init, 2, config=config, timeout=300, **kwargs)


def test_balanced_partition_weighs_parameters_and_compute():
    """A large embedding costs memory but no compute: 'parameters' leaves its stage idle,
    'balanced' bounds both shares."""
    model = nn.Sequential(nn.Embedding(512, 8), *[nn.Linear(31, 32) for _ in range(4)])
    costs = layer_costs(list(model))  # the embedding 4096 parameters, each Linear 1024
    assert costs.compute == [0] + [1024] * 4
    assert partition(costs, 2, "parameters") == [(0, 1), (1, 5)]  # compute 0 | 1
    # [emb, 1 layer] | [3 layers]: parameters 0.625 | 0.375, compute 0.25 | 0.75
    assert partition(costs, 2, "balanced") == [(0, 2), (2, 5)]


def test_a_tied_weight_counts_on_each_stage_that_holds_it():
    model = tied_lm()  # embedding 16x8, 4 Linear 8x8, head tied to the embedding (+ bias 16)
    stages = [build_stage(model, s, 2)[0] for s in range(2)]
    table = stages[0].stage_table
    assert table == stages[1].stage_table, "every rank makes the same cut"
    for s, stage in enumerate(stages):
        assert table.rows[s].params == sum(p.numel() for p in stage.parameters())
        assert list(table.rows[s].chunks) == [tuple(c) for c in stage.chunk_layer_names]
    assert table.total_params == sum(p.numel() for p in model.parameters())
    # the tied table is on both stages: the shares add up to 1 + its share
    assert table.share(0) + table.share(1) == pytest.approx(1 + 128 / table.total_params)
    text = str(table)
    assert "partition 'balanced'" in text and "share" in text, text
    for s in range(2):
        assert f"{table.rows[s].params:,}" in text, text


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        return x + torch.tanh(self.fc(x))


class ChainLM(nn.Module):
    """A plain model: nothing tells gridtrain its layers but the forward that chains them."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.blocks = nn.ModuleList(Block() for _ in range(3))
        self.norm, self.head = nn.LayerNorm(8), nn.Linear(8, 16)

    def forward(self, ids):
        h = self.emb(ids)
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))


def test_a_plain_model_is_cut_along_its_forward():
    model = ChainLM()
    assert [n for n, _ in layer_list(model)] == ["emb", "blocks.0", "blocks.1", "blocks.2",
                                                 "norm", "head"]  # fmt: skip
    first, _ = build_stage(model, 0, 2)
    last, _ = build_stage(model, 1, 2)
    x = torch.randint(16, (3, 5))
    torch.testing.assert_close(last(first(x)), model(x), rtol=0, atol=0)  # the same ops


def test_a_forward_that_is_not_a_chain_is_refused_by_name():
    class Residual(ChainLM):
        def forward(self, ids):
            h = self.emb(ids)
            return self.head(h + self.blocks[0](h))

    class Scaled(ChainLM):
        def forward(self, ids):
            return self.head(self.emb(ids) * 2)

    with pytest.raises(
        gt.PlanError, match=r"output of layer 'emb' is used 2 times.*pipeline_layers"
    ):
        layer_list(Residual())
    with pytest.raises(gt.PlanError, match=r"computes call_function 'mul' after layer 'emb'"):
        layer_list(Scaled())


def test_stage_names_are_compressed_in_runs():
    assert compress(("emb", "blocks.0", "blocks.1", "blocks.2", "norm")) == "emb, blocks.0-2, norm"
    assert compress(("0", "1", "3", "x.4")) == "0-1, 3, x.4"


def test_tied_weights_built_apart_are_marked_through_the_documented_call():
    a, b = nn.Linear(2, 2), nn.Linear(2, 2)
    gt.parallel.pipeline.mark_pipeline_shared(a.weight, b.weight)
    assert is_pipeline_shared(a.weight) and is_pipeline_shared(b.weight)
    assert not is_pipeline_shared(a.bias)
