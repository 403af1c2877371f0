"""ParallelContext: the rank grid turned into process groups, one object passed around."""

from __future__ import annotations

import contextlib
from datetime import timedelta

import torch
import torch.distributed as dist

from gridtrain.config import Config
from gridtrain.parallel.layout import Layout
from gridtrain.parallel.mode import ParallelMode
from gridtrain.parallel.random import RngStates

_CURRENT: ParallelContext | None = None


class ParallelContext(Layout):
    """This rank's ``Layout`` with a process group per mode, its device and its RNG states.

    Create it through ``gridtrain.launch*``; library code receives it as an
    argument, user-facing layers fall back to ``gridtrain.get_context()``.
    """

    def __init__(self, config: Config, device: torch.device, seed: int):
        if not dist.is_initialized():
            raise RuntimeError("ParallelContext needs torch.distributed to be initialised first")
        super().__init__(config, dist.get_world_size(), dist.get_rank())
        self.device = device
        self.seed = seed
        self._groups = self._new_groups(timedelta(seconds=config.timeout_s))
        self.rng = RngStates(device)

    def _new_groups(self, timeout: timedelta) -> dict[ParallelMode, dist.ProcessGroup]:
        """This rank's process group of every mode. Every rank walks every group in the same
        order (``new_group`` is collective); identical rank lists share one process group;
        ``timeout``: new groups do not inherit WORLD's."""
        made: dict[tuple[int, ...], dist.ProcessGroup] = {}
        world = dist.get_world_size()
        for parts in self.partitions.values():
            for ranks in parts:
                if ranks not in made:
                    made[ranks] = (
                        dist.GroupMember.WORLD
                        if len(ranks) == world
                        else dist.new_group(list(ranks), timeout=timeout)
                    )
        return {mode: made[self.ranks(mode)] for mode in self.partitions}

    def group(self, mode: ParallelMode = ParallelMode.GLOBAL) -> dist.ProcessGroup:
        """The process group of ``mode`` that holds this rank."""
        self.ranks(mode)  # the layout's error for a mode it lacks
        return self._groups[mode]

    # ---- randomness ----------------------------------------------------------------------
    def fork_rng(self, mode: ParallelMode) -> contextlib.AbstractContextManager[None]:
        """A generator distinct per local rank of ``mode`` (same seed on every run)."""
        name = mode.value
        if name not in self.rng:
            offset = 2718 + 1009 * list(ParallelMode).index(mode)
            self.rng.add(name, self.seed + offset + self.local_rank(mode))
        return self.rng.fork(name)

    def __repr__(self) -> str:
        return f"ParallelContext({self._sizes()}, device={self.device})"


def get_context() -> ParallelContext:
    """The context made by the last ``gridtrain.launch*`` call in this process."""
    if _CURRENT is None:
        raise RuntimeError(
            "no parallel context: call gridtrain.launch_from_torch() (or launch) first"
        )
    return _CURRENT


def set_context(ctx: ParallelContext | None) -> None:
    global _CURRENT
    _CURRENT = ctx


def has_context() -> bool:
    return _CURRENT is not None
