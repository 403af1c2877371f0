"""Bytes per rank: model states (fp16 mode and ZeRO aware) and activations (per micro-batch and in
flight under the pipeline schedule).

**Model states** per parameter this rank holds (shapes from the engine's plan):
fp32 and autocast (``torch``, ``bf16``) keep fp32 weights and gradients; ``naive``
keeps fp16 weights and gradients plus fp32 master weights and, at step time, fp32
master gradients (``amp/naive_amp.py``). Adam keeps two fp32 moments per (master)
parameter and a 4-byte ``step`` per tensor. ZeRO (Rajbhandari et al. 2020) shards
over the data-parallel group ``N_d``: stage 1 the optimizer states (masters,
moments), stage 2 also the gradients, stage 3 also the weights; offload moves the
optimizer states to host memory.

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
sequence) per micro-batch. ``recompute="full"`` keeps only each block's input and
rebuilds one block at a time.

In flight: 1F1B keeps ``min(P - stage, m)`` micro-batches on a stage; interleaved
keeps ``min(2 (P - stage - 1) + (v - 1) P + 1, m v)`` chunk micro-batches
(``engine/schedules``); without a pipeline one.
"""

from __future__ import annotations

import dataclasses
import math

from gridtrain.estimate.geometry import Geometry
from gridtrain.estimate.models import ModelSpec
from gridtrain.estimate.scenario import Scenario, StageLayers
from gridtrain.estimate.shards import LayerShards, TensorShards

LINEARS = ("attn.qkv", "attn.proj", "mlp.fc", "mlp.fc2")


def dtype_bytes(amp: str | None) -> dict[str, int]:
    """Bytes of: e compute (matmul in/out), r residual stream, w weights, f fp32, b bool, i int64."""
    half = amp is not None
    return {
        "e": 2 if half else 4,
        "r": 2 if amp == "naive" else 4,
        "w": 2 if amp == "naive" else 4,
        "f": 4,
        "b": 1,
        "i": 8,
    }


# ---- model states ----------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class ModelStates:
    """Bytes on one rank (``host``: what ZeRO offload keeps in CPU memory instead;
    ``gathered``: ZeRO-3's unsharded layers, two at a time while FSDP2 prefetches)."""

    weights: float
    grads: float
    master_weights: float
    master_grads: float
    moments: float
    steps: float
    host: float = 0.0
    gathered: float = 0.0
    pcie_h2d: float = 0.0  # Gemini: bytes over the host link per optimizer step
    pcie_d2h: float = 0.0

    @property
    def optimizer(self) -> float:
        """Optimizer states in the ZeRO paper's sense (K = 12 per parameter with naive fp16)."""
        return self.master_weights + self.moments + self.steps

    @property
    def total(self) -> float:
        return self.weights + self.grads + self.master_grads + self.optimizer + self.gathered


