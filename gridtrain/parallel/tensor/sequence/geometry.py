"""Sequence parallelism's geometry (``tensor/geometry.py``): one group, SEQUENCE, over the
tensor block, each rank holding consecutive positions of the batch, every weight whole.

A weight's copies on the sequence ranks of all data ranks average their gradients together
(SEQUENCE_DP: data x sequence ranks of one pipeline stage), and experts likewise: a data
rank's sequence ranks route other tokens to the same experts, so EXPERT_DATA spans them.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import product
from typing import Any

from gridtrain.parallel.mode import ParallelMode as PM
from gridtrain.parallel.tensor.geometry import BlockGroups, Groups, ModeGeometry, Rank, Sizes
from gridtrain.parallel.tensor.sequence import costs


@dataclass(frozen=True)
class SequenceGeometry(ModeGeometry):
    name: str | None = "sequence"
    runtime: str = "gridtrain.parallel.tensor.sequence.runtime:MODE"
    data_parallel: PM = PM.SEQUENCE_DP
    splits_sequence: bool = True

    def groups(self, size: int, depth: int) -> BlockGroups:
        return {PM.SEQUENCE: [list(range(size))]}

    def extra_groups(self, rank: Rank, sizes: Sizes) -> Groups:
        D, P, T, E = sizes
        dr, pr, tr = range(D), range(P), range(T)
        return {
            PM.SEQUENCE_DP: [tuple(rank(d, p, t) for d, t in product(dr, tr)) for p in pr],
            PM.EXPERT_DATA: [
                tuple(rank(g * E + e, p, t) for g, t in product(range(D // E), tr))
                for p, e in product(pr, range(E))
            ],
        }

    def sequence_split(self, size: int, depth: int) -> tuple[int, str]:
        return size, f"SEQUENCE ({size} ranks)"

    def data_parallel_span(self, size: int) -> int:
        return size  # SEQUENCE_DP: data x sequence

    def fits(self, size: int, heads: int, seq_len: int) -> tuple[int, ...]:
        return (1,) if seq_len % size == 0 else ()

    def attention_items(self, g: Any, sc: Any, spec: Any, t: float, heads: float, nb: dict):
        return costs.attention_items(g, sc, spec, t, heads, nb) if g.size > 1 else None

    def attention_collectives(self, c: Any) -> None:
        costs.attention(c)

    def loss_collectives(self, c: Any) -> None:
        costs.loss(c)


GEOMETRY = SequenceGeometry()
