"""Bytes each rank sends per step, per group and collective, read off each mode's forward code.

Bytes are what ``comm.count_bytes()`` counts for the calling rank: ring
all-reduce ``2(n-1)/n x size``, all-gather ``(n-1) x input``, reduce-scatter
``(n-1) x output``, broadcast / reduce / ring pass ``x size``. Which layers
issue what comes from the engine's plan (each entry's class and style), per micro-batch,
forward + backward; ``M`` tokens of the data-parallel rank, ``t`` tokens of one
rank's activation block (``geometry.py``):

* 1d (``mode_1d``): ``ColumnLinear`` all-reduces its input gradient ``[M, in]``
  backward (Megatron's f), ``RowLinear`` its output ``[M, out]`` forward (g);
  ``VocabParallelEmbedding1D`` all-reduces ``[M, dim]``; the vocab-parallel loss
  all-reduces a max and three sums per token (fp32).
* 2d / 2.5d (``mode_2d/grid.py``): a SUMMA Linear broadcasts ``q`` panels of the
  input along the row group and of the weight down the column group forward, and
  backward does ``A B^T`` (weight panels, input-sized reduces along rows) and
  ``A^T B`` (input panels, weight-sized reduces down columns): ``3q (|x| + |w|)``;
  split biases and norm weights are all-gathered down the column (reduce-scattered
  back); norms all-reduce one (RMS) or two (LayerNorm) statistics per row, forward
  and backward; 2.5d all-reduces weight gradients over depth.
* 3d (``mode_3d/cube.py``): a Linear all-gathers its input over the row axis and its
  weight over INPUT and reduce-scatters its output over the hidden axis, each
  mirrored backward: ``2(d-1)(|x| + |w| + |y|)``; the axes swap with each layer's
  orientation (the plan's).
* sequence (``sequence/ring_attention.py``): K and V blocks pass round the ring
  ``n-1`` times forward and again backward, and their gradient accumulators ``n``
  times; 'online' passes stacked K/V and fp32 gradient accumulators.
* per step: gradients all-reduced over DATA (SEQUENCE_DP) in 25 MiB buckets, or
  ZeRO's reduce-scatter + all-gather (stage 3: parameters all-gathered forward and
  backward per micro-batch); tied embedding/head gradients summed by the first and
  last stage; the loss broadcast over PIPELINE; the overflow / non-finite flag and
  the clipping norm all-reduced over GLOBAL (MODEL under torch amp).
* pipeline activations and their gradients go point to point (``send_recv``; not
  counted by ``comm.count_bytes``, which sees collectives only).
"""

from __future__ import annotations

import dataclasses
import math

from gridtrain.estimate.geometry import Geometry
from gridtrain.estimate.layout import TensorShards
from gridtrain.estimate.memory import dtype_bytes
from gridtrain.estimate.models import ModelSpec
from gridtrain.estimate.scenario import Scenario, StageLayers
from gridtrain.parallel.mode import ParallelMode as PM
from gridtrain.parallel.tensor.plan import PlanEntry

BUCKET_BYTES = 25 * 2**20  # gradient_handlers/buckets.py DEFAULT_BUCKET_MB
FIRST_LAST = "PIPELINE (first, last)"
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


class _Layers:
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


def microbatch_collectives(
    spec: ModelSpec, geo: Geometry, sc: Scenario, stage: StageLayers, shards: TensorShards
) -> list[Collective]:
    """Tensor-parallel collectives of one micro-batch through ``stage`` (forward + backward)."""
    key = (spec, geo, sc.amp, sc.ring, sc.recompute, sc.micro_batch, stage.embed, stage.blocks,
           stage.head)  # fmt: skip
    if key not in _MICRO:
        _MICRO[key] = _microbatch(spec, geo, sc, stage, shards)
    return _MICRO[key]


_MICRO: dict[tuple, list[Collective]] = {}  # the same layers and shapes give the same list


def _microbatch(spec, geo, sc, stage, shards) -> list[Collective]:
    tokens = sc.micro_batch * spec.seq_len
    entries = shards.plan.entries
    parts = []
    if stage.embed:
        parts.append(("embed.", 1))
    if stage.blocks:
        parts.append(("h0.", stage.blocks))
    if stage.head:
        parts.append(("head.", 1))
    out: list[Collective] = []
    for prefix, times in parts:
        layers = _Layers(spec, geo, sc, tokens)
        for name, entry in entries.items():
            if name.startswith(prefix):
                layers.layer(name.replace("h0.", "block."), entry)
        if prefix == "h0." and geo.mode == "sequence" and geo.size > 1:
            layers.ring_attention()
        if prefix == "head.":
            layers.loss()
        redo = prefix == "h0." and sc.recompute == "full"  # backward re-runs each block forward
        out += [c.scaled(times * (1 + c.forward if redo else 1)) for c in layers.out]
    return out


