"""Activation bytes per rank: per micro-batch and in flight under the pipeline schedule (model
states: ``states.py``).

**Activations** are the tensors autograd saves for backward, listed op by op for
one pre-norm block as gridtrain's layers run it (the inventory of Korthikanti et
al. 2022, §4, redone for these layers): the norm input (LayerNorm keeps it and
its statistics; the 2d/3d ``Norm`` keeps the centred input and the normalised
output), each Linear's input (3d: gathered over the row axis, plus the gathered
weight), q/k/v, attention (SDPA keeps its output and log-sum-exp; ring
attention 'standard' keeps ``s/N x S`` probabilities, 'online' its fp32 output),
the projection input (a copy: heads are transposed back), the MLP's activation
input and output, dropout masks. With the same op list, no flash attention and
dropout (``attention="math"``: the scores kept, dropped out) it gives their
``34 sbh + 5 a s^2 b`` per layer (fp16, no parallelism) and ``sbh (10 + 24/t + 5as/(ht))``
under 1d (tests/test_estimate.py).
Autocast keeps a bf16 copy of every weight a plain ``F.linear`` uses (none, 1d,
sequence) per micro-batch. ``recompute="full"`` (``activation_checkpoint``) keeps only the
input of every ``recompute_every``-th block and
rebuilds one block at a time.

In flight: a stage's warm-up forwards and one more, as the schedule counts them
(``config/pipeline.py``'s ``WARMUP``, which the engine's schedules run): 1F1B keeps
``min(P - stage, m)`` micro-batches, interleaved ``min(2 (P - stage - 1) + (v - 1) P + 1, m v)``
chunk micro-batches, GPipe all ``m``; without a pipeline one.
"""

from __future__ import annotations

import dataclasses
import math

from gridtrain.config.pipeline import in_flight as schedule_in_flight
from gridtrain.estimate.geometry import Geometry
from gridtrain.estimate.models import ModelSpec
from gridtrain.estimate.scenario import Scenario, StageLayers
from gridtrain.estimate.shards import LayerShards, TensorShards
from gridtrain.estimate.states import Rules

LINEARS = ("attn.qkv", "attn.proj", "mlp.fc", "mlp.fc2", "mlp.gate")


def dtype_bytes(amp: str | None) -> dict[str, int]:
    """Bytes of: e compute (matmul in/out), r residual stream, w weights, f fp32, b bool, i int64.
    The model's own dtype (``r``, ``w``) is the model-state rules' (``Rules.w``)."""
    model = Rules(amp=amp).w
    return {
        "e": 2 if amp is not None else 4,
        "r": model,
        "w": model,
        "f": 4,
        "b": 1,
        "i": 8,
    }


# ---- activations -----------------------------------------------------------------------------
Item = tuple[str, float]  # (what, bytes)


def _norm(name: str, spec: ModelSpec, geo: Geometry, t: float, nb, fused: bool) -> list[Item]:
    width = spec.hidden / geo.hidden_parts
    if geo.grid:  # gridtrain's Norm: centred input (fp32 statistics) and normalised output
        return [(f"{name} centred input", t * width * 4), (f"{name} output", t * width * nb["r"])]
    if spec.norm == "rms" and not fused:  # torch's composite rms_norm: fp32 input and output
        return [
            (f"{name} input (fp32)", t * width * 4),
            (f"{name} normalised (fp32)", t * width * 4),
        ]
    stats = 2 if spec.norm == "layer" else 1
    return [(f"{name} input", t * width * nb["r"]), (f"{name} statistics", t * stats * 4)]


def _linear_input(name, width, role, geo: Geometry, t: float, nb, after_norm: bool) -> list[Item]:
    dtype = geo.rules.linear_input_dtype(after_norm)
    return [(f"{name} input", t * geo.gather * geo.in_width(width, role) * nb[dtype])]


