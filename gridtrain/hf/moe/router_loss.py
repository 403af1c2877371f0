"""A family's router loss over the global batch, as one process computes it.

With ``output_router_logits`` a ``transformers`` MoE causal LM returns ``aux_loss``, its
load-balancing loss (Switch eq. 4: tokens per expert times mean router probability), and
adds ``router_aux_loss_coef * aux_loss`` to ``loss`` when given labels. The loss is a
product of two means over the batch, so the mean over data-parallel ranks of each rank's
own is not the global batch's. A forward hook on the model recomputes it with the
family's own function (``families.RouterLoss``) on every rank's router logits and
attention mask, gathered over the data-parallel group (DATA; SEQUENCE_DP under sequence
parallelism, whose ranks hold other tokens of the same rows), and puts it in ``aux_loss``
and ``loss``.

Gradients: every rank computes the same global loss, and the gather's backward is a
reduce-scatter (sum), so each rank's router logits get the gradient of all ranks' copies
of it: ``D`` times their share; the data-parallel average of the router's weight gradient
(``1/D``) then leaves exactly the global loss's gradient.
"""

from __future__ import annotations

import inspect
import logging
import sys

import torch
from torch import Tensor, nn

from gridtrain.hf.moe.families import MoeFamily, RouterLoss
from gridtrain.parallel import comm
from gridtrain.parallel.context import ParallelContext
from gridtrain.parallel.tags import default_dp_mode

logger = logging.getLogger("gridtrain")


def install_router_loss(model: nn.Module, family: MoeFamily | None, ctx: ParallelContext) -> None:
    """Make ``model``'s router loss the global batch's (a no-op without data parallelism)."""
    mode = default_dp_mode(ctx)
    if ctx.world_size(mode) == 1:
        return
    loss = family.router_loss if family is not None else None
    model.register_forward_hook(_hook(loss, ctx.group(mode)), with_kwargs=True)


def _hook(loss: RouterLoss | None, group):
    def hook(module: nn.Module, args: tuple, kwargs: dict, output):
        local = getattr(output, "aux_loss", None)
        logits = getattr(output, "router_logits", None)
        if local is None or not logits or logits[0].is_meta:  # the planner's trace runs on meta
            return None
        if loss is None:
            _warn_local(module)
            return None
        mask = _argument(module, args, kwargs, "attention_mask")
        aux = global_aux_loss(module, loss, tuple(logits), mask, group)
        if getattr(output, "loss", None) is not None:
            coef = getattr(module, loss.coef)
            output.loss = output.loss + coef * (aux - local).to(output.loss.dtype)
        output.aux_loss = aux
        return output

    return hook


def global_aux_loss(
    model: nn.Module, loss: RouterLoss, logits: tuple[Tensor, ...], mask: Tensor | None, group
) -> Tensor:
    """The family's loss on the router logits (and padding mask) of every rank of ``group``."""
    rows = logits[0].shape[0]
    sizes = comm.all_gather(torch.tensor([rows], device=logits[0].device), 0, group).tolist()
    if len(set(sizes)) > 1:
        raise ValueError(
            f"the global router loss needs as many tokens on every data-parallel rank; got {sizes}"
        )
    gathered = comm.all_gather(torch.stack(logits), 1, group).unbind(0)  # [layers, rows, E]
    if mask is not None:
        mask = comm.all_gather(mask.reshape(-1), 0, group)
    function = getattr(_modeling_module(model), loss.function)
    return function(gathered, getattr(model, loss.num_experts), getattr(model, loss.top_k), mask)


def _modeling_module(model: nn.Module):
    """The ``transformers`` module that defines ``model``'s class (ZeRO 3 swaps in a subclass)."""
    for cls in type(model).__mro__:
        if cls.__module__.startswith("transformers."):
            return sys.modules[cls.__module__]
    raise TypeError(f"{type(model).__name__} is no transformers model")


def _argument(module: nn.Module, args: tuple, kwargs: dict, name: str):
    if name in kwargs:
        return kwargs[name]
    try:
        bound = inspect.signature(module.forward).bind_partial(*args)
    except TypeError:
        return None
    return bound.arguments.get(name)


_WARNED: set[str] = set()


def _warn_local(module: nn.Module) -> None:
    name = type(module).__name__
    if name not in _WARNED:
        _WARNED.add(name)
        logger.warning(
            "%s: gridtrain has no router-loss entry for this family (gridtrain/hf/moe/"
            "families.py); its aux_loss is each data-parallel rank's own batch's",
            name,
        )