def step_collectives(
    spec: ModelSpec,
    geo: Geometry,
    sc: Scenario,
    stage: StageLayers,
    shards: TensorShards,
    sizes: dict,
) -> list[Collective]:
    """Every collective one rank of ``stage`` issues in one optimizer step (``sizes``: group ->
    ranks, for the groups the step touches outside the tensor group)."""
    micro = microbatch_collectives(spec, geo, sc, stage, shards)
    out = [c.scaled(sc.micro_batches) for c in micro]
    return out + step_only_collectives(spec, geo, sc, stage, shards, sizes)


def step_only_collectives(spec, geo, sc: Scenario, stage: StageLayers, shards, sizes: dict):
    """The collectives of a step that are not a micro-batch's tensor-parallel ones."""
    out: list[Collective] = []
    nb = dtype_bytes(sc.amp)
    grad_bytes = stage.params(shards) * nb["w"]
    dp_group = PM.SEQUENCE_DP if sc.mode == "sequence" else PM.DATA
    n = sizes[dp_group]
    if n > 1 and sc.zero == 0:
        buckets = max(1, math.ceil(grad_bytes / BUCKET_BYTES))
        out.append(Collective(dp_group, "all_reduce", all_reduce(n, grad_bytes) / buckets,
                              buckets, "gradients (bucketed, overlaps backward)", "backward"))  # fmt: skip
    elif n > 1:
        out += _zero_collectives(sc, stage, shards, dp_group, n)
    p = sc.pipeline
    if p > 1:
        if spec.tied and stage.stage in (0, p - 1):
            tied = math.prod(shards.embed.local["embed.tok.weight"]) * nb["w"]
            out.append(Collective(FIRST_LAST, "all_reduce", all_reduce(2, tied), 1,
                                  "tied embedding / head gradient", "step"))  # fmt: skip
        out.append(Collective(PM.PIPELINE, "broadcast", 8, 1, "loss from the last stage", "step"))
        act = geo.tokens(sc.micro_batch * spec.seq_len) * spec.hidden / geo.hidden_parts * nb["r"]
        sends = 2 * sc.chunks - (stage.stage == 0) - (stage.stage == p - 1)
        out.append(Collective(PM.PIPELINE, "send_recv", act, sends * sc.micro_batches,
                              "activations and their gradients (point to point)", counted=False))  # fmt: skip
    world = sc.world
    if sc.amp == "torch":
        if sizes[PM.MODEL] > 1:
            out.append(Collective(PM.MODEL, "all_reduce", all_reduce(sizes[PM.MODEL], 4), 1,
                                  "loss-scaler overflow flag", "step"))  # fmt: skip
    elif world > 1:
        what = "loss-scaler overflow flag" if sc.amp == "naive" else "non-finite check"
        out.append(Collective(PM.GLOBAL, "all_reduce", all_reduce(world, 4), 1, what, "step"))
    if sc.clip and world > 1:
        out.append(
            Collective(PM.GLOBAL, "all_reduce", all_reduce(world, 4), 1, "gradient norm", "step")
        )
    return out


def _zero_collectives(sc: Scenario, stage: StageLayers, shards, group, n: int) -> list[Collective]:
    """ZeRO's traffic on the fullest rank, its rows padded to ``ceil(rows / n)`` (torch's
    reduce-scatter / all-gather into flat buckets, or FSDP2's; not seen by count_bytes)."""
    from gridtrain.estimate.memory import owned

    nb = dtype_bytes(sc.amp)
    rows = sum(owned(shape, n) * k for shape, k in stage.shapes(shards))
    buckets = max(1, math.ceil(rows * n * nb["w"] / BUCKET_BYTES))
    if sc.zero < 3:
        return [
            Collective(group, "reduce_scatter", (n - 1) * rows * nb["w"] / buckets, buckets,
                       "ZeRO: gradient rows (overlaps backward)", "backward", False),
            Collective(group, "all_gather", (n - 1) * rows * nb["w"] / buckets, buckets,
                       "ZeRO: updated rows after the step", "step", False),
        ]  # fmt: skip
    gathered = 2 if sc.amp in ("naive", "bf16") else 4  # FSDP2 gathers in param_dtype
    return [
        Collective(group, "all_gather", (n - 1) * rows * gathered, 2 * sc.micro_batches,
                   "ZeRO-3: parameters before forward and backward", "prefetch", False),
        Collective(group, "reduce_scatter", (n - 1) * rows * 4, 1,
                   "ZeRO-3: gradients (fp32)", "backward", False),
    ]  # fmt: skip


def by_op(collectives: list[Collective], counted_only: bool = True) -> dict[str, float]:
    """Total bytes per collective name (``counted_only``: what comm.count_bytes sees)."""
    out: dict[str, float] = {}
    for c in collectives:
        if counted_only and not c.counted:
            continue
        out[c.op] = out.get(c.op, 0.0) + c.total
    return out
