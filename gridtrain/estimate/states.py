"""Model-state bytes of one rank, by ``engine.memory()``'s categories, at each one's peak in a step.

The categories (``parameters``, ``masters``, ``gradients``, ``optimizer_state``) and which of
them each ZeRO stage shards, and when, are the engine's (``parallel.zero.memory_rules``):
``reduces_each_backward`` says whether a rank keeps its full gradients between the
backwards of one step (no ZeRO, stage 1, stage 3 with ``keep_unsharded_grads``) or only its
rows (stage 2, stage 3, Gemini). The buckets are the engine's too: ``group_buckets`` (the
one builder) cuts this rank's parameters into the same reduce-scatter and all-reduce
buckets, so the bytes in flight are those the engine's probes see. What is counted, as
``engine.memory()`` counts it (each storage once, whole):

* ``parameters``: the model's parameters (``w`` bytes: 2 under naive fp16, else 4); ZeRO 1-2
  add the all-gather buffers after the step (``(n + 1)`` segments per bucket); ZeRO 3
  keeps its fp32 rows and gathers units in the compute dtype ``c`` (the root's parameters,
  kept through forward and through backward, and the unit running); Gemini keeps compute-dtype copies (``c``: 2 under any amp).
* ``masters``: fp32 copies (naive fp16; ZeRO 1-2 with naive fp16 or offload: the rows).
* ``gradients``: the peak of a step's gradient timeline: the full local gradients (no ZeRO,
  stage 1), their all-reduce copies or reduce-scatter send (``n`` segments) and receive
  (one segment) buffers, the row accumulators (fp32), naive fp16's fp32 master gradients at
  the step; stage 2 two buckets in flight (the one launching, its gradients not yet
  dropped, and the one before it); stage 3 the sharded fp32 rows plus the root unit's unsharded gradients, held
  until the root's backward ends (``keep_unsharded_grads``: the whole stage's, fp32).
* ``optimizer_state``: Adam's two fp32 moments per (master) element and a 4-byte step per
  tensor.

Offload moves masters, their gradients and the optimizer state into host memory. A row
count is the padded chunk ``ceil(rows / n)`` (storages are counted whole); the first rank of
a group owns exactly that, later ones may own fewer rows but hold the same padded storages.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence

from gridtrain.parallel.sync.buckets import group_buckets
from gridtrain.parallel.zero.memory_rules import (
    FULL,
    FULL_AND_ROWS,
    GRADIENTS,
    IN_FLIGHT_BUCKETS,
    MASTERS,
    OPTIMIZER_STATE,
    PARAMETERS,
    gemini_host_buffers,
    gemini_reduce_bytes,
    gradients_between_backwards,
)
from gridtrain.parallel.zero.offload_plan import ChunkShape, transfer_per_step

CATEGORIES = (PARAMETERS, MASTERS, GRADIENTS, OPTIMIZER_STATE)  # the engine's, less activations


@dataclasses.dataclass(frozen=True)
class Param:
    """One parameter tensor a rank holds, in the model's registration order."""

    shape: tuple[int, ...]
    group: int  # ranks its gradient is averaged over (and ZeRO shards it over)
    unit: int = 0  # ZeRO 3's unit (FSDP2): 0 the root's own, i > 0 the i-th layer of the model
    block: bool = False  # in a repeated block (Gemini's units: one per block, the rest the root)
    shared: bool = False  # tied across pipeline stages: reduced only at the step

    @functools.cached_property
    def numel(self) -> int:
        return math.prod(self.shape)

    @functools.cached_property
    def row_numel(self) -> int:
        return self.numel // self.shape[0] if self.shape else 1

    def chunk(self) -> int:
        """Elements of this rank's (padded) chunk of rows: ``ceil(rows / n)`` rows."""
        rows = self.shape[0] if self.shape else 1
        return -(-rows // self.group) * self.row_numel


@dataclasses.dataclass(frozen=True)
class Rules:
    """What decides a rank's model states: precision, ZeRO and the step's shape."""

    amp: str | None = None  # None (fp32), "torch", "bf16", "naive"
    zero: int = 0
    offload: bool = False
    keep_unsharded_grads: bool = False
    backwards: int = 1  # backwards per optimizer step (accumulation x pipeline micro-batches)
    bucket_mb: float = 25.0

    @property
    def w(self) -> int:
        """Bytes of one model parameter (naive fp16 keeps an fp16 model)."""
        return 2 if self.amp == "naive" else 4

    @property
    def c(self) -> int:
        """Bytes of a gathered (ZeRO 3) or device (Gemini) parameter: FSDP2's param_dtype."""
        if self.zero == 3 and self.offload:
            return 2 if self.amp is not None else 4
        return 2 if self.amp in ("naive", "bf16") else 4

    @property
    def gemini(self) -> bool:
        return self.zero == 3 and self.offload

    @property
    def between_backwards(self) -> str:
        """What a rank keeps of its gradients between two backwards (``memory_rules``)."""
        return gradients_between_backwards(self.zero, self.offload, self.keep_unsharded_grads)

    def states_key(self) -> Rules:
        """These rules as ``model_states`` reads them: only Gemini's transfers count the
        backwards; the other stages ask only whether there are several (a cache key: the
        search meets the same states under many micro-batch counts)."""
        return self if self.gemini else dataclasses.replace(self, backwards=min(self.backwards, 2))


@dataclasses.dataclass(frozen=True)
class ModelStates:
    """Bytes of one rank by category at each category's peak (``device``, ``host``), and the
    parts the report explains them by."""

    device: dict[str, float]
    host: dict[str, float]
    parts: dict[str, float]  # resident and transient pieces (report and timing)

    @property
    def total(self) -> float:
        """Device bytes: the sum of the category peaks (an upper bound on the step's peak)."""
        return sum(self.device.values())

    @property
    def host_total(self) -> float:
        return sum(self.host.values())

    def part(self, name: str) -> float:
        return self.parts.get(name, 0.0)

    @property
    def resident(self) -> float:
        """What stays between steps, in the ZeRO paper's sense: parameters, the gradients
        kept (full or rows), masters and optimizer state; nothing in flight or gathered."""
        held = self.part("weights") + self.part("grads")
        return held + sum(
            d[k] for d in (self.device, self.host) for k in (MASTERS, OPTIMIZER_STATE)
        )


def model_states(params: Sequence[Param], rules: Rules) -> ModelStates:
    """Model-state bytes of a rank holding ``params`` under ``rules``."""
    if rules.gemini:
        return _gemini(params, rules)
    if rules.zero == 3:
        return _fsdp(params, rules)
    if rules.zero in (1, 2):
        return _rows(params, rules)
    return _plain(params, rules)


def _state(params: Sequence[Param], elements: float) -> float:
    return elements * 8 + len(params) * 4  # two fp32 moments, one fp32 step per tensor


def _plain(params: Sequence[Param], r: Rules) -> ModelStates:
    """No ZeRO: full gradients; the overlapped all-reduce copies every bucket of a group of
    two or more ranks and holds the copies until the last one is reduced."""
    full = sum(p.numel for p in params)
    copies = sum(p.numel for p in params if p.group > 1) * r.w
    master_grads = full * 4 if r.amp == "naive" else 0.0  # made at the step, fp16 grads kept
    grads = full * r.w + max(copies, master_grads)
    device = {
        PARAMETERS: full * r.w,
        MASTERS: full * 4.0 if r.amp == "naive" else 0.0,
        GRADIENTS: grads,
        OPTIMIZER_STATE: _state(params, full),
    }
    parts = {"weights": full * r.w, "grads": full * r.w, "in_flight": grads - full * r.w,
             "master_grads": master_grads, "rows": full}  # fmt: skip
    return ModelStates(device, dict.fromkeys(CATEGORIES, 0.0), parts)


# ---- ZeRO 1-2: row buckets ------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class _Bucket:
    members: tuple[Param, ...]
    n: int
    deferred: bool

    @functools.cached_property
    def segment(self) -> int:
        """Elements of one rank's segment: each member's padded chunk (cached: the peak
        walk reads it once per bucket pair)."""
        return sum(p.chunk() for p in self.members)

    def grads(self, w: int) -> float:
        return sum(p.numel for p in self.members) * w

    def send(self, w: int) -> float:
        return self.n * self.segment * w if self.n > 1 else 0.0

    def recv(self, w: int) -> float:
        return self.segment * w if self.n > 1 else 0.0


def row_buckets(params: Sequence[Param], rules: Rules) -> list[_Bucket]:
    """The engine's ZeRO 1-2 buckets (``build_row_buckets``): by group and pipeline tie, in
    reverse registration order, closed at ``bucket_mb``; tied pipeline weights last."""
    grouped = group_buckets(
        params, lambda p: (p.group, p.shared), lambda p: p.numel * rules.w, rules.bucket_mb
    )
    grouped.sort(key=lambda kb: kb[0][1])
    return [_Bucket(tuple(m), k[0], k[1]) for k, m in grouped]


def _rows(params: Sequence[Param], r: Rules) -> ModelStates:
    full = sum(p.numel for p in params)
    rows = sum(p.chunk() for p in params)
    buckets = row_buckets(params, r)
    copies = r.amp == "naive" or r.offload  # fp32 masters of the rows; else views of the model
    acc = 4 if copies else r.w  # a row accumulator: the masters' dtype
    gather = sum(b.send(r.w) + b.recv(r.w) for b in buckets)  # all-gather after the step
    if r.between_backwards == FULL:  # stage 1: full gradients; the last backward's buckets
        # all in flight at its end
        in_flight = sum(b.send(r.w) + b.recv(r.w) for b in buckets)
        grads_dev = full * r.w + in_flight
        resident = full * r.w
    else:
        grads_dev, in_flight = _stage2_peak(buckets, r, 0.0 if r.offload else acc)
        resident = 0.0 if r.offload else rows * acc
    host = dict.fromkeys(CATEGORIES, 0.0)
    device = {
        PARAMETERS: full * r.w + gather,
        MASTERS: rows * 4.0 if copies else 0.0,
        GRADIENTS: grads_dev,
        OPTIMIZER_STATE: _state(params, rows),
    }
    if r.zero == 1 and not r.offload:
        device[GRADIENTS] = max(grads_dev, full * r.w + rows * acc)
    if r.offload:  # masters, their gradients (the accumulators) and Adam on the host
        for key in (MASTERS, OPTIMIZER_STATE):
            host[key], device[key] = device[key], 0.0
        host[GRADIENTS] = rows * 4.0
    parts = {"weights": full * r.w, "gather": gather, "grads": resident,
             "in_flight": grads_dev - resident, "master_grads": rows * acc, "rows": rows}  # fmt: skip
    return ModelStates(device, host, parts)


def _stage2_peak(buckets: list[_Bucket], r: Rules, acc: float) -> tuple[float, float]:
    """(most gradient bytes at once, the part in flight) over one backward of stage 2: at
    each bucket's launch (its send buffer allocated, its gradients not yet dropped) the
    accumulators and the ``IN_FLIGHT_BUCKETS - 1`` buckets before it in flight (send and
    receive buffers). After the
    first backward every accumulator exists; ``backwards == 1`` has only those of the
    buckets finished. (A tied weight's gradient from the head waits in autograd's input
    buffer, not in ``.grad``, until the embedding's backward: neither counts it.)"""
    live = [b for b in buckets if not b.deferred]
    held_acc = [b.segment * acc for b in live]
    shared = sum(b.grads(r.w) for b in buckets if b.deferred)  # kept until the step
    peak = in_flight = 0.0
    total_acc = sum(held_acc)  # a deferred bucket's rows arrive only at the step
    for i, b in enumerate(live):
        first = max(0, i - (IN_FLIGHT_BUCKETS - 1))  # the earliest bucket still in flight
        done = total_acc if r.backwards > 1 else sum(held_acc[:first])
        before = sum(e.send(r.w) + e.recv(r.w) for e in live[first:i])
        now = b.send(r.w) + b.grads(r.w) + before + shared
        if done + now > peak:
            peak, in_flight = done + now, now
    for b in buckets:  # finish(): the deferred (tied pipeline) buckets, at the step
        if b.deferred:
            now = b.send(r.w) + shared
            if total_acc + now > peak:
                peak, in_flight = total_acc + now, now
            total_acc += b.segment * acc
    return max(peak, total_acc), in_flight


# ---- ZeRO 3: FSDP2 --------------------------------------------------------------------------
def _units(params: Sequence[Param]) -> dict[int, int]:
    out: dict[int, int] = {}
    for p in params:
        out[p.unit] = out.get(p.unit, 0) + p.numel
    return out


def _fsdp(params: Sequence[Param], r: Rules) -> ModelStates:
    """FSDP2: fp32 rows of parameters and gradients (the masters), the root's units and one
    unit gathered at a time where ``engine.memory()`` samples (before a unit's forward and
    backward); in backward FSDP2 also prefetches the next unit, which its samples do not
    catch: ``parts["prefetch"]`` (the estimate's total counts it)."""
    full = sum(p.numel for p in params)
    rows = sum(p.chunk() for p in params)
    units = _units(params)
    root = units.pop(0, 0)
    largest = max(units.values(), default=0)
    gathered = (root + largest) * r.c
    keep = r.between_backwards == FULL_AND_ROWS and r.backwards > 1
    grads = full * 4.0 if keep else rows * 4.0  # unsharded: fp32 (FSDP2's reduce_dtype)
    device = {
        PARAMETERS: rows * 4.0 + gathered,
        MASTERS: 0.0,
        GRADIENTS: grads,
        OPTIMIZER_STATE: _state(params, rows),
    }
    parts = {"weights": rows * 4.0, "gathered": gathered, "grads": grads,
             "in_flight": 0.0, "rows": rows, "full": full, "prefetch": largest * r.c}  # fmt: skip
    return ModelStates(device, dict.fromkeys(CATEGORIES, 0.0), parts)


# ---- Gemini ---------------------------------------------------------------------------------
def _gemini_chunks(params: Sequence[Param]) -> list[list[Param]]:
    """Gemini's chunks, as ``offload_plan.group_units`` makes them: one per unit (a block, or
    the root's own parameters) and data-parallel group, in registration order."""
    chunks: dict[tuple[int, int], list[Param]] = {}
    for p in params:
        chunks.setdefault((p.unit if p.block else 0, p.group), []).append(p)
    return list(chunks.values())


def _gemini(params: Sequence[Param], r: Rules) -> ModelStates:
    """Every chunk resident: compute-dtype copies on the device; a chunk's send buffer (``n``
    segments, ``memory_rules.gemini_reduce_bytes``) and its compute gradients while it is
    reduced; the host keeps the rows of fp32 masters, gradients and moments, and the link's
    pinned buffers (``memory_rules.gemini_host_buffers``: gradient staging in the link's dtype,
    upload casts in the compute dtype). The link's bytes per step are ``offload_plan``'s."""
    full = sum(p.numel for p in params)
    rows = sum(p.chunk() for p in params)
    bf16 = r.amp == "bf16"
    chunks = [
        (ChunkShape(sum(p.chunk() for p in ps), sum(p.numel for p in ps), True), ps[0].group)
        for ps in _gemini_chunks(params)
    ]
    sending = max(
        (c.segment * n * gemini_reduce_bytes(n, r.c, 4, bf16) + c.numel * r.c for c, n in chunks),
        default=0,
    )
    largest = max((c.segment for c, _ in chunks), default=0)
    link = gemini_host_buffers(largest, largest, r.c, 4, bf16)  # every chunk resident
    moved = transfer_per_step([c for c, _ in chunks], r.backwards, r.c, 4, bf16)
    device = {PARAMETERS: full * r.c, MASTERS: 0.0, GRADIENTS: sending, OPTIMIZER_STATE: 0.0}
    host = {PARAMETERS: link[PARAMETERS], MASTERS: rows * 4.0,
            GRADIENTS: rows * 4.0 + link[GRADIENTS], OPTIMIZER_STATE: _state(params, rows)}  # fmt: skip
    parts = {"weights": full * r.c, "grads": 0.0, "in_flight": sending, "rows": rows,
             "pcie_h2d": moved["h2d"], "pcie_d2h": moved["d2h"]}  # fmt: skip
    return ModelStates(device, host, parts)
