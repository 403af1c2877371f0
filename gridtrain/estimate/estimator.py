"""``estimate(spec, scenario, device)``: per-rank memory, per-step communication and step time.

Every stage of the pipeline is estimated (its layers, its shards, its micro-batches
in flight); the report shows the stage that needs the most memory and the one
that sets the pace. ``fits`` compares each stage's bytes with the device's.
"""

from __future__ import annotations

import dataclasses

from gridtrain.estimate.communication import (
    Collective,
    microbatch_collectives,
    step_only_collectives,
)
from gridtrain.estimate.devices import DeviceSpec, GiB
from gridtrain.estimate.geometry import Geometry
from gridtrain.estimate.memory import Activations, dtype_bytes, in_flight, stage_activations
from gridtrain.estimate.models import ModelSpec
from gridtrain.estimate.scenario import Scenario, StageLayers
from gridtrain.estimate.shards import TensorShards
from gridtrain.estimate.states import MASTERS, OPTIMIZER_STATE, ModelStates
from gridtrain.estimate.timing import collective_seconds, group_links
from gridtrain.parallel.tensor.modes import geometry_of
from gridtrain.parallel.zero.memory_rules import reduces_each_backward

RESERVED_GPU = 2 * GiB  # CUDA context, NCCL buffers, allocator slack
TRAFFIC = 4  # activation bytes moved per saved byte: written, read, gradient written and read


@dataclasses.dataclass(frozen=True)
class StageEstimate:
    layers: StageLayers
    params: int
    states: ModelStates
    activations: Activations
    micro_collectives: list[Collective]  # one micro-batch's (tensor groups)
    step_collectives: list[Collective]  # once per step (data parallel, pipeline, flags)
    micro_batches: int
    compute_s: float  # one micro-batch, forward + backward (+ recompute)
    tensor_comm_s: float  # per step, exposed
    p2p_s: float  # per step
    overlapped_s: float  # data-parallel / ZeRO collectives per step
    exposed_dp_s: float
    tail_s: float  # after the schedule: exposed DP, optimizer, scalars, offload

    @property
    def memory(self) -> float:
        return self.states.total + self.activations.in_flight

    @property
    def collectives(self) -> list[Collective]:
        """Every collective of one step."""
        return [
            c.scaled(self.micro_batches) for c in self.micro_collectives
        ] + self.step_collectives

    @property
    def micro_s(self) -> float:
        """One micro-batch slot of the schedule on this stage."""
        return self.compute_s + self.tensor_comm_s + self.p2p_s


@dataclasses.dataclass(frozen=True)
class Estimate:
    spec: ModelSpec
    scenario: Scenario
    device: DeviceSpec
    stages: list[StageEstimate]
    links: dict
    schedule_s: float
    step_s: float
    reserved: float

    @property
    def worst(self) -> StageEstimate:
        """The stage that needs the most memory."""
        return max(self.stages, key=lambda s: s.memory)

    @property
    def memory(self) -> float:
        return self.worst.memory + self.reserved

    @property
    def fits(self) -> bool:
        return self.memory <= self.device.memory

    @property
    def tokens_per_s(self) -> float:
        return self.scenario.global_batch * self.spec.seq_len / self.step_s

    @property
    def model_flops(self) -> float:
        """Model FLOPs per step (PaLM's 6N + 12LHS per token; no recompute)."""
        tokens = self.scenario.global_batch * self.spec.seq_len
        return self.spec.model_flops_per_token(self.spec.seq_len) * tokens

    @property
    def tflops_per_gpu(self) -> float:
        return self.model_flops / self.step_s / self.scenario.world / 1e12

    @property
    def mfu(self) -> float:
        peak = self.device.peak_for(self.scenario.amp)
        return self.model_flops / self.step_s / (self.scenario.world * peak)

    @property
    def bubble(self) -> float:
        sc = self.scenario
        if sc.pipeline == 1:
            return 0.0
        return (sc.pipeline - 1) / (sc.chunks * sc.pipeline_micro + sc.pipeline - 1)