def block_items(
    spec: ModelSpec, geo: Geometry, sc: Scenario, tokens: int, block: LayerShards, fused: bool
):
    """Saved tensors of one block for a micro-batch of ``tokens`` tokens (one rank)."""
    nb = dtype_bytes(sc.amp)
    t = geo.tokens(tokens)
    h = spec.hidden
    heads = spec.heads / geo.head_parts
    items: list[Item] = _norm("norm1", spec, geo, t, nb, fused)
    items += _linear_input("qkv", h, "column", geo, t, nb, True)
    if spec.heads == spec.num_kv_heads:
        items.append(("q/k/v (qkv output)", t * geo.out_width(spec.qkv_out, "column") * nb["e"]))
    else:  # grouped queries: q copied out of the groups, k and v repeated per query head
        items.append(("q, repeated k/v", 3 * t * geo.out_width(h, "column") * nb["e"]))
    items += _attention(spec, geo, sc, t, heads, nb)
    items += _linear_input("proj", h, "row", geo, t, nb, False)
    if spec.dropout:
        items.append(("attention dropout mask", t * h / geo.hidden_parts))
    items += _norm("norm2", spec, geo, t, nb, fused)
    items += _moe(spec, geo, sc, t, nb) if spec.experts else _mlp(spec, geo, t, nb)
    items += _weight_copies(geo, sc, block, LINEARS)
    return items


def _mlp(spec: ModelSpec, geo: Geometry, t: float, nb) -> list[Item]:
    h, ffn = spec.hidden, spec.ffn_dim
    fc_out = ffn * (2 if spec.gated else 1)
    items = _linear_input("fc", h, "column", geo, t, nb, True)
    items.append(("fc output (activation input)", t * geo.out_width(fc_out, "column") * nb["e"]))
    if spec.gated:
        items.append(("silu output", t * geo.out_width(ffn, "column") * nb["e"]))
    items += _linear_input("fc2", ffn, "row", geo, t, nb, False)
    if spec.dropout:
        items.append(("mlp dropout mask", t * h / geo.hidden_parts))
    return items


def _moe(spec: ModelSpec, geo: Geometry, sc: Scenario, t: float, nb) -> list[Item]:
    """gridtrain's MoeLayer (grouped dispatch): the gate's input and the router's fp32
    probabilities; ``k t`` rows sent to the experts (balanced: as many come back), each
    expert's input, activation input and output, the gated rows; int64 indices of the
    gathers and scatters. Capacity factor 1 (the skeleton's router) pads no expert beyond
    its share."""
    h, e, k = spec.hidden, spec.expert_ffn, spec.top_k
    rows = k * t
    return [
        ("gate input", t * h * nb["e"]),
        ("router probabilities (fp32)", t * spec.experts * 4),
        ("expert input rows", rows * h * nb["e"]),
        ("expert activation input and output", 2 * rows * e * nb["e"]),
        ("expert output rows (gated)", rows * h * nb["e"] + rows * 4),
        ("dispatch indices", 4 * rows * 8),
    ]


def _attention(spec, geo: Geometry, sc: Scenario, t: float, heads: float, nb) -> list[Item]:
    own = geo.rules.attention_items(geo, sc, spec, t, heads, nb)  # sequence: the ring's
    if own is not None:
        return own
    if sc.attention == "math":  # unfused: scores kept (and dropped out, with dropout)
        scores = t * heads * spec.seq_len
        items = [("attention probabilities", scores * nb["e"])]
        if spec.dropout:
            items += [
                ("attention dropout mask", scores),
                ("dropped probabilities", scores * nb["e"]),
            ]
        return items
    width = spec.hidden / geo.head_parts  # the heads this rank attends with
    return [("attention output", t * width * nb["e"]), ("attention lse", t * heads * 4)]


def _weight_copies(geo: Geometry, sc: Scenario, layer: LayerShards, linears) -> list[Item]:
    """3d keeps every all-gathered weight; autocast keeps a 16-bit copy of each F.linear weight
    (and of the experts' weights and biases) unless ZeRO 3 already gathers them in 16 bits
    (bf16 under FSDP2, any amp under Gemini)."""
    local = [
        math.prod(shape)
        for key, shape in layer.local.items()
        if (key.endswith(".weight") and any(f".{n}.weight" in f".{key}" for n in linears))
        or ".experts." in key
    ]
    nb = dtype_bytes(sc.amp)
    kept = geo.rules.saved_weights(geo)
    if kept:
        return [("gathered weights", sum(local) * kept * nb["e"])]
    cast = sc.zero == 3 and sc.rules.c == 2  # FSDP2's / Gemini's 16-bit compute copies
    if sc.amp in ("torch", "bf16") and not geo.grid and not cast:  # a plain F.linear
        return [("autocast weight copies", sum(local) * nb["e"])]
    return []


