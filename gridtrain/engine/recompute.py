"""``activation_checkpoint``: recompute each block's activations in the backward.

Megatron-LM's ``--recompute-granularity full`` and torchtitan's activation checkpointing:
a checkpointed block keeps only its input for the backward and runs its forward again
there, so activation memory falls from all the blocks' intermediates to one block's plus
the block inputs, for about a third more compute. The blocks are ``compile``'s blocks
(the repeated entries of the model's ``ModuleList``/``Sequential``); the block's instance
``forward`` is wrapped, so hooks on the module (ZeRO 3's gathers, gradient sync) stay
outside the recomputed region and tensor-parallel collectives inside it run again in the
backward, as Megatron's do. torch's non-reentrant checkpoint restores the RNG state, so
dropout draws the same masks the second time.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

from torch import nn
from torch.utils.checkpoint import checkpoint

from gridtrain.engine.compile import find_blocks

logger = logging.getLogger("gridtrain")


def _checkpointed(forward):
    @functools.wraps(forward)
    def run(*args: Any, **kwargs: Any) -> Any:
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

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


def apply_activation_checkpoint(model: nn.Module, options: Any, types: set[type]) -> list[str]:
    """Wrap every ``options.every``-th module of a block class (outermost ones) in a
    checkpoint; returns their names."""
    blocks: list[tuple[str, nn.Module]] = []
    for name, module in model.named_modules():
        inside = any(name.startswith(f"{b}.") for b, _ in blocks)
        if type(module) in types and not inside:
            blocks.append((name, module))
    chosen = blocks[:: options.every]
    for _, block in chosen:
        block.forward = _checkpointed(block.forward)
    names = [name for name, _ in chosen]
    logger.info(
        "activation checkpoint: %d of %d blocks, e.g. %s", len(names), len(blocks), names[:3]
    )
    return names
