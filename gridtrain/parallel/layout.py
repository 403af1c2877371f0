"""One rank's place in the rank grid, with no process: its group of every mode, and sizes.

``Layout`` answers every question about ranks (``ranks``, ``world_size``, ``local_rank``,
``is_first_rank`` ...) from ``topology.build_groups``'s lists. ``ParallelContext`` is a
layout that also holds a process group per mode, a device and RNG states. The layout alone
is what needs no process: ``gridtrain topo`` prints one, and ``gridtrain estimate`` plans
models on one, since the planner and the layer constructors ask only for sizes and ranks
(the forward passes need the groups). Any world size, thousands of ranks included, on one
CPU.
"""

from __future__ import annotations

from gridtrain.config import Config
from gridtrain.config.tensor import ModeGeometry
from gridtrain.parallel.mode import ParallelMode
from gridtrain.parallel.topology import Groups, build_groups, group_of


class Layout:
    """Rank ``global_rank`` of a world of ``world_size`` ranks under ``config``.

    ``partitions``: every group of every mode of the layout (each mode's groups cover the
    world once), in the order every rank creates their process groups.
    """

    def __init__(self, config: Config, world_size: int, global_rank: int = 0):
        self.partitions: Groups = build_groups(config, world_size)  # checks the world size
        if not 0 <= global_rank < world_size:
            raise ValueError(f"rank must be in [0, {world_size}), got {global_rank}")
        self.config = config
        self.global_rank = global_rank
        self._ranks = {
            mode: group_of(parts, global_rank) for mode, parts in self.partitions.items()
        }

    @property
    def tensor_mode(self) -> str | None:
        """The config's ``parallel.tensor.mode``: a registered mode's name, or None."""
        return self.config.tensor_mode

    @property
    def tensor_geometry(self) -> ModeGeometry:
        """The tensor mode's torch-free geometry (``gridtrain.parallel.tensor.geometry``)."""
        return self.config.tensor_geometry

    @property
    def coordinates(self) -> tuple[int, int, int]:
        """(data, pipeline, tensor) index of this rank: ``global_rank = ((d * P) + p) * T + t``."""
        P, T = self.pipeline_parallel_size, self.tensor_parallel_size
        r = self.global_rank
        return r // (P * T), (r // T) % P, r % T

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

    def group(self, mode: ParallelMode = ParallelMode.GLOBAL):
        """A layout has no process groups (``ParallelContext`` has)."""
        raise RuntimeError(
            f"a Layout has no process groups (asked for {mode.name}): it serves what needs "
            "only sizes and ranks, such as building layers; launch for a ParallelContext"
        )

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

    def _sizes(self) -> str:
        return (
            f"rank={self.global_rank}, data={self.data_parallel_size}, "
            f"pipeline={self.pipeline_parallel_size}, tensor={self.tensor_parallel_size} "
            f"({self.tensor_mode})"
        )

    def __repr__(self) -> str:
        return f"Layout({self._sizes()})"
