"""What each tensor mode's layers send: the collectives of one micro-batch, per planned layer.

Bytes are what ``comm.count_bytes()`` counts for the calling rank: ring
all-reduce ``2(n-1)/n x size``, all-gather ``(n-1) x input``, reduce-scatter
``(n-1) x output``, broadcast / reduce / ring pass ``x size``. Which layer issues
what comes from the engine's plan (each entry's class and style), read off the
forward code of each mode (``communication.py`` has the per-mode summary); each
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

PAIR = {PM.PARALLEL_3D_WEIGHT: PM.PARALLEL_3D_INPUT_X_WEIGHT,
        PM.PARALLEL_3D_OUTPUT: PM.PARALLEL_3D_INPUT_X_OUTPUT}  # fmt: skip
GRID_GROUPS = {
    "2d": (PM.PARALLEL_2D_ROW, PM.PARALLEL_2D_COL, None),
    "2.5d": (PM.PARALLEL_2P5D_ROW, PM.PARALLEL_2P5D_COL, PM.PARALLEL_2P5D_DEP),
}


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

    def add(self, group, op, elements, dtype, what, calls=1.0, fwd=0.0):
        """``fwd``: the share of these bytes sent in the forward pass (recompute repeats it)."""
        n = self._size(group)
        if n > 1 and elements > 0:
            c = Collective(group, op, elements * self.nb[dtype], calls, what, forward=fwd)
            self.out.append(c)

    def _size(self, group) -> int:
        g = self.geo
        if group in (PM.PARALLEL_1D, PM.SEQUENCE):
            return g.size
        if group == PM.PARALLEL_2P5D_DEP:
            return g.depth
        if group in (PM.PARALLEL_3D_INPUT_X_WEIGHT, PM.PARALLEL_3D_INPUT_X_OUTPUT):
            return g.side**2
        return g.side

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
        mode = self.geo.mode
        if not entry.layer or entry.kind == "dropout":
            return
        if mode == "1d":
            self._1d(name, entry)
        elif mode in ("2d", "2.5d"):
            self._2d(name, entry)
        elif mode == "3d":
            self._3d(name, entry)

    def _dims(self, entry: PlanEntry) -> tuple[int, int]:
        """(in, out) features of a Linear, (rows, dim) of an embedding, (hidden, 0) of a norm."""
        dense = entry.shards["weight"][0]
        if entry.kind == "norm":
            return dense[0], 0
        if entry.kind == "embedding":
            return dense[0], dense[1]
        return dense[1], dense[0]  # nn.Linear weight [out, in]

    def _input_dtype(self, name: str) -> str:
        return "r" if name.endswith(("qkv", "fc", "classifier")) else "e"

    def _1d(self, name: str, e: PlanEntry) -> None:
        g, m = PM.PARALLEL_1D, self.m
        if e.layer == "ColumnLinear":
            k, n = self._dims(e)
            self.ar(g, m * k, self._input_dtype(name), f"{name}: input gradient (backward)")
            if e.options.get("gather_output") or e.style in (
                "gather_output",
                "colwise_gather_output",
            ):
                self.ag(g, m * n / self.geo.size, "e", f"{name}: output gather")
        elif e.layer == "RowLinear":
            k, n = self._dims(e)
            self.ar(g, m * n, "e", f"{name}: output (forward)", fwd=1.0)
            if e.style == "rowwise_split_input":
                self.ag(g, m * k / self.geo.size, "e", f"{name}: input gradient gather", fwd=0.0)
        elif e.layer == "VocabParallelEmbedding1D":
            self.ar(g, m * self._dims(e)[1], "w", f"{name}: partial rows (forward)", fwd=1.0)
        elif e.layer == "Embedding1D":
            self.ag(g, m * self._dims(e)[1] / self.geo.size, "w", f"{name}: output gather")

    def _2d(self, name: str, e: PlanEntry) -> None:
        row, col, dep = GRID_GROUPS[self.geo.mode]
        q, t = self.geo.side, self.t
        if e.layer == "Linear":
            k, n = self._dims(e)
            x, w = t * k / q, k * n / q**2
            xd = self._input_dtype(name)
            self.add(row, "broadcast", 2 * q * x, xd, f"{name}: input panels (SUMMA)", fwd=0.5)
            self.add(row, "reduce", q * x, "e", f"{name}: input-gradient partials")
            self.add(col, "broadcast", 2 * q * w, "w", f"{name}: weight panels (SUMMA)", fwd=0.5)
            self.add(col, "reduce", q * w, "e", f"{name}: weight-gradient partials")
            if dep is not None:
                self.ar(dep, w, "w", f"{name}: weight gradient over depth")
            if "bias" in e.shards:
                self._split_param(name, n, "bias", col, dep)
        elif e.layer == "Norm":
            h = self._dims(e)[0]
            stats = 2 if self.spec.norm == "layer" else 1
            self.ar(row, t, "f", f"{name}: statistics (forward and backward)", 2 * stats, 0.5)
            for pname in e.shards:
                self._split_param(name, h, pname, col, dep)
        elif e.layer == "VocabParallelEmbedding":
            v, dim = self._dims(e)
            self.add(col, "all_gather", (q - 1) * t, "i", f"{name}: token ids", fwd=1.0)
            self.rs(col, t * dim / q, "w", f"{name}: partial rows", fwd=1.0)
            self.ag(col, t * dim / q, "e", f"{name}: gradient (backward)", fwd=0.0)
            if dep is not None:
                self.ar(dep, v * dim / q**2, "w", f"{name}: weight gradient over depth")
        elif e.layer == "Embedding":
            v, dim = self._dims(e)
            self.ag(col, v * dim / q**2, "w", f"{name}: weight gather")
            self.rs(col, v * dim / q**2, "w", f"{name}: weight gradient")
            if dep is not None:
                self.ar(dep, v * dim / q**2, "w", f"{name}: weight gradient over depth")
        elif e.layer == "VocabParallelClassifier":
            k, v = self._dims(e)
            w, c = k * v / q**2, t * v / q
            self.add(col, "broadcast", 2 * q * w, "w", f"{name}: weight panels (SUMMA)", fwd=0.5)
            self.add(col, "reduce", q * w, "e", f"{name}: weight-gradient partials")
            self.add(row, "reduce", q * c, "e", f"{name}: logit partials", fwd=1.0)
            self.add(row, "broadcast", 2 * q * c, "e", f"{name}: logit-gradient panels")
            if dep is not None:
                self.ar(dep, w, "w", f"{name}: weight gradient over depth")

    def _split_param(self, name, size, pname, col, dep) -> None:
        """A parameter split over both grid axes, all-gathered down the column when used."""
        q = self.geo.side
        self.ag(col, size / q**2, "w", f"{name}.{pname}: gather")
        self.rs(col, size / q**2, "w", f"{name}.{pname}: gradient")
        if dep is not None:
            self.ar(dep, size / q**2, "w", f"{name}.{pname}: gradient over depth")

    def _3d(self, name: str, e: PlanEntry) -> None:
        d, t = self.geo.side, self.t
        hidden, row = (
            (PM.PARALLEL_3D_WEIGHT, PM.PARALLEL_3D_OUTPUT)
            if e.options.get("orientation", 0) == 0
            or e.layer.startswith(("Vocab", "Embed", "Class"))
            else (PM.PARALLEL_3D_OUTPUT, PM.PARALLEL_3D_WEIGHT)
        )
        inp = PM.PARALLEL_3D_INPUT
        if e.layer in ("Linear", "VocabParallelClassifier"):
            k, n = self._dims(e)
            x, w, y = t * k / d, k * n / d**3, t * n / d
            xd = self._input_dtype(name)
            for group, local, dt, what in ((row, x, xd, "input"), (inp, w, "w", "weight")):
                self.ag(group, local, dt, f"{name}: {what} gather")
                self.rs(group, local, dt, f"{name}: {what} gradient")
            self.rs(hidden, y, "e", f"{name}: output reduce-scatter", fwd=1.0)
            self.ag(hidden, y, "e", f"{name}: output gradient", fwd=0.0)
            if "bias" in e.shards:
                pair = PAIR[hidden]
                self.ag(pair, n / d**3, "w", f"{name}.bias: gather")
                self.rs(pair, n / d**3, "w", f"{name}.bias: gradient")
        elif e.layer == "Norm":
            h = self._dims(e)[0]
            stats = 2 if self.spec.norm == "layer" else 1
            self.ar(hidden, t, "f", f"{name}: statistics (forward and backward)", 2 * stats, 0.5)
            for pname in e.shards:
                self.ag(PAIR[row], h / d**3, "w", f"{name}.{pname}: gather")
                self.rs(PAIR[row], h / d**3, "w", f"{name}.{pname}: gradient")
        elif e.layer == "VocabParallelEmbedding":
            v, dim = self._dims(e)
            self.add(row, "all_gather", (d - 1) * t, "i", f"{name}: token ids", fwd=1.0)
            self.ag(inp, v * dim / d**3, "w", f"{name}: weight gather")
            self.rs(inp, v * dim / d**3, "w", f"{name}: weight gradient")
            self.rs(row, t * dim / d, "w", f"{name}: partial rows", fwd=1.0)
            self.ag(row, t * dim / d, "e", f"{name}: gradient (backward)", fwd=0.0)
        elif e.layer == "Embedding":
            v, dim = self._dims(e)
            self.ag(PAIR[row], v * dim / d**3, "w", f"{name}: weight gather")
            self.rs(PAIR[row], v * dim / d**3, "w", f"{name}: weight gradient")

    # ---- attention and loss ---------------------------------------------------------------
    def ring_attention(self) -> None:
        n, kv = self.geo.size, self.t * self.spec.hidden  # k and v blocks hold every head
        if self.sc.ring == "online":
            self.add(PM.SEQUENCE, "ring_pass", 2 * kv * (n - 1), "e", "ring K/V (forward)", fwd=1)
            self.add(PM.SEQUENCE, "ring_pass", 2 * kv * (n - 1), "e", "ring K/V (backward)")
            self.add(PM.SEQUENCE, "ring_pass", 2 * kv * n, "f", "ring dK/dV accumulators")
        else:
            self.add(PM.SEQUENCE, "ring_pass", 2 * kv * (2 * n - 2), "e", "RingQK / RingAV: K, V",
                     fwd=0.5)  # fmt: skip
            self.add(PM.SEQUENCE, "ring_pass", 2 * kv * n, "e", "RingQK / RingAV: dK, dV")

    def loss(self) -> None:
        mode, t = self.geo.mode, self.t
        if mode == "1d":
            self.ar(PM.PARALLEL_1D, self.m, "f", "vocab-parallel loss: logit max")
            self.ar(PM.PARALLEL_1D, 3 * self.m, "f", "vocab-parallel loss: sums")
        elif mode in ("2d", "2.5d"):
            row, col, dep = GRID_GROUPS[mode]
            self.ar(row, t, "f", "vocab-parallel loss: logit max")
            self.ar(row, 3 * t, "f", "vocab-parallel loss: sums")
            for group in (col, dep):
                if group is not None:
                    self.ar(group, 1, "f", "loss and token count over batch blocks", 2)
        elif mode == "3d":
            self.add(PM.PARALLEL_3D_OUTPUT, "all_gather", (self.geo.side - 1) * t, "i", "labels")
            self.ar(PM.PARALLEL_3D_OUTPUT, t, "f", "vocab-parallel loss: logit max")
            self.ar(PM.PARALLEL_3D_OUTPUT, 3 * t, "f", "vocab-parallel loss: sums")
            self.ar(PM.PARALLEL_3D_INPUT_X_WEIGHT, 1, "f", "loss and token count over rows", 2)
        elif mode == "sequence":
            self.ar(PM.SEQUENCE, 1, "f", "loss over the sequence (forward and backward)", 2)
            self.ar(PM.SEQUENCE, 1, "f", "token count over the sequence")
