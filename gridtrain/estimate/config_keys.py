"""Every config key that changes memory or time, read into a ``Scenario``; those the estimate
cannot model are named in its output (``Scenario.unmodelled``), never silently dropped.

Read: ``parallel.pipeline`` (size, num_chunks, schedule, partition), ``parallel.tensor`` (size, mode,
depth, ring_attention), ``num_microbatches``, ``gradient_accumulation``, ``fp16.mode``,
``clip_grad_norm``, ``zero`` (stage, offload, bucket_size_mb, keep_unsharded_grads),
``activation_checkpoint`` (every), ``chunked_loss`` (chunk_tokens, recompute),
``moe.expert_parallel_size``, ``attention.backends`` (``"math"`` first keeps the scores), a
data-parallel ``gradient_handler`` (its all-reduce runs after backward, not overlapped with it:
``Scenario.overlap_dp``).

Named, not modelled: ``compile`` (fused kernels change time), ``fp8`` (float8 matmuls and
their casts), ``zero.delayed_update`` (Gemini's host step overlapping the next step),
``zero.device_param_mb`` (Gemini streaming the chunks that do not fit),
``parallel.tensor.plan`` and ``parallel.pipeline.tensor_shape`` (the estimate plans its own
model). Keys that change neither (seeds, loss-scale settings, timeouts) are not listed.
"""

from __future__ import annotations

from typing import Any

from gridtrain.config import Config, ConfigError
from gridtrain.estimate.scenario import EstimateError, Scenario

AMP_NAMES = {"torch": "torch", "bf16": "bf16", "naive": "naive", "apex": "naive"}
DATA_PARALLEL_HANDLERS = ("DataParallelGradientHandler", "SequenceParallelGradientHandler")


def from_config(
    cfg: Config,
    world: int,
    global_batch: int | None = None,
    micro_batch: int | None = None,
    zero: int | None = None,
    offload: bool | None = None,
    recompute: str | None = None,
    attention: str | None = None,
) -> Scenario:
    """The scenario ``cfg`` describes at ``world`` ranks; the batch from ``global_batch``
    (else the config's ``GLOBAL_BATCH_SIZE``), else ``micro_batch`` (default 1). The other
    arguments override the config (the command line's ``--zero``, ``--recompute``, ...)."""
    try:
        cfg.check_world_size(world)
    except ConfigError as err:
        raise EstimateError(str(err)) from None
    p, t = cfg.pipeline_size, cfg.tensor_size
    m, ga = _pipeline_microbatches(cfg), cfg.gradient_accumulation
    if global_batch is None:
        global_batch = cfg.user_constants().get("GLOBAL_BATCH_SIZE")
    if global_batch is not None:
        micro_batch = _micro_batch(global_batch, world // (p * t), m, ga)
    tc, zc = cfg.parallel.tensor, cfg.zero
    ac, cl = cfg.activation_checkpoint, cfg.chunked_loss
    return Scenario(
        world=world, pipeline=p, tensor=t, mode=tc.mode, depth=tc.depth,
        chunks=cfg.parallel.pipeline.num_chunks, micro_batch=micro_batch or 1,
        pipeline_schedule=cfg.parallel.pipeline.schedule,
        pipeline_micro=m, accumulation=ga, amp=amp_of(cfg),
        zero=(zc.stage if zc else 0) if zero is None else zero,
        offload=(zc.offload if zc else False) if offload is None else offload,
        keep_unsharded_grads=bool(getattr(zc, "keep_unsharded_grads", False)),
        bucket_mb=zc.bucket_size_mb if zc else 25.0,
        recompute=recompute or ("full" if ac is not None else "none"),
        recompute_every=ac.every if ac is not None else 1,
        ring=tc.ring_attention, partition=cfg.parallel.pipeline.partition,
        clip=cfg.clip_grad_norm > 0, attention=attention or _attention(cfg),
        chunk_tokens=cl.chunk_tokens if cl else 0, chunk_recompute=bool(cl and cl.recompute),
        expert_parallel=cfg.moe.expert_parallel_size, overlap_dp=_overlap_dp(cfg),
        unmodelled=unmodelled(cfg),
    )  # fmt: skip


def unmodelled(cfg: Config) -> tuple[str, ...]:
    """The keys of ``cfg`` that change memory or time and that the estimate leaves out."""
    out = []
    if cfg.compile is not None:
        out.append("compile (fused kernels: time)")
    if cfg.fp8 is not None:
        out.append("fp8 (float8 matmuls and casts: time, memory)")
    zc = cfg.zero
    if zc is not None and zc.delayed_update:
        out.append("zero.delayed_update (the host step overlaps the next step: time)")
    if zc is not None and zc.device_param_mb is not None:
        out.append("zero.device_param_mb (chunks streamed: every chunk counted resident)")
    if cfg.parallel.tensor.plan is not None:
        out.append("parallel.tensor.plan (the estimate plans its own model)")
    if cfg.parallel.pipeline.tensor_shape is not None:
        out.append("parallel.pipeline.tensor_shape (the estimate sends its own activations)")
    return tuple(out)


def _overlap_dp(cfg: Config) -> bool:
    """False where a data-parallel ``gradient_handler`` all-reduces after the backward."""
    return not any(h.type in DATA_PARALLEL_HANDLERS for h in cfg.gradient_handler)


def amp_of(cfg: Config) -> str | None:
    """The config's mixed precision as the estimator names it (apex O2 counts as naive)."""
    if cfg.fp16 is None or cfg.fp16.mode is None:
        return None
    return AMP_NAMES[str(getattr(cfg.fp16.mode, "value", cfg.fp16.mode))]


def _attention(cfg: Config) -> str:
    """``attention.backends`` preferring ``"math"`` keeps the scores; any fused kernel not."""
    ac = cfg.attention
    return "math" if ac is not None and ac.backends[0] == "math" else "flash"


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


def base_of(cfg: Config, world: int, **fields: Any) -> Scenario:
    """What ``--search`` keeps of a config (precision, clipping, partition, recompute, loss
    chunking, experts, the unmodelled keys); the search picks the layout."""
    ac, cl = cfg.activation_checkpoint, cfg.chunked_loss
    values: dict[str, Any] = dict(
        world=world, amp=amp_of(cfg), clip=cfg.clip_grad_norm > 0,
        partition=cfg.parallel.pipeline.partition,
        recompute="full" if ac is not None else "none",
        recompute_every=ac.every if ac is not None else 1, attention=_attention(cfg),
        chunk_tokens=cl.chunk_tokens if cl else 0, chunk_recompute=bool(cl and cl.recompute),
        bucket_mb=cfg.zero.bucket_size_mb if cfg.zero else 25.0, overlap_dp=_overlap_dp(cfg),
        unmodelled=unmodelled(cfg),
    )  # fmt: skip
    values.update({k: v for k, v in fields.items() if v is not None})
    return Scenario(**values)
