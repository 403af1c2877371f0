"""``parallel.pipeline``: the pipeline stages, how the model is cut into them, which schedule
runs them, what that schedule needs from the other keys, and how far each schedule runs
ahead (``WARMUP``: the engine's schedules run it, ``gridtrain estimate`` counts the
activations it keeps)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator

from gridtrain.config.limits import Count
from gridtrain.config.section import Section

ScheduleName = Literal["1f1b", "interleaved", "gpipe"]
SCHEDULE_NAMES: tuple[str, ...] = ScheduleName.__args__  # the engine's table has these keys


class PipelineConfig(Section):
    """``parallel.pipeline``: an int (the size) or a dict with these keys."""

    size: Count = Field(1, description="number of pipeline stages")
    num_chunks: Count = Field(
        1, description="model chunks per stage; > 1 needs the interleaved schedule"
    )
    schedule: ScheduleName | None = Field(
        None,
        description="1f1b, interleaved (num_chunks > 1) or gpipe (all forwards, then all "
        "backwards); None: interleaved when num_chunks > 1, else 1f1b",
    )
    partition: Literal["balanced", "parameters", "uniform"] = Field(
        "balanced", description="balance stages by parameters and compute, parameters, or layers"
    )
    tensor_shape: Annotated[tuple[Count, ...], Field(min_length=1)] | None = Field(
        None, description="fixed activation shape between stages; None exchanges shapes"
    )

    @field_validator("tensor_shape", mode="before")
    @classmethod
    def _list_is_tuple(cls, value: Any) -> Any:
        return tuple(value) if isinstance(value, list) else value  # YAML has no tuples

    @model_validator(mode="after")
    def _schedule_fits_chunks(self) -> PipelineConfig:
        check_schedule(self.schedule, self.num_chunks)
        return self

    @property
    def schedule_name(self) -> str:
        """The schedule that runs: ``schedule``, or by default interleaved when
        ``num_chunks > 1`` and 1f1b otherwise."""
        return schedule_name(self.schedule, self.num_chunks)

    def check_microbatches(self, num_microbatches: int | None) -> None:
        """Raises ``ValueError`` when the schedule cannot run ``num_microbatches`` (None: not
        known yet, nothing to check)."""
        check_schedule(self.schedule, self.num_chunks)  # the keys may be set after loading
        if num_microbatches is not None:
            check_microbatches(self.schedule_name, num_microbatches, self.size, self.num_chunks)


def schedule_name(schedule: str | None, num_chunks: int) -> str:
    """The schedule that runs: ``schedule``, or by default interleaved when ``num_chunks > 1``
    and 1f1b otherwise."""
    if schedule is not None:
        return schedule
    return "interleaved" if num_chunks > 1 else "1f1b"


def check_schedule(schedule: str | None, num_chunks: int) -> None:
    """Only the interleaved schedule runs several chunks per stage, and it needs them."""
    if schedule is None or (schedule == "interleaved") == (num_chunks > 1):
        return
    need = "> 1" if schedule == "interleaved" else "= 1"
    raise ValueError(
        f"parallel.pipeline.schedule={schedule!r} needs parallel.pipeline.num_chunks {need}, "
        f"got num_chunks={num_chunks}; schedules: {', '.join(SCHEDULE_NAMES)} "
        "(interleaved for num_chunks > 1, the others for num_chunks = 1, None picks by "
        "num_chunks)"
    )


def check_microbatches(schedule: str, num_microbatches: int, pipeline_size: int, num_chunks: int):
    """The one micro-batch check: ``num_microbatches >= 1``, and the interleaved schedule runs
    micro-batches in rounds of one per stage, so it needs their number divisible by the
    pipeline size. Raises ``ValueError``; checked at config load and by the schedule itself."""
    m = num_microbatches
    if m < 1:
        raise ValueError(f"num_microbatches must be >= 1, got {m}")
    if schedule == "interleaved" and m % pipeline_size:
        raise ValueError(
            f"the interleaved schedule (parallel.pipeline.num_chunks={num_chunks}) needs "
            f"num_microbatches divisible by the pipeline size: num_microbatches "
            f"{m} % pipeline {pipeline_size} != 0"
        )


# ---- how far each schedule runs ahead ---------------------------------------------------------
def _interleaved_warmup(m: int, p: int, v: int, stage: int) -> int:
    """Megatron's count: two per later stage and a round of the other chunks; with one round
    of micro-batches per stage (``m == p``) every forward runs first."""
    total = m * v
    return total if m == p else min((p - stage - 1) * 2 + (v - 1) * p, total)


# schedule -> forwards (of one micro-batch through one chunk) that a stage runs in a training
# step before its first backward, from (num_microbatches, pipeline size, num_chunks, stage)
WARMUP: dict[str, Callable[[int, int, int, int], int]] = {
    "1f1b": lambda m, p, v, stage: min(p - stage - 1, m),
    "interleaved": _interleaved_warmup,
    "gpipe": lambda m, p, v, stage: m,  # every forward, then every backward
}


def warmup_forwards(schedule: str, m: int, p: int, v: int, stage: int) -> int:
    """Forwards ``stage`` runs before its first backward under ``schedule`` (``WARMUP``)."""
    return WARMUP[schedule](m, p, v, stage)


def in_flight(schedule: str, m: int, p: int, v: int, stage: int) -> int:
    """Chunk micro-batches whose activations ``stage`` keeps at once: its warm-up forwards and
    the one the first backward waits for, at most all ``m v``."""
    return min(warmup_forwards(schedule, m, p, v, stage) + 1, m * v)