def _flops(spec: ModelSpec, stage: StageLayers, sc: Scenario) -> float:
    """Matmul FLOPs of one micro-batch through ``stage`` on one rank, forward + backward."""
    tokens = sc.micro_batch * spec.seq_len
    h = spec.hidden
    linear = 2 * h * (spec.qkv_out + h) + 2 * spec.mlp_params(active=True)
    ring = geometry_of(sc.mode).splits_sequence and sc.tensor > 1
    causal = not (ring and sc.ring == "standard")
    attention = spec.attention_flops_per_token(spec.seq_len, causal=causal) / spec.layers
    block = tokens * (linear + attention)
    forward = stage.blocks * block + (tokens * 2 * h * spec.vocab if stage.head else 0)
    recompute = sc.checkpointed(stage.blocks) * block
    return (3 * forward + recompute) / sc.tensor


def gemm_scale(spec: ModelSpec, geo: Geometry, sc: Scenario, half: float) -> float:
    """How far below its large-shape efficiency a rank's GEMMs run: ``n / (n + half)`` for the
    smallest dimension ``n`` of a block's local matmuls (rows of the rank's tokens, its slices
    of the hidden and MLP widths); half speed at ``half`` (``DeviceSpec.gemm_half``)."""
    key = (spec, geo, sc.micro_batch, half)
    if key in _SCALE:
        return _SCALE[key]
    tokens = geo.tokens(sc.micro_batch * spec.seq_len) * geo.gather
    dims = [tokens]
    for width, role in ((spec.hidden, "column"), (spec.hidden, "row"), (spec.ffn_dim, "row")):
        dims += [geo.in_width(width, role), geo.out_width(width, role)]
    n = min(dims)
    _SCALE[key] = n / (n + half)
    return _SCALE[key]


_SCALE: dict[tuple, float] = {}


def step_bound(spec: ModelSpec, sc: Scenario, device: DeviceSpec, shards: TensorShards) -> float:
    """A lower bound on ``estimate(...).step_s``: the schedule's slots of matmul time and
    tensor-parallel communication alone (no memory traffic, no pipeline transfers, no
    data-parallel or optimizer tail). The search drops a layout whose bound is slower
    than the results it already holds."""
    geo = Geometry.of(sc.mode, sc.tensor, sc.depth)
    links = group_links(sc, device.gpus_per_node)
    peak = device.peak_for(sc.amp) * device.efficiency * gemm_scale(spec, geo, sc, device.gemm_half)
    slot = 0.0
    for st in {(s.embed, s.blocks, s.head): s for s in sc.stages(spec)}.values():
        comm = sum(
            collective_seconds(c, links, device)
            for c in microbatch_collectives(spec, geo, sc, st, shards)
        )
        slot = max(slot, _flops(spec, st, sc) / peak + comm)
    if sc.pipeline > 1:
        return sc.accumulation * (sc.pipeline_micro + (sc.pipeline - 1) / sc.chunks) * slot
    return sc.micro_batches * slot


def estimate(
    spec: ModelSpec, sc: Scenario, device: DeviceSpec, shards: TensorShards | None = None
) -> Estimate:
    """Estimate ``spec`` trained as ``sc`` on ``device``; raises ``EstimateError`` if the layout
    cannot run it (see ``Scenario.check``)."""
    shards = shards or sc.check(spec)
    geo = Geometry.of(sc.mode, sc.tensor, sc.depth)
    links = group_links(sc, device.gpus_per_node)
    sizes = {group: link.size for group, link in links.items()}
    stages = []
    done: dict[tuple, tuple] = {}  # stages alike in layers share everything but in-flight counts
    for layers in sc.stages(spec):
        key = (layers.embed, layers.blocks, layers.head, layers.stage in (0, sc.pipeline - 1))
        if key not in done:
            done[key] = _stage_parts(spec, sc, device, shards, geo, links, sizes, layers)
        params, states, per_micro, block, colls, compute, times = done[key]
        n = in_flight(sc, layers.stage)
        held = n * per_micro + (sum(b for _, b in block) if sc.checkpointed(layers.blocks) else 0)
        acts = Activations(per_micro, held, n, block)
        stages.append(StageEstimate(layers, params, states, acts, *colls, sc.micro_batches,
                                    compute, *times))  # fmt: skip
    slot = max(s.compute_s + (s.tensor_comm_s + s.p2p_s) / sc.micro_batches for s in stages)
    if sc.pipeline > 1:
        schedule = sc.accumulation * (sc.pipeline_micro + (sc.pipeline - 1) / sc.chunks) * slot
    else:
        schedule = sc.micro_batches * slot
    step = schedule + max(s.tail_s for s in stages)
    reserved = RESERVED_GPU if device.name != "cpu" else 0.0
    return Estimate(spec, sc, device, stages, links, schedule, step, reserved)


