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
* sequence (``sequence/ring.py``): K and V blocks pass round the ring
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

import math

from gridtrain.estimate.collectives import Collective, LayerCollectives, all_reduce
from gridtrain.estimate.geometry import Geometry
from gridtrain.estimate.memory import dtype_bytes
from gridtrain.estimate.models import ModelSpec
from gridtrain.estimate.scenario import Scenario, StageLayers
from gridtrain.estimate.shards import TensorShards
from gridtrain.parallel.mode import ParallelMode as PM

BUCKET_BYTES = 25 * 2**20  # parallel/sync/buckets.py DEFAULT_BUCKET_MB
FIRST_LAST = "PIPELINE (first, last)"
__all__ = ["BUCKET_BYTES", "FIRST_LAST", "Collective", "by_op", "microbatch_collectives",
           "step_collectives", "step_only_collectives"]  # fmt: skip


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
        layers = LayerCollectives(spec, geo, sc, tokens)
        for name, entry in entries.items():
            if name.startswith(prefix):
                layers.layer(name.replace("h0.", "block."), entry)
        if prefix == "h0.":
            layers.attention()
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
    dp_group = geo.rules.data_parallel
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
    reduce-scatter / all-gather into flat buckets, or FSDP2's; not seen by count_bytes).
    Stage 2 and stage 3 reduce-scatter in every backward (``memory_rules``), stage 1 and
    stage 3 with ``keep_unsharded_grads`` once per step."""
    nb = dtype_bytes(sc.amp)
    rows = sum(p.chunk() for p in stage.param_list(shards, sc) if p.group == n)
    buckets = max(1, math.ceil(rows * n * nb["w"] / BUCKET_BYTES))
    backwards = sc.micro_batches * sc.chunks
    if sc.zero < 3:
        each = backwards if sc.zero == 2 else 1
        return [
            Collective(group, "reduce_scatter", (n - 1) * rows * nb["w"] / buckets, buckets * each,
                       "ZeRO: gradient rows (overlaps backward)", "backward", False),
            Collective(group, "all_gather", (n - 1) * rows * nb["w"] / buckets, buckets,
                       "ZeRO: updated rows after the step", "step", False),
        ]  # fmt: skip
    gathered = 2 if sc.amp in ("naive", "bf16") else 4  # FSDP2 gathers in param_dtype
    each = 1 if sc.keep_unsharded_grads else backwards
    return [
        Collective(group, "all_gather", (n - 1) * rows * gathered, 2 * sc.micro_batches,
                   "ZeRO-3: parameters before forward and backward", "prefetch", False),
        Collective(group, "reduce_scatter", (n - 1) * rows * 4, each,
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