def embed_items(spec: ModelSpec, geo: Geometry, sc: Scenario, tokens: int) -> list[Item]:
    """Token (and position) lookups keep their ids and ownership masks."""
    t = geo.tokens(tokens)
    ids = t * geo.rules.lookup_rows(geo)
    tables = 2 if spec.positions else 1
    items = [("embedding ids and masks", tables * ids * 9)]
    if spec.dropout:
        items.append(("embedding dropout mask", t * spec.hidden / geo.hidden_parts))
    return items


def head_items(
    spec: ModelSpec, geo: Geometry, sc: Scenario, tokens: int, head: LayerShards, fused: bool
):
    """Final norm, the LM head's input and the loss's softmax buffer (``chunked_loss``: the
    hidden states' gradient and the head weights' fp32 sum, taken in the forward; with its
    ``recompute``, or under fp16, the head's input and the labels only)."""
    nb = dtype_bytes(sc.amp)
    t = geo.tokens(tokens)
    items = _norm("final norm", spec, geo, t, nb, fused)
    if sc.chunk_tokens:
        width = geo.in_width(spec.hidden, "column") * geo.gather
        if sc.chunk_recompute or sc.amp in ("torch", "naive"):
            return items + [("LM head input", t * width * nb["e"]), ("labels", t * 8)]
        weights = sum(math.prod(s) for k, s in head.local.items() if ".classifier." in k)
        return items + [("hidden-state gradient", t * width * nb["e"]),
                        ("head weight gradient (fp32)", weights * 4)]  # fmt: skip
    items += _linear_input("LM head", spec.hidden, "column", geo, t, nb, True)
    if geo.rules.vocab_parallel_loss:  # keeps its fp32 softmax block
        items.append(("vocab-parallel softmax", t * geo.out_width(spec.vocab, "column") * 4))
        items.append(("loss per-token state", t * 14))
    else:  # dense cross entropy keeps log-softmax (fp32)
        items.append(("log-softmax", t * spec.vocab * 4))
    items += _weight_copies(geo, sc, head, ("classifier",))
    return items


@dataclasses.dataclass(frozen=True)
class Activations:
    """One stage's activation bytes: per micro-batch, and what the schedule keeps at once."""

    per_microbatch: float
    in_flight: float
    microbatches_in_flight: float
    block: list[Item]  # one block's inventory

    @property
    def peak(self) -> float:
        return self.in_flight


def in_flight(sc: Scenario, stage: int) -> float:
    """Micro-batches (interleaved: in units of the whole stage) whose activations a stage keeps."""
    p, v, m = sc.pipeline, sc.chunks, sc.pipeline_micro
    if p == 1:
        return 1
    n = schedule_in_flight(sc.schedule, m, p, v, stage)
    return n / v if v > 1 else n


_ITEMS: dict[tuple, tuple] = {}


def stage_activations(
    spec: ModelSpec,
    geo: Geometry,
    sc: Scenario,
    stage: StageLayers,
    shards: TensorShards,
    fused_norm: bool = True,
) -> Activations:
    """``fused_norm``: the device runs RMSNorm fused (GPUs) rather than torch's composite (CPU)."""
    tokens = sc.micro_batch * spec.seq_len
    key = (spec, geo, sc.amp, sc.ring, sc.attention, tokens, fused_norm, sc.zero, sc.offload,
           sc.chunk_tokens, sc.chunk_recompute)  # fmt: skip
    if key not in _ITEMS:  # the inventory depends on these alone (shards: spec and geometry)
        block = block_items(spec, geo, sc, tokens, shards.block, fused_norm)
        embed = sum(b for _, b in embed_items(spec, geo, sc, tokens))
        head = sum(b for _, b in head_items(spec, geo, sc, tokens, shards.head, fused_norm))
        _ITEMS[key] = (block, sum(b for _, b in block), embed, head)
    block, block_bytes, embed, head = _ITEMS[key]
    other = (embed if stage.embed else 0.0) + (head if stage.head else 0.0)
    nb = dtype_bytes(sc.amp)
    redo = sc.checkpointed(stage.blocks)
    if redo:  # a checkpointed block keeps its input; one block is rebuilt at a time
        kept = geo.tokens(tokens) * spec.hidden / geo.hidden_parts * nb["r"]
        per = redo * kept + (stage.blocks - redo) * block_bytes + other
        n = in_flight(sc, stage.stage)
        return Activations(per, n * per + block_bytes, n, block)
    per = stage.blocks * block_bytes + other
    n = in_flight(sc, stage.stage)
    return Activations(per, n * per, n, block)
