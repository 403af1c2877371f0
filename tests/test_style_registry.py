"""A style is defined once: the config, ``gt.nn.Linear``'s hints and the planner read the same
``Style`` object (``gridtrain.parallel.tensor.style``).

A style registered with ``register_style`` (here one that keeps a Linear whole in a layer of the
test's own, under 1d) is accepted by ``parallel.tensor.plan`` and by ``gt.nn.Linear(split=)``
while it is registered and refused by both, in their usual words, once it is not; a 2-rank
run that registers it and names it in its config gets the planner's entry from it and trains
through the layer it brought, with the loss of the dense model.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from helpers.harness import run_distributed
from torch import nn

import gridtrain as gt
from gridtrain.config import STYLES
from gridtrain.parallel.tensor import style

NAME = "kept_in_own_layer"
PLAN = {"0": NAME}
CONFIG = dict(parallel=dict(tensor=dict(size=2, mode="1d", plan=PLAN)))


class KeptLinear(nn.Module):
    """The dense Linear's own parameters, whole on every rank; counts its calls."""

    def __init__(self, dense: nn.Linear, ctx=None):
        super().__init__()
        self.weight, self.bias = dense.weight, dense.bias
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return F.linear(x, self.weight, self.bias)


STYLE = style.Style(
    NAME,
    "Linear: kept whole in the test's own layer",
    (style.LINEAR,),
    layers={"1d": {style.LINEAR: (KeptLinear, {})}},
)


def _train(rank: int, world: int, port: int) -> dict:
    style.register_style(STYLE)  # every rank, before it loads a config naming it
    try:
        gt.launch(CONFIG, rank, world, "127.0.0.1", port, backend="gloo")
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
        dense = copy.deepcopy(model)
        x, y = torch.randn(4, 8), torch.randn(4, 8)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        engine, *_ = gt.initialize(model, opt, nn.MSELoss(), example_inputs=x)
        engine.train()
        engine.zero_grad()
        loss = engine.compute_loss(engine(x), y)
        engine.backward(loss)
        dense_loss = F.mse_loss(dense(x), y)
        dense_loss.backward()
        entry = engine.plan["0"]
        out = dict(
            entry=(entry.style, entry.origin, entry.layer),
            calls=engine.model[0].calls,
            loss=loss.item(),
            dense_loss=dense_loss.item(),
            grad=engine.model[0].weight.grad.clone(),
            dense_grad=dense[0].weight.grad.clone(),
        )
        gt.destroy()
        return out
    finally:
        style.unregister_style(NAME)


def test_a_registered_style_is_read_by_the_config_hints_and_planner():
    def config():
        return gt.Config.from_dict(CONFIG)

    with pytest.raises(gt.ConfigError, match=f"names unknown style '{NAME}'"):
        config()
    with pytest.raises(ValueError, match="split must be 'column', 'row' or a Linear style"):
        gt.nn.Linear(8, 16, split=NAME)
    style.register_style(STYLE)
    try:
        assert config().parallel.tensor.plan == PLAN
        assert STYLES[NAME] == STYLE.does  # the config's allowed values, read live
        assert gt.nn.Linear(8, 16, split=NAME).gt_style == NAME
        with pytest.raises(ValueError, match="already registered"):
            style.register_style(style.Style(NAME, "another", (style.LINEAR,)))
    finally:
        style.unregister_style(NAME)
    with pytest.raises(ValueError, match="built in"):
        style.unregister_style("colwise")

    ranks = run_distributed(_train, 2, launch=False)
    for r in ranks:
        assert r["entry"] == (NAME, "config", "KeptLinear"), r["entry"]
        assert r["calls"] == 1  # the forward ran through the style's own layer
        # float32, same math as the dense model (layer 2 is 1d's gathered column split:
        # each output column computed whole on one rank): only rounding may differ
        assert r["loss"] == pytest.approx(r["dense_loss"], rel=1e-6)
        # the kept weight is whole on every rank and gets the dense gradient (float32, the
        # row-parallel sum of the head's input gradient in another order: rounding only)
        assert r["grad"].shape == (16, 8)
        torch.testing.assert_close(r["grad"], r["dense_grad"], rtol=1e-5, atol=1e-6)