def _stage_parts(spec, sc, device, shards, geo, links, sizes, layers):
    """Everything about one stage that does not depend on its place in the schedule."""
    peak = device.peak_for(sc.amp) * device.efficiency
    params = layers.params(shards)
    states = layers.states(shards, sc)
    acts = stage_activations(spec, geo, sc, layers, shards, device.fused_rms_norm)
    micro = microbatch_collectives(spec, geo, sc, layers, shards)
    steps = step_only_collectives(spec, geo, sc, layers, shards, sizes)
    traffic = TRAFFIC + (1 if sc.checkpointed(layers.blocks) else 0)
    touched = acts.per_microbatch  # bytes the kernels write and read: recompute rebuilds them
    if sc.recompute != "none":
        plain = dataclasses.replace(sc, recompute="none")
        touched = stage_activations(spec, geo, plain, layers, shards).per_microbatch
    compute = _flops(spec, layers, sc) / (peak * gemm_scale(spec, geo, sc, device.gemm_half))
    compute += traffic * touched / device.hbm_bw
    tensor_s = p2p_s = overlapped = prefetched = after = 0.0
    buckets = 0.0
    for c in micro:  # tensor groups, on the critical path of every micro-batch
        tensor_s += collective_seconds(c, links, device) * sc.micro_batches
    for c in steps:
        seconds = collective_seconds(c, links, device)
        if c.op == "send_recv":
            p2p_s += seconds
        elif c.phase == "backward":
            overlapped += seconds
            buckets += c.calls
        elif c.phase == "prefetch":
            prefetched += seconds
        elif c.phase == "step":
            after += seconds
        else:
            tensor_s += seconds
    # the last bucket cannot overlap: it is reduced once backward has made its gradients;
    # stages that reduce in every backward (memory_rules) overlap every micro-batch's backward
    backward = compute * 2 / 3
    if sc.zero and reduces_each_backward(sc.zero, sc.offload, sc.keep_unsharded_grads):
        backward *= sc.micro_batches
    exposed_dp = max(overlapped - backward, overlapped / buckets) if overlapped else 0.0
    if not sc.overlap_dp:  # a gradient handler: the whole reduction after the backward
        exposed_dp = overlapped
    exposed_dp += max(0.0, prefetched - compute * sc.micro_batches)
    nb = dtype_bytes(sc.amp)
    opt_bytes = 2 * _stepped_bytes(states)
    if sc.gemini:  # gradients stream during each backward, masters come back after the step
        backward_s = compute * 2 / 3 * sc.micro_batches
        offload = max(0.0, states.part("pcie_d2h") / device.pcie - backward_s)
        offload += states.part("pcie_h2d") / device.pcie + states.part("rows") / device.cpu_adam
    else:
        offload = (params * nb["w"] * 2) / device.pcie if sc.offload else 0.0
    tail = exposed_dp + opt_bytes / device.hbm_bw + after + offload
    times = (tensor_s, p2p_s, overlapped, exposed_dp, tail)
    return params, states, acts.per_microbatch, acts.block, (micro, steps), compute, times


def _stepped_bytes(st: ModelStates) -> float:
    """What the (memory-bound) optimizer step reads once and writes once: the weights it
    updates, their gradients and the optimizer state."""
    return (
        st.part("weights") + st.device[MASTERS] + st.host[MASTERS] + st.part("master_grads")
        + st.device[OPTIMIZER_STATE] + st.host[OPTIMIZER_STATE]
    )  # fmt: skip
