"""The rank grid as plain lists: every group of every mode, computed without any process.

``global_rank = ((d * P) + p) * T + t``: data outermost, tensor innermost, so a
tensor group is a run of adjacent ranks. The tensor block of each (d, p) is then
reshaped per mode (see ``ParallelMode`` for the coordinates of each mode).
``Layout`` picks one rank's groups from these lists (``ParallelContext`` creates
process groups from them) and ``gridtrain topo`` prints them.
"""

from __future__ import annotations

import math
from itertools import product

from gridtrain.config import Config
from gridtrain.parallel.mode import ParallelMode as PM

Groups = dict[PM, list[tuple[int, ...]]]


def tensor_block_groups(mode: str | None, size: int, depth: int = 1) -> dict[PM, list[list[int]]]:
    """Groups of tensor ranks 0..size-1 inside one tensor block, per mode-specific axis."""
    t = list(range(size))
    if mode == "1d":
        return {PM.PARALLEL_1D: [t]}
    if mode == "sequence":
        return {PM.SEQUENCE: [t]}
    if mode == "2d":
        q = math.isqrt(size)
        return {
            PM.PARALLEL_2D_ROW: [[r * q + c for c in range(q)] for r in range(q)],
            PM.PARALLEL_2D_COL: [[r * q + c for r in range(q)] for c in range(q)],
        }
    if mode == "2.5d":
        q = math.isqrt(size // depth)

        def at(k: int, r: int, c: int) -> int:
            return k * q * q + r * q + c

        return {
            PM.PARALLEL_2P5D_ROW: [
                [at(k, r, c) for c in range(q)] for k, r in product(range(depth), range(q))
            ],
            PM.PARALLEL_2P5D_COL: [
                [at(k, r, c) for r in range(q)] for k, c in product(range(depth), range(q))
            ],
            PM.PARALLEL_2P5D_DEP: [
                [at(k, r, c) for k in range(depth)] for r, c in product(range(q), range(q))
            ],
            PM.PARALLEL_2P5D_XZ: [
                [at(k, r, c) for k, c in product(range(depth), range(q))] for r in range(q)
            ],
        }
    if mode == "3d":
        d = round(size ** (1 / 3))

        def at3(i: int, j: int, k: int) -> int:
            return k * d * d + j * d + i

        rng = range(d)
        return {
            PM.PARALLEL_3D_INPUT: [[at3(i, j, k) for i in rng] for k, j in product(rng, rng)],
            PM.PARALLEL_3D_WEIGHT: [[at3(i, j, k) for j in rng] for k, i in product(rng, rng)],
            PM.PARALLEL_3D_OUTPUT: [[at3(i, j, k) for k in rng] for j, i in product(rng, rng)],
            PM.PARALLEL_3D_INPUT_X_WEIGHT: [
                [at3(i, j, k) for j, i in product(rng, rng)] for k in rng
            ],
            PM.PARALLEL_3D_OUTPUT_X_WEIGHT: [
                [at3(i, j, k) for k, j in product(rng, rng)] for i in rng
            ],
            PM.PARALLEL_3D_INPUT_X_OUTPUT: [
                [at3(i, j, k) for k, i in product(rng, rng)] for j in rng
            ],
        }
    return {}


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
    mode = config.tensor_mode
    for pmode, blocks in tensor_block_groups(mode, T, config.parallel.tensor.depth).items():
        groups[pmode] = [
            tuple(rank(d, p, t) for t in block) for d, p in product(dr, pr) for block in blocks
        ]
    if mode == "sequence":
        # all ranks of one pipeline stage, across data and sequence
        groups[PM.SEQUENCE_DP] = [tuple(rank(d, p, t) for d, t in product(dr, tr)) for p in pr]
    return groups


def group_of(groups: list[tuple[int, ...]], global_rank: int) -> tuple[int, ...]:
    """The one group in a mode's partition that holds ``global_rank``."""
    for g in groups:
        if global_rank in g:
            return g
    raise ValueError(f"rank {global_rank} is in no group of this mode")
