"""``activation_checkpoint``: recompute each block's activations in the backward.

Megatron-LM's ``--recompute-granularity full`` and torchtitan's activation checkpointing:
a checkpointed block keeps only its input for the backward and runs its forward again
there, so activation memory falls from all the blocks' intermediates to one block's plus
the block inputs, for about a third more compute. The blocks are ``compile``'s blocks
(the repeated entries of the model's ``ModuleList``/``Sequential``); the block's instance
``forward`` is wrapped, so hooks on the module (ZeRO 3's gathers, gradient sync) stay
outside the recomputed region and tensor-parallel collectives inside it run again in the
backward, as Megatron's do. The recompute must replay the forward exactly and leave no
trace: torch's checkpoint restores the default generator; here the context's named RNG
streams (sharded dropout, ring attention, the noisy MoE router) are rewound to where the
forward found them and put back afterwards (Megatron's RNG tracker does the same),
BatchNorm running statistics and MoE load records are not updated a second time,
under sequence parallelism SDPA is routed to ring attention as in the forward, and SDPA
picks the forward's kernel (the ``attention`` preference, cuDNN first on Hopper by default,
is the engine's forward context, gone in the backward; another kernel saves tensors of other
shapes, which torch's checkpoint refuses).
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from gridtrain.engine.compile import find_blocks
from gridtrain.engine.sdpa import replay_kernels
from gridtrain.parallel.random import recompute_region
from gridtrain.parallel.tensor.sequence import replay_route

logger = logging.getLogger("gridtrain")


@contextlib.contextmanager
def _replay(rng, saved: dict | None, buffers: list[torch.Tensor]) -> Iterator[None]:
    """Around a recompute: the named RNG streams as the forward found them, the block's
    BatchNorm statistics as they are now (restored after), the recompute flag raised."""
    now = rng.state_dict() if rng is not None else None
    if rng is not None:
        rng.load_state_dict(saved)
    kept = [b.clone() for b in buffers]
    try:
        with recompute_region():
            yield
    finally:
        with torch.no_grad():
            for b, k in zip(buffers, kept, strict=True):
                b.copy_(k)
        if rng is not None:
            rng.load_state_dict(now)


def _checkpointed(block: nn.Module, rng):
    forward = block.forward
    buffers = [
        b
        for m in block.modules()
        if isinstance(m, nn.modules.batchnorm._NormBase)
        for b in m.buffers(recurse=False)
        if b is not None
    ]

    @functools.wraps(forward)
    def run(*args: Any, **kwargs: Any) -> Any:
        saved = rng.state_dict() if rng is not None else None  # as the forward finds them
        route = replay_route()  # sequence: SDPA as ring attention, in the recompute too
        calls, kernels = [0], []

        def body(*a: Any, **k: Any) -> Any:  # checkpoint calls it for the forward, then
            calls[0] += 1  # again for the backward's recompute
            if calls[0] == 1:  # read here: checkpoint runs eagerly (dynamo-disabled)
                kernels.append(replay_kernels())
                return forward(*a, **k)
            with _replay(rng, saved, buffers), route(), kernels[0]():
                return forward(*a, **k)

        return checkpoint(body, *args, use_reentrant=False, **kwargs)

    return run


def block_types(model: nn.Module) -> set[type]:
    """The classes of ``model``'s blocks, found on the whole model (a pipeline stage may
    hold a single block, which alone does not look repeated)."""
    blocks = find_blocks(model)
    if not blocks:
        raise ValueError(
            f"activation_checkpoint: {type(model).__name__} has no block list (a ModuleList or "
            "Sequential holding the same block class at least twice) to checkpoint; remove "
            "the activation_checkpoint key or build the model's layers as such a list"
        )
    return {type(m) for _, m in blocks}


def apply_activation_checkpoint(
    model: nn.Module, options: Any, types: set[type], rng=None
) -> list[str]:
    """Wrap every ``options.every``-th module of a block class (outermost ones) in a
    checkpoint; returns their names. ``rng``: the context's named streams (``ctx.rng``)."""
    blocks: list[tuple[str, nn.Module]] = []
    for name, module in model.named_modules():
        inside = any(name.startswith(f"{b}.") for b, _ in blocks)
        if type(module) in types and not inside:
            blocks.append((name, module))
    chosen = blocks[:: options.every]
    for _, block in chosen:
        block.forward = _checkpointed(block, rng)
    names = [name for name, _ in chosen]
    logger.info(
        "activation checkpoint: %d of %d blocks, e.g. %s", len(names), len(blocks), names[:3]
    )
    return names