def owned(shape: tuple[int, ...], n: int) -> int:
    """Elements of a tensor the first rank of ``n`` owns under ZeRO: its ``ceil(rows / n)``
    rows (``parallel/zero/rows.py``, as torch.chunk and FSDP2 cut; ranks past the last
    chunk own fewer, so the first rank is the fullest)."""
    rows = shape[0] if shape else 1
    return -(-rows // n) * (math.prod(shape) // rows if rows else 0)


def model_states(shapes, sc: Scenario, largest_layer: int = 0) -> ModelStates:
    """Model-state bytes of a rank holding ``shapes`` (``(local shape, count)`` pairs).

    ZeRO as ``parallel/zero`` runs it, on the first (fullest) rank of the data-parallel
    group: stages 1-2 give the optimizer the rank's rows (fp32 copies under naive fp16
    or offload, else views of the model's rows) and the reduce-scattered gradient rows
    (fp32 copies under naive fp16, else views of the bucket); stage 1 keeps the model's
    full gradients, stage 2 drops them; offload moves the optimizer's rows to host memory.
    Stage 3 (FSDP2) keeps fp32 rows of parameters and gradients, which are also the
    masters; with offload it is Gemini (``gemini_states``).
    """
    nb = dtype_bytes(sc.amp)
    naive = sc.amp == "naive"
    full = sum(math.prod(shape) * k for shape, k in shapes)
    tensors = sum(k for _, k in shapes)
    if sc.zero == 0:
        masters = full * 4 if naive else 0
        return ModelStates(full * nb["w"], full * nb["w"], masters, masters, full * 8, tensors * 4)
    rows = sum(owned(shape, sc.zero_group) * k for shape, k in shapes)
    steps = tensors * 4
    if sc.gemini:
        return gemini_states(full, rows, steps, sc, largest_layer)
    if sc.zero == 3:
        gathered = 2 * largest_layer * (2 if sc.amp in ("naive", "bf16") else 4)
        return ModelStates(rows * 4, rows * 4, 0, 0, rows * 8, steps, 0.0, gathered)
    masters = rows * 4 if naive or sc.offload else 0
    master_grads = rows * (4 if naive else nb["w"])
    grads = full * nb["w"] if sc.zero == 1 else 0
    states = ModelStates(full * nb["w"], grads, masters, master_grads, rows * 8, steps)
    if sc.offload:  # the optimizer's rows live on the host
        moved = states.master_weights + states.master_grads + states.moments + states.steps
        states = dataclasses.replace(
            states, master_weights=0, master_grads=0, moments=0, steps=0, host=moved
        )
    return states


def gemini_states(full: int, rows: int, steps: int, sc: Scenario, largest_layer: int):
    """Stage 3 with offload as ``parallel/zero/offload.py`` runs it, every chunk resident
    (``offload_plan``'s formulas): the device keeps a compute-dtype copy of every parameter
    (2 bytes under amp) and two chunks' fp32 gradient buffers in flight; the host keeps the
    rank's rows of fp32 masters, gradients and Adam's moments (16 bytes each); each backward
    sends the gradient rows (4 bytes) and each step brings the masters' rows back (4 bytes)."""
    compute = 2 if sc.amp is not None else 4
    return ModelStates(
        weights=full * compute,
        grads=0,
        master_weights=0,
        master_grads=0,
        moments=0,
        steps=0,
        host=rows * 16 + steps,
        gathered=2 * largest_layer * 4,
        pcie_h2d=rows * 4,
        pcie_d2h=rows * 4 * sc.micro_batches,
    )


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
    # a SUMMA Function keeps its operands as they come (fp32 norm outputs under autocast)
    dtype = "r" if geo.mode in ("2d", "2.5d") and after_norm else "e"
    return [(f"{name} input", t * geo.gather * geo.in_width(width, role) * nb[dtype])]


def block_items(
    spec: ModelSpec, geo: Geometry, sc: Scenario, tokens: int, block: LayerShards, fused: bool
):
    """Saved tensors of one block for a micro-batch of ``tokens`` tokens (one rank)."""
    nb = dtype_bytes(sc.amp)
    t = geo.tokens(tokens)
    h, ffn = spec.hidden, spec.ffn_dim
    fc_out = ffn * (2 if spec.gated else 1)
    heads = spec.heads / (1 if geo.mode in (None, "sequence") else geo.side)
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
    items += _linear_input("fc", h, "column", geo, t, nb, True)
    items.append(("fc output (activation input)", t * geo.out_width(fc_out, "column") * nb["e"]))
    if spec.gated:
        items.append(("silu output", t * geo.out_width(ffn, "column") * nb["e"]))
    items += _linear_input("fc2", ffn, "row", geo, t, nb, False)
    if spec.dropout:
        items.append(("mlp dropout mask", t * h / geo.hidden_parts))
    items += _weight_copies(geo, sc, block, LINEARS)
    return items


def _attention(spec, geo: Geometry, sc: Scenario, t: float, heads: float, nb) -> list[Item]:
    if geo.mode == "sequence" and geo.size > 1:
        s = spec.seq_len
        if sc.ring == "online":  # fp32 output and log-sum-exp
            return [("ring attention output (fp32)", t * spec.hidden * 4), ("lse", t * heads * 4)]
        probs = t * heads * s  # this rank's s/N x S probability rows
        items = [("ring attention probabilities", probs * 4), ("causal mask", t / geo.size * s)]
        if nb["e"] != 4:
            items.append(("probabilities (compute dtype)", probs * nb["e"]))
        return items
    if sc.attention == "math":  # unfused: scores kept (and dropped out, with dropout)
        scores = t * heads * spec.seq_len
        items = [("attention probabilities", scores * nb["e"])]
        if spec.dropout:
            items += [
                ("attention dropout mask", scores),
                ("dropped probabilities", scores * nb["e"]),
            ]
        return items
    width = spec.hidden / (geo.size if geo.mode == "1d" else geo.hidden_parts)
    return [("attention output", t * width * nb["e"]), ("attention lse", t * heads * 4)]


def _weight_copies(geo: Geometry, sc: Scenario, layer: LayerShards, linears) -> list[Item]:
    """3d keeps every all-gathered weight; autocast keeps a bf16 copy of each F.linear weight."""
    local = [
        math.prod(shape)
        for key, shape in layer.local.items()
        if key.endswith(".weight") and any(f".{n}.weight" in f".{key}" for n in linears)
    ]
    nb = dtype_bytes(sc.amp)
    if geo.mode == "3d":
        return [("gathered weights", sum(local) * geo.side * nb["e"])]
    if sc.amp in ("torch", "bf16") and geo.mode in (None, "1d", "sequence"):
        return [("autocast weight copies", sum(local) * nb["e"])]
    return []


def embed_items(spec: ModelSpec, geo: Geometry, sc: Scenario, tokens: int) -> list[Item]:
    """Token (and position) lookups keep their ids and ownership masks."""
    t = geo.tokens(tokens)
    ids = t * (geo.side * geo.depth if geo.mode in ("2d", "2.5d") else geo.gather)
    if geo.mode == "1d":
        ids = tokens
    tables = 2 if spec.positions else 1
    items = [("embedding ids and masks", tables * ids * 9)]
    if spec.dropout:
        items.append(("embedding dropout mask", t * spec.hidden / geo.hidden_parts))
    return items


def head_items(
    spec: ModelSpec, geo: Geometry, sc: Scenario, tokens: int, head: LayerShards, fused: bool
):
    """Final norm, the LM head's input and the loss's softmax buffer."""
    nb = dtype_bytes(sc.amp)
    t = geo.tokens(tokens)
    items = _norm("final norm", spec, geo, t, nb, fused)
    items += _linear_input("LM head", spec.hidden, "column", geo, t, nb, True)
    if geo.mode in (None, "sequence"):  # dense cross entropy keeps log-softmax (fp32)
        items.append(("log-softmax", t * spec.vocab * 4))
    else:  # vocab-parallel cross entropy keeps its fp32 softmax block
        rows = tokens if geo.mode == "1d" else t
        items.append(("vocab-parallel softmax", rows * geo.out_width(spec.vocab, "column") * 4))
        items.append(("loss per-token state", rows * 14))
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
    if v == 1:
        return min(p - stage, m)
    total = m * v
    chunks = total if m == p else min((p - stage - 1) * 2 + (v - 1) * p + 1, total)
    return chunks / v


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
    key = (spec, geo, sc.amp, sc.ring, sc.attention, tokens, fused_norm)
    if key not in _ITEMS:  # the inventory depends on these alone (shards: spec and geometry)
        block = block_items(spec, geo, sc, tokens, shards.block, fused_norm)
        embed = sum(b for _, b in embed_items(spec, geo, sc, tokens))
        head = sum(b for _, b in head_items(spec, geo, sc, tokens, shards.head, fused_norm))
        _ITEMS[key] = (block, sum(b for _, b in block), embed, head)
    block, block_bytes, embed, head = _ITEMS[key]
    other = (embed if stage.embed else 0.0) + (head if stage.head else 0.0)
    nb = dtype_bytes(sc.amp)
    if sc.recompute == "full":  # each block keeps its input; one block is rebuilt at a time
        kept = geo.tokens(tokens) * spec.hidden / geo.hidden_parts * nb["r"]
        per = stage.blocks * kept + other
        n = in_flight(sc, stage.stage)
        return Activations(per, n * per + (block_bytes if stage.blocks else 0), n, block)
    per = stage.blocks * block_bytes + other
    n = in_flight(sc, stage.stage)
    return Activations(per, n * per, n, block)
