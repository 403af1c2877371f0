"""ParallelContext: the rank grid turned into process groups, one object passed around."""

from __future__ import annotations

import contextlib
from datetime import timedelta

import torch
import torch.distributed as dist

from gridtrain.config import Config
from gridtrain.parallel.mode import ParallelMode
from gridtrain.parallel.random import RngStates
from gridtrain.parallel.topology import build_groups

_CURRENT: ParallelContext | None = None


class ParallelContext:
    """Every process group of this rank, built from one grid (see ``topology.build_groups``).

    Create it through ``gridtrain.launch*``; library code receives it as an
    argument, user-facing layers fall back to ``gridtrain.get_context()``.
    """

    def __init__(self, config: Config, device: torch.device, seed: int):
        if not dist.is_initialized():
            raise RuntimeError("ParallelContext needs torch.distributed to be initialised first")
        self.config = config
        self.device = device
        self.seed = seed
        self.global_rank = dist.get_rank()
        self._ranks: dict[ParallelMode, tuple[int, ...]] = {}
        self._groups: dict[ParallelMode, dist.ProcessGroup] = {}
        made: dict[tuple[int, ...], dist.ProcessGroup] = {}
        timeout = timedelta(seconds=config.timeout_s)  # new_group does not inherit WORLD's
        # Every rank walks every group in the same order (new_group is collective);
        # identical rank lists share one process group.
        for mode, parts in build_groups(config, dist.get_world_size()).items():
            for ranks in parts:
                if ranks not in made:
                    made[ranks] = (
                        dist.GroupMember.WORLD
                        if len(ranks) == dist.get_world_size()
                        else dist.new_group(list(ranks), timeout=timeout)
                    )
                if self.global_rank in ranks:
                    self._ranks[mode] = ranks
                    self._groups[mode] = made[ranks]
        self.rng = RngStates(device)

    # ---- queries -------------------------------------------------------------------------
    @property
    def tensor_mode(self) -> str | None:
        """None, "1d", "2d", "2.5d", "3d" or "sequence"."""
        return self.config.tensor_mode

    def is_initialized(self, mode: ParallelMode) -> bool:
        """Whether this layout has ``mode`` (e.g. 2D groups exist only under tensor mode 2d)."""
        return mode in self._ranks

    def ranks(self, mode: ParallelMode = ParallelMode.GLOBAL) -> tuple[int, ...]:
        """Global ranks of this rank's group of ``mode``, in local-rank order."""
        try:
            return self._ranks[mode]
        except KeyError:
            raise ValueError(
                f"parallel mode {mode.name} does not exist in this layout "
                f"(tensor mode {self.tensor_mode!r}; have {', '.join(m.name for m in self._ranks)})"
            ) from None

    def group(self, mode: ParallelMode = ParallelMode.GLOBAL) -> dist.ProcessGroup:
        """The process group of ``mode`` that holds this rank."""
        self.ranks(mode)
        return self._groups[mode]

    def world_size(self, mode: ParallelMode = ParallelMode.GLOBAL) -> int:
        return len(self.ranks(mode))

    def local_rank(self, mode: ParallelMode = ParallelMode.GLOBAL) -> int:
        return self.ranks(mode).index(self.global_rank)

    def is_first_rank(self, mode: ParallelMode = ParallelMode.GLOBAL) -> bool:
        return self.local_rank(mode) == 0

    def is_last_rank(self, mode: ParallelMode = ParallelMode.GLOBAL) -> bool:
        return self.local_rank(mode) == self.world_size(mode) - 1

    def next_global_rank(self, mode: ParallelMode = ParallelMode.PIPELINE) -> int:
        """Global rank of the next member of this rank's group (wrapping round)."""
        ranks = self.ranks(mode)
        return ranks[(ranks.index(self.global_rank) + 1) % len(ranks)]

    def prev_global_rank(self, mode: ParallelMode = ParallelMode.PIPELINE) -> int:
        """Global rank of the previous member of this rank's group (wrapping round)."""
        ranks = self.ranks(mode)
        return ranks[(ranks.index(self.global_rank) - 1) % len(ranks)]

    @property
    def data_parallel_size(self) -> int:
        return self.world_size(ParallelMode.DATA)

    @property
    def pipeline_parallel_size(self) -> int:
        return self.world_size(ParallelMode.PIPELINE)

    @property
    def tensor_parallel_size(self) -> int:
        return self.world_size(ParallelMode.TENSOR)

    # ---- randomness ----------------------------------------------------------------------
    def fork_rng(self, mode: ParallelMode) -> contextlib.AbstractContextManager[None]:
        """A generator distinct per local rank of ``mode`` (same seed on every run)."""
        name = mode.value
        if name not in self.rng:
            offset = 2718 + 1009 * list(ParallelMode).index(mode)
            self.rng.add(name, self.seed + offset + self.local_rank(mode))
        return self.rng.fork(name)

    def __repr__(self) -> str:
        return (
            f"ParallelContext(rank={self.global_rank}, data={self.data_parallel_size}, "
            f"pipeline={self.pipeline_parallel_size}, tensor={self.tensor_parallel_size} "
            f"({self.tensor_mode}), device={self.device})"
        )


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
