"""Per-rank parameter shapes: the engine's own tensor plan of a model built on the meta device.

The planner and each mode layer's constructor run on a ``Layout`` (the rank grid with no
process groups: they ask only for sizes and ranks while they are built), so ``build_plan``
gives the exact per-rank shard shapes of any hypothetical world, thousands of ranks
included, on one CPU.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import torch
from torch import nn

from gridtrain.config import Config
from gridtrain.estimate.models import ModelSpec
from gridtrain.estimate.skeleton import meta_skeleton
from gridtrain.parallel.layout import Layout
from gridtrain.parallel.tensor.modes import geometry_of
from gridtrain.parallel.tensor.parallelize import build_plan
from gridtrain.parallel.tensor.plan import Plan


def tensor_config(mode: str | None, size: int, depth: int = 1, ring: str = "standard") -> Config:
    """A config with only the tensor section (one tensor block is all the planner looks at)."""
    tensor: dict = {"size": size, "mode": mode}
    geometry = geometry_of(mode)
    if geometry.uses_depth:
        tensor["depth"] = depth
    if geometry.splits_sequence:
        tensor["ring_attention"] = ring
    return Config.from_dict({"parallel": {"tensor": tensor}})


@dataclasses.dataclass(frozen=True)
class LayerShards:
    """One pipeline layer (``embed``, a block, ``head``) of the skeleton on one tensor rank."""

    name: str
    local: dict[str, tuple[int, ...]]  # parameter path -> this rank's shape
    dense: dict[str, tuple[int, ...]]  # parameter path -> dense shape
    tied: frozenset[str]  # parameter paths that are another layer's weight (counted there)

    @functools.cached_property
    def numel(self) -> int:
        """Parameters this layer holds on the rank (its own; tied ones once, by their owner)."""
        return sum(math.prod(s) for p, s in self.local.items() if p not in self.tied)

    @functools.cached_property
    def numel_with_ties(self) -> int:
        """What the layer holds when it sits on a stage of its own (a tied copy included)."""
        return sum(math.prod(s) for s in self.local.values())

    @functools.cached_property
    def tensors(self) -> int:
        return len(self.local) - len(self.tied)


@dataclasses.dataclass(frozen=True)
class TensorShards:
    """The planned skeleton under one tensor layout: embed, one block, head."""

    plan: Plan
    embed: LayerShards
    block: LayerShards
    head: LayerShards


def _layer_shards(name: str, module: nn.Module, plan: Plan, owned: set[int]) -> LayerShards:
    local, dense, tied = {}, {}, set()
    for mname, sub in module.named_modules():
        path = f"{name}.{mname}" if mname else name
        entry = plan.entries.get(path)
        for pname, p in sub.named_parameters(recurse=False):
            key = f"{path}.{pname}"
            dense[key] = tuple(p.shape)
            shards = entry.shards if entry is not None else {}
            local[key] = tuple(shards[pname][1]) if pname in shards else tuple(p.shape)
            if id(p) in owned:
                tied.add(key)
            owned.add(id(p))
    return LayerShards(name, local, dense, frozenset(tied))


@functools.lru_cache(maxsize=256)
def tensor_shards(spec: ModelSpec, mode: str | None, size: int, depth: int = 1) -> TensorShards:
    """Plan the one-block skeleton of ``spec`` for a tensor block of ``size`` ranks (rank 0).

    Raises the planner's ``PlanError`` (layer, dim, divisor) when the layout does not fit.
    """
    cfg = tensor_config(mode, size, depth)
    layout = Layout(cfg, size)
    model = meta_skeleton(spec)
    example = torch.zeros(max(1, size), min(spec.seq_len, 8), dtype=torch.long, device="meta")
    plan = build_plan(model, layout, example)  # modes that do not trace ignore the example
    owned: set[int] = set()
    layers = [_layer_shards(n, m, plan, owned) for n, m in model.named_children()]
    return TensorShards(plan, *layers)
