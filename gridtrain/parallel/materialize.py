"""Models built on the meta device (``gt.lazy_init``): nothing is allocated until the engine
keeps what this rank holds, which it then allocates and initialises."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from gridtrain.parallel.tags import copy_tags


@contextlib.contextmanager
def lazy_init() -> Iterator[None]:
    """Build a model on the meta device: no memory is allocated until the engine keeps its part.

    ``with gt.lazy_init(): model = build_model()`` then ``gt.initialize(model, ...)``:
    each rank materialises only its pipeline stage's layers and, of those, only its
    tensor-parallel shards (``reset_parameters`` of every submodule that has one) on
    ``ctx.device``. Load real weights afterwards
    with ``gt.load_full_state_dict`` or a checkpoint. Layers whose buffers are
    computed in ``__init__`` (not in ``reset_parameters``) get uninitialised buffers.
    """
    with torch.device("meta"):
        yield


def _param_slots(module: nn.Module) -> list[tuple[nn.Module, str, nn.Parameter]]:
    return [
        (m, name, p) for m in module.modules() for name, p in m._parameters.items() if p is not None
    ]


@torch.no_grad()
def materialise(layers: list[nn.Module], device: torch.device) -> dict[int, nn.Parameter]:
    """Allocate meta layers on ``device``, re-tie shared weights, re-run reset_parameters.

    Returns old parameter id -> new parameter (to rebind the optimizer).
    """
    slots = [s for layer in layers for s in _param_slots(layer)]
    for layer in layers:
        layer.to_empty(device=device)
    new_of: dict[int, nn.Parameter] = {}
    for module, name, old in slots:
        new = module._parameters[name]
        if id(old) in new_of:  # a weight tied inside this stage: keep one tensor
            module._parameters[name] = new_of[id(old)]
        else:
            new_of[id(old)] = new
            copy_tags(old, new)
    for layer in layers:
        for t in [*layer.parameters(), *layer.buffers()]:
            t.zero_()  # deterministic where no reset_parameters writes
        for m in layer.modules():
            if hasattr(m, "reset_parameters"):
                m.reset_parameters()  # a sharded layer draws its dense twin and keeps its cut
    return new_of
