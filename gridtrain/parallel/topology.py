"""The rank grid as plain lists: every group of every mode, computed without any process.

``global_rank = ((d * P) + p) * T + t``: data outermost, tensor innermost, so a
tensor group is a run of adjacent ranks. The tensor block of each (d, p) is then
reshaped by the tensor mode's geometry (each mode package's torch-free ``geometry.py``,
which the config holds: how its groups cut one block, and the groups across data and
tensor ranks it adds; ``ParallelMode`` names them).
``Layout`` picks one rank's groups from these lists (``ParallelContext`` creates
process groups from them) and ``gridtrain topo`` prints them.
"""

from __future__ import annotations

from itertools import product

from gridtrain.config import Config
from gridtrain.parallel.mode import ParallelMode as PM

Groups = dict[PM, list[tuple[int, ...]]]


def build_groups(config: Config, world_size: int) -> Groups:
    """Every group of every mode for this layout, each a tuple of global ranks in local-rank order."""
    config.check_world_size(world_size)
    P, T = config.pipeline_size, config.tensor_size
    D = world_size // (P * T)
    E = config.moe.expert_parallel_size

    def rank(d: int, p: int, t: int) -> int:
        return (d * P + p) * T + t

    dr, pr, tr = range(D), range(P), range(T)
    groups: Groups = {
        PM.GLOBAL: [tuple(range(world_size))],
        PM.DATA: [tuple(rank(d, p, t) for d in dr) for p, t in product(pr, tr)],
        PM.PIPELINE: [tuple(rank(d, p, t) for p in pr) for d, t in product(dr, tr)],
        PM.TENSOR: [tuple(rank(d, p, t) for t in tr) for d, p in product(dr, pr)],
        PM.MODEL: [tuple(rank(d, p, t) for p, t in product(pr, tr)) for d in dr],
        PM.EXPERT: [
            tuple(rank(g * E + e, p, t) for e in range(E))
            for p, t, g in product(pr, tr, range(D // E))
        ],
        PM.EXPERT_DATA: [
            tuple(rank(g * E + e, p, t) for g in range(D // E))
            for p, t, e in product(pr, tr, range(E))
        ],
    }
    geometry = config.tensor_geometry
    for pmode, blocks in geometry.groups(T, config.parallel.tensor.depth).items():
        groups[pmode] = [
            tuple(rank(d, p, t) for t in block) for d, p in product(dr, pr) for block in blocks
        ]
    groups.update(geometry.extra_groups(rank, (D, P, T, E)))
    return groups


def group_of(groups: list[tuple[int, ...]], global_rank: int) -> tuple[int, ...]:
    """The one group in a mode's partition that holds ``global_rank``."""
    for g in groups:
        if global_rank in g:
            return g
    raise ValueError(f"rank {global_rank} is in no group of this mode")
