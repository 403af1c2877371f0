"""Named RNG states, so dropout inside tensor-parallel regions draws the masks each mode needs,
and the flag that tells a forward replayed for the backward from the first one.

The default torch generator is seeded identically on every rank, so replicated
activations get identical dropout masks across a tensor group. Where activations
are sharded, a layer forks a state seeded by its rank in that group, so each
shard draws a distinct mask. CPU and CUDA generators alike.

Activation checkpointing (``engine/recompute.py``) runs a block's forward again in the
backward, with these states rewound; inside that replay ``recomputing()`` is true, so a
layer that records statistics (MoE load) records them once.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator

import numpy as np
import torch

_RECOMPUTING = [0]  # depth of recompute regions now running (a list: mutable module state)


def recomputing() -> bool:
    """Whether a checkpointed block is replaying its forward for the backward."""
    return _RECOMPUTING[0] > 0


@contextlib.contextmanager
def recompute_region() -> Iterator[None]:
    """Mark the block: ``recomputing()`` is true inside it."""
    _RECOMPUTING[0] += 1
    try:
        yield
    finally:
        _RECOMPUTING[0] -= 1


def seed_everything(seed: int) -> None:
    """Seed python, numpy and torch (CPU and every CUDA device)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)  # also seeds every CUDA device


class RngStates:
    """A set of named generator states on one device; ``fork(name)`` swaps one in."""

    def __init__(self, device: torch.device):
        self.device = device
        self._states: dict[str, torch.Tensor] = {}

    def _get(self) -> torch.Tensor:
        if self.device.type == "cuda":
            return torch.cuda.get_rng_state(self.device)
        return torch.get_rng_state()

    def _set(self, state: torch.Tensor) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_rng_state(state, self.device)
        else:
            torch.set_rng_state(state)

    def add(self, name: str, seed: int) -> None:
        """Create state ``name`` from ``seed`` without disturbing the current generator."""
        if name in self._states:
            raise ValueError(f"RNG state '{name}' already exists")
        saved = self._get()
        if self.device.type == "cuda":
            torch.cuda.manual_seed(seed)
        else:
            torch.manual_seed(seed)
        self._states[name] = self._get()
        self._set(saved)

    def __contains__(self, name: str) -> bool:
        return name in self._states

    @contextlib.contextmanager
    def fork(self, name: str) -> Iterator[None]:
        """Draw from state ``name`` inside the block; the default state is untouched."""
        if name not in self._states:
            raise KeyError(f"RNG state '{name}' does not exist (have: {sorted(self._states)})")
        saved = self._get()
        self._set(self._states[name])
        try:
            yield
        finally:
            self._states[name] = self._get()
            self._set(saved)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v.clone() for k, v in self._states.items()}

    def load_state_dict(self, states: dict[str, torch.Tensor]) -> None:
        self._states = {k: v.clone() for k, v in states.items()}
