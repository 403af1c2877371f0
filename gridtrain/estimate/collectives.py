"""What each tensor mode's layers send: the collectives of one micro-batch, per planned layer.

Bytes are what ``comm.count_bytes()`` counts for the calling rank: ring
all-reduce ``2(n-1)/n x size``, all-gather ``(n-1) x input``, reduce-scatter
``(n-1) x output``, broadcast / reduce / ring pass ``x size``. Which layer issues
what comes from the engine's plan (each entry's class and style), by each mode's formulas
read off its forward code (``parallel/tensor/<mode>/costs.py``, through the mode's geometry;
``communication.py`` has the per-mode summary); each
item also says which share of its bytes the forward pass sends, which full
recompute sends again.
"""

from __future__ import annotations

import dataclasses

from gridtrain.estimate.geometry import Geometry
from gridtrain.estimate.memory import dtype_bytes
from gridtrain.estimate.models import ModelSpec
from gridtrain.estimate.scenario import Scenario
from gridtrain.parallel.mode import ParallelMode as PM
from gridtrain.parallel.tensor.plan import PlanEntry


@dataclasses.dataclass(frozen=True)
class Collective:
    """``calls`` calls per step, each sending ``bytes`` from this rank, over ``group``."""

    group: PM | str
    op: str  # comm.py's name: all_reduce, all_gather, reduce_scatter, broadcast, reduce, ring_pass
    bytes: float
    calls: float
    what: str
    # "micro": once per micro-batch on the critical path (tensor groups, send/recv);
    # "backward": overlaps the last backward (bucketed gradient all-reduce, ZeRO reduce-scatter);
    # "prefetch": overlaps compute (ZeRO-3 weight gathers); "step": after backward, exposed
    phase: str = "micro"
    counted: bool = True
    forward: float = 0.0  # share of the bytes sent in the forward pass (recompute repeats it)  # seen by comm.count_bytes (ZeRO and send/recv use torch directly)

    @property
    def total(self) -> float:
        return self.bytes * self.calls

    @property
    def group_name(self) -> str:
        return self.group.name if isinstance(self.group, PM) else self.group

    def scaled(self, calls: float) -> Collective:
        return Collective(self.group, self.op, self.bytes, self.calls * calls, self.what,
                          self.phase, self.counted, self.forward)  # fmt: skip


def all_reduce(n: int, elements: float) -> float:
    return 2 * (n - 1) / n * elements if n > 1 else 0.0


class LayerCollectives:
    """Collectives of one micro-batch through the planned layers of one tensor mode."""

    def __init__(self, spec: ModelSpec, geo: Geometry, sc: Scenario, tokens: int):
        self.spec, self.geo, self.sc = spec, geo, sc
        self.m = tokens  # the data-parallel rank's tokens in one micro-batch
        self.t = geo.tokens(tokens)  # one rank's rows of an activation block
        self.nb = dtype_bytes(sc.amp)
        self.out: list[Collective] = []
        groups = geo.rules.groups(geo.size, geo.depth)  # the mode's own groups of one block
        self.sizes = {group: len(ranks[0]) for group, ranks in groups.items()}

    def add(self, group, op, elements, dtype, what, calls=1.0, fwd=0.0):
        """``fwd``: the share of these bytes sent in the forward pass (recompute repeats it)."""
        n = self._size(group)
        if n > 1 and elements > 0:
            c = Collective(group, op, elements * self.nb[dtype], calls, what, forward=fwd)
            self.out.append(c)

    def _size(self, group) -> int:
        return self.sizes[group]

    def ar(self, group, elements, dtype, what, calls=1.0, fwd=0.0):
        n = self._size(group)
        self.add(group, "all_reduce", all_reduce(n, elements), dtype, what, calls, fwd)

    def ag(self, group, local, dtype, what, calls=1.0, fwd=1.0):  # all-gather of ``local``
        self.add(group, "all_gather", (self._size(group) - 1) * local, dtype, what, calls, fwd)

    def rs(self, group, output, dtype, what, calls=1.0, fwd=0.0):  # reduce-scatter to ``output``
        n = self._size(group)
        self.add(group, "reduce_scatter", (n - 1) * output, dtype, what, calls, fwd)

    # ---- per layer ----------------------------------------------------------------------
    def layer(self, name: str, entry: PlanEntry) -> None:
        """What planned layer ``entry`` sends: its mode's formulas (``<mode>/costs.py``)."""
        if not entry.layer or entry.kind == "dropout":
            return
        self.geo.rules.layer_collectives(self, name, entry)

    def dims(self, entry: PlanEntry) -> tuple[int, int]:
        """(in, out) features of a Linear, (rows, dim) of an embedding, (hidden, 0) of a norm."""
        dense = entry.shards["weight"][0]
        if entry.kind == "norm":
            return dense[0], 0
        if entry.kind == "embedding":
            return dense[0], dense[1]
        return dense[1], dense[0]  # nn.Linear weight [out, in]

    def input_dtype(self, name: str) -> str:
        return "r" if name.endswith(("qkv", "fc", "classifier")) else "e"

    # ---- attention and loss ---------------------------------------------------------------
    def attention(self) -> None:
        """What a block's attention sends beyond its planned layers (sequence: the ring)."""
        self.geo.rules.attention_collectives(self)

    def loss(self) -> None:
        self.geo.rules.loss_collectives(self)
