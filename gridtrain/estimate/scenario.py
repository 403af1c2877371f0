"""The run being estimated: a config's layout at a world size, a batch, a precision, ZeRO.

``Scenario.from_config`` reads everything the engine would read
(``parallel.pipeline``/``tensor``, ``num_microbatches``, ``gradient_accumulation``,
``fp16.mode``, ``clip_grad_norm``, and ``zero`` once the config has it);
``check`` says, before any number is computed, why a layout cannot run this
model (which group, which divisor); ``stages`` cuts the layers into pipeline
stages with the engine's own ``partition`` and layer costs.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

from gridtrain.config import Config, ConfigError
from gridtrain.estimate.models import ModelSpec
from gridtrain.estimate.shards import TensorShards, tensor_shards
from gridtrain.estimate.skeleton import meta_skeleton
from gridtrain.parallel.pipeline.balance import LayerCosts, layer_costs, partition
from gridtrain.parallel.tensor.mode_2d.grid import grid_side
from gridtrain.parallel.tensor.mode_3d.cube import cube_side
from gridtrain.parallel.tensor.plan import PlanError
from gridtrain.parallel.tensor.registry import mode_spec


class EstimateError(ValueError):
    """A layout that cannot run the model: names the group and the divisor."""


AMP_NAMES = {"torch": "torch", "bf16": "bf16", "naive": "naive", "apex": "naive"}


@dataclasses.dataclass(frozen=True)
class Scenario:
    """One layout of one training step (sizes per data-parallel rank unless said otherwise)."""

    world: int
    pipeline: int = 1
    tensor: int = 1
    mode: str | None = None
    depth: int = 1
    chunks: int = 1  # interleaved model chunks per stage
    micro_batch: int = 1  # sequences per micro-batch of one data-parallel rank
    pipeline_micro: int = 1  # num_microbatches (1 without a pipeline)
    accumulation: int = 1  # gradient_accumulation
    amp: str | None = None  # None (fp32), "torch", "bf16", "naive"
    zero: int = 0
    offload: bool = False
    recompute: str = "none"  # "none" or "full" (every block keeps only its input)
    ring: str = "standard"
    partition: str = "uniform"
    clip: bool = False
    attention: str = "flash"  # SDPA's fused kernels; "math" keeps the s x s scores (what-if)

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
    def gemini(self) -> bool:
        """ZeRO 3 with offload: ``parallel/zero/offload.py``'s runtime."""
        return self.zero == 3 and self.offload

    @property
    def zero_group(self) -> int:
        """Ranks a gradient is averaged over (and ZeRO shards over): data, x sequence."""
        return self.data * (self.tensor if self.mode == "sequence" else 1)

    def describe(self) -> str:
        mode = f"{self.mode} " if self.mode else ""
        depth = f" depth {self.depth}" if self.mode == "2.5d" else ""
        chunks = f" x {self.chunks} chunks" if self.chunks > 1 else ""
        zero = f", ZeRO-{self.zero}{' offload' if self.offload else ''}" if self.zero else ""
        recompute = ", full recompute" if self.recompute == "full" else ""
        return (
            f"data {self.data} x pipeline {self.pipeline}{chunks} x tensor {mode}{self.tensor}"
            f"{depth}; micro-batch {self.micro_batch} x {self.micro_batches} per step "
            f"(global batch {self.global_batch}); {self.amp or 'fp32'}{zero}{recompute}"
        )

    def config_dict(self) -> dict[str, Any]:
        """The gridtrain config keys that give this layout (``zero`` once the engine has it)."""
        tensor: dict[str, Any] = {"size": self.tensor, "mode": self.mode}
        if self.mode == "2.5d":
            tensor["depth"] = self.depth
        pipeline: dict[str, Any] = {"size": self.pipeline}
        if self.chunks > 1:
            pipeline["num_chunks"] = self.chunks
        out: dict[str, Any] = {"parallel": {"pipeline": pipeline, "tensor": tensor}}
        if self.pipeline > 1:
            out["num_microbatches"] = self.pipeline_micro
        if self.accumulation > 1:
            out["gradient_accumulation"] = self.accumulation
        if self.amp:
            out["fp16"] = {"mode": self.amp}
        if self.zero:
            out["zero"] = {"stage": self.zero, **({"offload": True} if self.offload else {})}
        return out

    # ---- building ----------------------------------------------------------------------
    @classmethod
    def from_config(
        cls,
        cfg: Config,
        world: int,
        global_batch: int | None = None,
        micro_batch: int | None = None,
        zero: int | None = None,
        offload: bool | None = None,
        recompute: str = "none",
        attention: str = "flash",
    ) -> Scenario:
        """The scenario ``cfg`` describes at ``world`` ranks; the batch from ``global_batch``
        (else the config's ``GLOBAL_BATCH_SIZE``), else ``micro_batch`` (default 1)."""
        try:
            cfg.check_world_size(world)
        except ConfigError as err:
            raise EstimateError(str(err)) from None
        p, t = cfg.pipeline_size, cfg.tensor_size
        m = _pipeline_microbatches(cfg)
        ga = cfg.gradient_accumulation
        if global_batch is None:
            global_batch = cfg.user_constants().get("GLOBAL_BATCH_SIZE")
        if global_batch is not None:
            micro_batch = _micro_batch(global_batch, world // (p * t), m, ga)
        stage, off = _zero_of(cfg)
        amp = amp_of(cfg)
        tc = cfg.parallel.tensor
        return cls(
            world=world,
            pipeline=p,
            tensor=t,
            mode=tc.mode,
            depth=tc.depth,
            chunks=cfg.parallel.pipeline.num_chunks,
            micro_batch=micro_batch or 1,
            pipeline_micro=m,
            accumulation=ga,
            amp=amp,
            zero=stage if zero is None else zero,
            offload=off if offload is None else offload,
            recompute=recompute,
            ring=tc.ring_attention,
            partition=cfg.parallel.pipeline.partition,
            clip=cfg.clip_grad_norm > 0,
            attention=attention,
        )

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
        heads_split, what = mode_spec(mode).head_split(t, self.depth)
        for name, n in (("heads", spec.heads), ("key/value heads", spec.num_kv_heads)):
            if n % heads_split:
                raise EstimateError(
                    f"{spec.name}'s {n} attention {name} do not split over {what}: "
                    f"{n} % {heads_split} != 0"
                )
        rows, rows_what = batch_split(mode, t, self.depth)
        if b % rows:
            raise EstimateError(
                f"tensor mode {mode} splits each micro-batch over {rows_what}: micro-batch {b} "
                f"% {rows} != 0 (raise the global batch or cut fewer micro-batches)"
            )
        if mode == "sequence" and spec.seq_len % t:
            raise EstimateError(
                f"sequence parallelism splits the sequence over SEQUENCE ({t} ranks): "
                f"sequence length {spec.seq_len} % {t} != 0"
            )
        parts = self.pipeline * self.chunks
        if spec.layers + 2 < parts:
            raise EstimateError(
                f"{spec.layers} blocks + embed + head = {spec.layers + 2} layers cannot fill "
                f"pipeline {self.pipeline} x {self.chunks} chunks = {parts} parts"
            )
        if self.chunks > 1 and self.pipeline_micro % self.pipeline:
            raise EstimateError(
                f"the interleaved schedule needs num_microbatches divisible by the pipeline size: "
                f"{self.pipeline_micro} % {self.pipeline} != 0"
            )
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

    def shapes(self, shards: TensorShards) -> list[tuple[tuple[int, ...], int]]:
        """(local shape, how many) of every parameter tensor this stage holds."""
        key = (id(shards), self.embed, self.blocks, self.head)
        hit = _SHAPES.get(key)
        if hit is None or hit[0] is not shards:
            hit = _SHAPES[key] = (shards, self._shapes(shards))
        return hit[1]

    def _shapes(self, shards: TensorShards) -> list[tuple[tuple[int, ...], int]]:
        out = [(shape, self.blocks) for shape in shards.block.local.values()] if self.blocks else []
        if self.embed:
            out += [(shape, 1) for shape in shards.embed.local.values()]
        if self.head:
            tied = shards.head.tied if self.embed else frozenset()
            out += [(shape, 1) for key, shape in shards.head.local.items() if key not in tied]
        return out

    def largest_layer(self, shards: TensorShards) -> int:
        """Parameters of the stage's largest layer (a ZeRO-3 unit gathered at once)."""
        sizes = [shards.block.numel] if self.blocks else []
        sizes += [shards.embed.numel] if self.embed else []
        sizes += [shards.head.numel_with_ties] if self.head else []
        return max(sizes, default=0)

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


_SHAPES: dict[tuple, tuple] = {}  # keeps the shards alive, so their id stays theirs


def amp_of(cfg: Config) -> str | None:
    """The config's mixed precision as the estimator names it (apex O2 counts as naive)."""
    if cfg.fp16 is None or cfg.fp16.mode is None:
        return None
    return AMP_NAMES[str(getattr(cfg.fp16.mode, "value", cfg.fp16.mode))]


def _zero_of(cfg: Config) -> tuple[int, bool]:
    """``zero = dict(stage=..., offload=...)`` once the config schema has it (a model or a dict)."""
    zero = getattr(cfg, "zero", None)
    if zero is None:
        zero = cfg.user_constants().get("ZERO")
    if zero is None:
        return 0, False
    if isinstance(zero, dict):
        return int(zero.get("stage", 0) or 0), bool(zero.get("offload", False))
    return int(getattr(zero, "stage", 0) or 0), bool(getattr(zero, "offload", False))


def batch_split(mode: str | None, t: int, depth: int) -> tuple[int, str]:
    """How many blocks a micro-batch's rows are cut into on one tensor group."""
    if mode == "2d":
        q = grid_side(t)
        return q, f"the grid rows (q = {q})"
    if mode == "2.5d":
        q = grid_side(t, depth)
        return depth * q, f"depth {depth} x q {q} = {depth * q} batch blocks"
    if mode == "3d":
        d = cube_side(t)
        return d * d, f"d*d = {d * d} batch blocks of the cube"
    return 1, "nothing"


def _pipeline_microbatches(cfg: Config) -> int:
    """Micro-batches per pipeline step: 1 without a pipeline, else the config's (required)."""
    p = cfg.pipeline_size
    if p == 1:
        return 1
    if cfg.num_microbatches is None:
        raise EstimateError(
            f"parallel.pipeline = {p} needs num_microbatches in the config "
            f"(e.g. num_microbatches = {2 * p})"
        )
    return cfg.num_microbatches


def _micro_batch(global_batch: int, data: int, m: int, ga: int) -> int:
    """The sequences per micro-batch that ``global_batch`` gives; it must split evenly."""
    per = data * m * ga
    if global_batch % per:
        raise EstimateError(
            f"global batch {global_batch} does not split into data {data} x "
            f"micro-batches {m} x gradient_accumulation {ga} = {per} equal micro-batches"
        )
    return global_batch // per
