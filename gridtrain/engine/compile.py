"""``compile``: torch.compile applied per repeated block, as torchtitan does.

Compiling the whole model would put every tensor-parallel collective, pipeline
send and ZeRO gather into one graph (or break it at each). Compiling each entry of
the model's repeated block list (``transformer.h``, ``model.layers``, ``blocks``)
keeps those graphs small and identical, so one compilation serves every block,
and the code between blocks (embeddings, head, loss, pipeline p2p) stays eager.
Only a block's ``forward`` is compiled: module hooks (ZeRO-3's FSDP2 gathers,
gradient sync, BatchNorm broadcast) run eagerly around it. A model without a
block list is compiled whole.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

logger = logging.getLogger("gridtrain")


def find_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The repeated blocks of ``model``: the entries of each ``nn.ModuleList`` whose
    entries share one class (the outermost such lists; nested lists stay inside)."""
    blocks: list[tuple[str, nn.Module]] = []
    taken: list[str] = []
    for name, module in model.named_modules():
        if any(name.startswith(t + ".") for t in taken):
            continue
        if isinstance(module, nn.ModuleList) and len(module) > 1:
            kinds = {type(m) for m in module}
            if len(kinds) == 1:
                taken.append(name)
                blocks += [(f"{name}.{i}" if name else str(i), m) for i, m in enumerate(module)]
    return blocks


def compile_model(model: nn.Module, options: Any) -> list[str]:
    """Compile ``model`` in place per the ``compile`` config section; returns the names
    of the compiled modules ('' is the whole model). State-dict keys do not change."""
    kwargs = dict(
        backend=options.backend,
        mode=options.mode,
        fullgraph=options.fullgraph,
        dynamic=options.dynamic,
    )
    blocks = find_blocks(model) if options.per_block else []
    if not blocks:
        blocks = [("", model)]
    for _, module in blocks:
        # the instance's forward, not module.compile(): hooks stay outside the graph
        module.forward = torch.compile(module.forward, **kwargs)
    names = [name for name, _ in blocks]
    logger.info("compiled %d module(s) with %s: %s", len(names), options.backend, names[:4])
    return names
