"""The run being estimated: a config's layout at a world size, a batch, a precision, ZeRO.

``Scenario.from_config`` (``config_keys.py``) reads every key that changes memory or time
and names those it cannot model; ``check`` says, before any number is computed, why a
layout cannot run this model (which group, which divisor); ``stages`` cuts the layers
into pipeline stages with the engine's own ``partition`` and layer costs; ``StageLayers.params``
lists what a stage's rank holds, parameter by parameter, for the model-state rules
(``states.py``).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

from gridtrain.config import Config
from gridtrain.config.pipeline import check_microbatches, check_schedule, schedule_name
from gridtrain.estimate.models import ModelSpec
from gridtrain.estimate.shards import LayerShards, TensorShards, tensor_shards
from gridtrain.estimate.skeleton import meta_skeleton
from gridtrain.estimate.states import ModelStates, Param, Rules, model_states
from gridtrain.parallel.pipeline.balance import LayerCosts, layer_costs, partition
from gridtrain.parallel.tensor.geometry import ModeGeometry
from gridtrain.parallel.tensor.modes import geometry_of
from gridtrain.parallel.tensor.plan import PlanError


class EstimateError(ValueError):
    """A layout that cannot run the model: names the group and the divisor."""


@dataclasses.dataclass(frozen=True)
class Scenario:
    """One layout of one training step (sizes per data-parallel rank unless said otherwise)."""

    world: int
    pipeline: int = 1
    tensor: int = 1
    mode: str | None = None
    depth: int = 1
    chunks: int = 1  # interleaved model chunks per stage
    pipeline_schedule: str | None = None  # parallel.pipeline.schedule (None: by chunks)
    micro_batch: int = 1  # sequences per micro-batch of one data-parallel rank
    pipeline_micro: int = 1  # num_microbatches (1 without a pipeline)
    accumulation: int = 1  # gradient_accumulation
    amp: str | None = None  # None (fp32), "torch", "bf16", "naive"
    zero: int = 0
    offload: bool = False
    recompute: str = "none"  # "none" or "full": checkpointed blocks keep only their input
    recompute_every: int = 1  # activation_checkpoint.every: every n-th block of a stage
    ring: str = "standard"
    partition: str = "uniform"
    clip: bool = False
    attention: str = "flash"  # SDPA's fused kernels; "math" keeps the s x s scores
    keep_unsharded_grads: bool = False  # zero.keep_unsharded_grads (stage 3)
    bucket_mb: float = 25.0  # zero.bucket_size_mb (stages 1-2)
    chunk_tokens: int = 0  # chunked_loss.chunk_tokens; 0: whole logits
    chunk_recompute: bool = False  # chunked_loss.recompute
    expert_parallel: int = 1  # moe.expert_parallel_size
    overlap_dp: bool = True  # the data-parallel reduction overlaps backward (not: gradient_handler)
    unmodelled: tuple[str, ...] = ()  # config keys that change memory or time, not modelled

    @property
    def data(self) -> int:
        return self.world // (self.pipeline * self.tensor)

    @property
    def micro_batches(self) -> int:
        """Micro-batches each data-parallel rank runs per optimizer step."""
        return self.pipeline_micro * self.accumulation

    @property
    def global_batch(self) -> int:
        return self.data * self.micro_batches * self.micro_batch

    @property
    def schedule(self) -> str:
        """The pipeline schedule that runs (``PipelineConfig.schedule_name``): the one named,
        else interleaved with several chunks per stage and 1F1B with one."""
        return schedule_name(self.pipeline_schedule, self.chunks)

    @property
    def mode_geometry(self) -> ModeGeometry:
        """The tensor mode's geometry (``parallel/tensor/<mode>/geometry.py``)."""
        return geometry_of(self.mode)

    @property
    def gemini(self) -> bool:
        """ZeRO 3 with offload: ``parallel/zero/offload.py``'s runtime."""
        return self.zero == 3 and self.offload

    @property
    def zero_group(self) -> int:
        """Ranks a gradient is averaged over (and ZeRO shards over): data, x sequence."""
        return self.data * self.mode_geometry.data_parallel_span(self.tensor)

    @property
    def expert_group(self) -> int:
        """Ranks an expert's gradient is averaged over (EXPERT_DATA): data / expert parallel."""
        return max(1, self.data // self.expert_parallel)

    @property
    def rules(self) -> Rules:
        """What decides the model states (``states.py``)."""
        return Rules(
            amp=self.amp, zero=self.zero, offload=self.offload,
            keep_unsharded_grads=self.keep_unsharded_grads,
            backwards=self.micro_batches * self.chunks, bucket_mb=self.bucket_mb,
        )  # fmt: skip

    def checkpointed(self, blocks: int) -> int:
        """Blocks of a stage holding ``blocks`` that recompute (every ``recompute_every``-th)."""
        if self.recompute != "full" or not blocks:
            return 0
        return -(-blocks // self.recompute_every)

    def describe(self) -> str:
        mode = f"{self.mode} " if self.mode else ""
        depth = f" depth {self.depth}" if self.mode_geometry.uses_depth else ""
        chunks = f" x {self.chunks} chunks" if self.chunks > 1 else ""
        if self.pipeline_schedule is not None:
            chunks += f" ({self.pipeline_schedule})"
        zero = f", ZeRO-{self.zero}{' offload' if self.offload else ''}" if self.zero else ""
        every = f" of every {self.recompute_every} blocks" if self.recompute_every > 1 else ""
        recompute = f", recompute{every}" if self.recompute == "full" else ""
        return (
            f"data {self.data} x pipeline {self.pipeline}{chunks} x tensor {mode}{self.tensor}"
            f"{depth}; micro-batch {self.micro_batch} x {self.micro_batches} per step "
            f"(global batch {self.global_batch}); {self.amp or 'fp32'}{zero}{recompute}"
        )

    def config_dict(self) -> dict[str, Any]:
        """The gridtrain config keys that give this layout (``zero`` once the engine has it)."""
        tensor: dict[str, Any] = {"size": self.tensor, "mode": self.mode}
        if self.mode_geometry.uses_depth:
            tensor["depth"] = self.depth
        pipeline: dict[str, Any] = {"size": self.pipeline}
        if self.chunks > 1:
            pipeline["num_chunks"] = self.chunks
        if self.pipeline_schedule is not None:
            pipeline["schedule"] = self.pipeline_schedule
        out: dict[str, Any] = {"parallel": {"pipeline": pipeline, "tensor": tensor}}
        if self.pipeline > 1:
            out["num_microbatches"] = self.pipeline_micro
        if self.accumulation > 1:
            out["gradient_accumulation"] = self.accumulation
        if self.amp:
            out["fp16"] = {"mode": self.amp}
        if self.zero:
            out["zero"] = {"stage": self.zero, **({"offload": True} if self.offload else {})}
            if self.keep_unsharded_grads:
                out["zero"]["keep_unsharded_grads"] = True
        if self.recompute == "full":
            every = self.recompute_every
            out["activation_checkpoint"] = True if every == 1 else {"every": every}
        if self.chunk_tokens:
            out["chunked_loss"] = {"chunk_tokens": self.chunk_tokens}
        if self.expert_parallel > 1:
            out["moe"] = {"expert_parallel_size": self.expert_parallel}
        return out

    # ---- building ----------------------------------------------------------------------
    @classmethod
    def from_config(cls, cfg: Config, world: int, **overrides: Any) -> Scenario:
        """The scenario ``cfg`` describes at ``world`` ranks (``config_keys.from_config``)."""
        from gridtrain.estimate.config_keys import from_config

        return from_config(cfg, world, **overrides)

    # ---- what must divide ----------------------------------------------------------------
    def check(self, spec: ModelSpec) -> TensorShards:
        """Raise ``EstimateError`` naming the group and divisor if ``spec`` cannot run here;
        returns the planned tensor shards."""
        t, mode, b = self.tensor, self.mode, self.micro_batch
        if self.zero not in (0, 1, 2, 3):
            raise EstimateError(f"zero stage must be 0, 1, 2 or 3, got {self.zero}")
        if self.offload and not self.zero:
            raise EstimateError("zero offload needs a ZeRO stage (1, 2 or 3)")
        if self.attention not in ("flash", "math"):
            raise EstimateError(f"attention must be 'flash' or 'math', got {self.attention!r}")
        if self.recompute not in ("none", "full"):
            raise EstimateError(f"recompute must be 'none' or 'full', got {self.recompute!r}")
        rules = self.mode_geometry
        heads_split, what = rules.head_split(t, self.depth)
        for name, n in (("heads", spec.heads), ("key/value heads", spec.num_kv_heads)):
            if n % heads_split:
                raise EstimateError(
                    f"{spec.name}'s {n} attention {name} do not split over {what}: "
                    f"{n} % {heads_split} != 0"
                )
        rows, rows_what = rules.batch_split(t, self.depth)
        if b % rows:
            raise EstimateError(
                f"tensor mode {mode} splits each micro-batch over {rows_what}: micro-batch {b} "
                f"% {rows} != 0 (raise the global batch or cut fewer micro-batches)"
            )
        parts, parts_what = rules.sequence_split(t, self.depth)
        if spec.seq_len % parts:
            raise EstimateError(
                f"tensor mode {mode} splits the sequence over {parts_what}: "
                f"sequence length {spec.seq_len} % {parts} != 0"
            )
        parts = self.pipeline * self.chunks
        if spec.layers + 2 < parts:
            raise EstimateError(
                f"{spec.layers} blocks + embed + head = {spec.layers + 2} layers cannot fill "
                f"pipeline {self.pipeline} x {self.chunks} chunks = {parts} parts"
            )
        try:  # the engine's own checks, with their messages
            check_schedule(self.pipeline_schedule, self.chunks)
            check_microbatches(self.schedule, self.pipeline_micro, self.pipeline, self.chunks)
        except ValueError as err:
            raise EstimateError(str(err)) from None
        try:
            return tensor_shards(spec, mode, t, self.depth)
        except PlanError as err:
            hint = ""
            if "num_embeddings" in str(err) or "num_classes" in str(err):
                hint = " (--pad-vocab K rounds the vocabulary up to a multiple of K)"
            raise EstimateError(f"tensor {mode} {t}: {err}{hint}") from None

    def stages(self, spec: ModelSpec) -> list[StageLayers]:
        """Which layers each pipeline stage holds: the engine's ``partition`` on the engine's
        layer costs (``layer_costs_of``), chunks merged."""
        return list(_stages(spec, self.pipeline, self.chunks, self.partition))


@dataclasses.dataclass(frozen=True)
class StageLayers:
    """The layers of one pipeline stage (all its chunks)."""

    stage: int
    embed: bool
    blocks: int
    head: bool

    def params(self, shards: TensorShards) -> int:
        """Parameters this stage's ranks hold (a tied head holds its own copy when the
        embedding lives on another stage, as ``build_stage`` makes it)."""
        n = self.blocks * shards.block.numel
        if self.embed:
            n += shards.embed.numel + (shards.head.numel if self.head else 0)
        elif self.head:
            n += shards.head.numel_with_ties
        return n

    def states(self, shards: TensorShards, sc: Scenario) -> ModelStates:
        """The model states of a rank of this stage (``states.model_states``), cached: the
        search asks for the same stage under many layouts."""
        where = (id(shards), self.embed, self.blocks, self.head, sc.zero_group, sc.expert_group,
                 sc.expert_parallel, sc.pipeline > 1)  # fmt: skip
        key = (*where, sc.rules.states_key())
        hit = _STATES.get(key)
        if hit is None or hit[0] is not shards:
            params = _PARAMS.get(where)  # the same under every ZeRO stage and micro-batch
            if params is None or params[0] is not shards:
                params = _PARAMS[where] = (shards, self.param_list(shards, sc))
            hit = _STATES[key] = (shards, model_states(params[1], sc.rules))
        return hit[1]

    def param_list(self, shards: TensorShards, sc: Scenario) -> list[Param]:
        """Every parameter tensor a rank of this stage holds, in registration order, with its
        data-parallel group and ZeRO 3 unit (``states.Param``): FSDP2 makes each layer a unit
        and leaves a tied embedding and head (both here) to the root."""
        tied_here = bool(shards.head.tied) and self.embed and self.head
        shared = bool(shards.head.tied) and sc.pipeline > 1 and not tied_here
        out: list[Param] = []
        zero_group, expert_group = sc.zero_group, sc.expert_group

        def add(layer: LayerShards, unit: int, block: bool, skip=frozenset()) -> None:
            for key, shape in layer.local.items():
                if key in skip:
                    continue
                expert = ".experts." in key
                if expert:  # the skeleton holds every expert; a rank holds 1/ep of them
                    shape = (shape[0] // sc.expert_parallel, *shape[1:])
                out.append(Param(
                    shape, expert_group if expert else zero_group,
                    unit=0 if tied_here and not block else unit, block=block,
                    shared=shared and key in ("embed.tok.weight", "head.classifier.weight"),
                ))  # fmt: skip

        if self.embed:
            add(shards.embed, 1, False)
        for i in range(self.blocks):
            add(shards.block, 2 + i, True)
        if self.head:
            add(
                shards.head, 2 + self.blocks, False, shards.head.tied if self.embed else frozenset()
            )
        return out

    def tensors(self, shards: TensorShards) -> int:
        """Parameter tensors this stage holds (each has an optimizer ``step`` scalar)."""
        n = self.blocks * shards.block.tensors
        if self.embed:
            n += shards.embed.tensors + (shards.head.tensors if self.head else 0)
        elif self.head:
            n += len(shards.head.local)
        return n


@functools.lru_cache(maxsize=64)
def layer_costs_of(spec: ModelSpec) -> LayerCosts:
    """What the engine's ``partition`` weighs for ``spec``'s layers (embed, the blocks, head):
    ``balance.layer_costs`` of the dense skeleton, whose one block stands for every block (a
    lookup table computes nothing; a tied head shares its weight with the embedding)."""
    one = layer_costs(list(meta_skeleton(spec).children()))
    blocks = [{(i, pid): n for pid, n in one.params[1].items()} for i in range(spec.layers)]
    params = [one.params[0], *blocks, one.params[2]]
    compute = [one.compute[0], *[one.compute[1]] * spec.layers, one.compute[2]]
    return LayerCosts(params, compute)


@functools.lru_cache(maxsize=1024)
def _stages(spec: ModelSpec, pipeline: int, chunks: int, method: str) -> tuple[StageLayers, ...]:
    bounds = partition(layer_costs_of(spec), pipeline * chunks, method)
    owner = [0] * (spec.layers + 2)
    for part, (start, end) in enumerate(bounds):
        owner[start:end] = [part % pipeline] * (end - start)
    return tuple(
        StageLayers(s, owner[0] == s, sum(1 for o in owner[1:-1] if o == s), owner[-1] == s)
        for s in range(pipeline)
    )


_STATES: dict[tuple, tuple] = {}  # keeps the shards alive, so their id stays theirs
_PARAMS: dict[tuple, tuple] = {}  # (shards, StageLayers.param_list), likewise
