"""The sections of a config (``parallel``, ``fp16``, ``gradient_handler``, ``moe``), strictly typed.

``gridtrain.config.Config`` holds them; every name here is re-exported there.
Unknown keys are errors that suggest the closest key; values are never
converted silently (strict mode: ``True`` is not ``1``, ``"1.0"`` is not ``1.0``,
``2.0`` is not ``2``), but an int is accepted where a float is expected.
"""

from __future__ import annotations

import difflib
import importlib.util
import math
import reprlib
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    field_validator,
    model_validator,
)

from gridtrain.config_names import AMP_TYPE, STYLES

TENSOR_MODES = ("1d", "2d", "2.5d", "3d", "sequence")
# config name -> the keyword arguments its __init__ takes besides (model, ctx); kept here so a
# config is checked without importing the handlers (tests/test_config_strict.py compares this
# table with their signatures)
HANDLER_KWARGS: dict[str, tuple[str, ...]] = {
    "DataParallelGradientHandler": ("bucket_size_mb",),
    "SequenceParallelGradientHandler": ("bucket_size_mb",),
    "PipelineSharedModuleGradientHandler": (),
    "MoeGradientHandler": ("bucket_size_mb",),
}
GRADIENT_HANDLERS = tuple(HANDLER_KWARGS)
# Strict mode: no silent conversions (True is not 1, "1.0" is not 1.0, 2.0 is not 2); an int
# is still accepted where a float is expected. inf and nan are refused everywhere.
STRICT = ConfigDict(strict=True, allow_inf_nan=False, validate_assignment=True)

# Every number is bounded by what consumes it, so an absurd value fails here, naming its key,
# rather than in every worker: c10d ranks and torch's split/chunk counts are 32-bit;
# torch.manual_seed takes 64 bits (and the per-mode generators add small offsets to the seed);
# c10d keeps a timeout as int64 nanoseconds from now; a loss scale lives in an fp32 tensor.
MAX_COUNT = 2**31 - 1
MAX_SEED = 2**63 - 1
MAX_TIMEOUT_S = 1e9  # about 31 years
MAX_LOSS_SCALE = 3.4028234663852886e38  # float32's largest finite value
MAX_MB = float(2**20)  # one terabyte, for buffer sizes in MB
Count = Annotated[int, Field(ge=1, le=MAX_COUNT)]
NonNegativeCount = Annotated[int, Field(ge=0, le=MAX_COUNT)]
Megabytes = Annotated[float, Field(gt=0, le=MAX_MB)]
LossScale = Annotated[float, Field(gt=0, le=MAX_LOSS_SCALE)]

# errors quote what they refuse, abbreviated: a value can be huge (a YAML alias, a generated list)
_QUOTE = reprlib.Repr()
_QUOTE.maxstring = _QUOTE.maxother = 160
_QUOTE.maxlist = _QUOTE.maxtuple = _QUOTE.maxdict = _QUOTE.maxset = 8
_QUOTE.maxlevel = 3
QUOTE_CHARS = 200


def quote(value: Any) -> str:
    """``repr(value)`` cut to about ``QUOTE_CHARS`` characters (without ever building it whole)."""
    text = _QUOTE.repr(value)
    return text if len(text) <= QUOTE_CHARS else text[:QUOTE_CHARS] + "..."


def _suggest(key: str, allowed: list[str]) -> str:
    close = difflib.get_close_matches(str(key)[:QUOTE_CHARS], allowed, n=1, cutoff=0.6)
    hint = f" — did you mean '{close[0]}'?" if close else ""
    return f"unknown key {quote(key)}{hint} (allowed: {', '.join(sorted(allowed))})"


class _Section(BaseModel):
    """A config section: unknown keys are errors that suggest the closest known key."""

    model_config = ConfigDict(**STRICT, extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _known_keys(cls, data: Any) -> Any:
        if isinstance(data, dict):
            allowed = list(cls.model_fields)
            for key in data:
                if key not in allowed:
                    raise ValueError(_suggest(str(key), allowed))
        return data


class TensorConfig(_Section):
    """``parallel.tensor``: how each model replica's layers are split."""

    size: Count = Field(1, description="processes in one tensor-parallel group")
    mode: Literal["1d", "2d", "2.5d", "3d", "sequence"] | None = Field(
        None, description="tensor-parallel algorithm; None means no tensor parallelism"
    )
    depth: Count = Field(1, description="2.5d only: number of q x q layers")
    ring_attention: Literal["standard", "online"] = Field(
        "standard",
        description="sequence only: 'standard' keeps S x S/N scores, 'online' uses online softmax",
    )
    plan: dict[str, str] | None = Field(
        None,
        description="module-name pattern -> style (gridtrain.config_names.STYLES); "
        "None: the model's own plan or one traced from the data flow",
    )

    @field_validator("plan")
    @classmethod
    def _known_styles(cls, plan: dict[str, str] | None) -> dict[str, str] | None:
        for pattern, style in (plan or {}).items():
            if not pattern:
                raise ValueError("a plan pattern must not be empty")
            if style not in STYLES:
                close = difflib.get_close_matches(style, list(STYLES), n=1)
                hint = f" — did you mean '{close[0]}'?" if close else ""
                raise ValueError(
                    f"plan pattern {quote(pattern)} names unknown style {quote(style)}{hint} "
                    f"(allowed: {', '.join(STYLES)})"
                )
        return plan

    @model_validator(mode="after")
    def _layout(self) -> TensorConfig:
        size, mode, depth = self.size, self.mode, self.depth
        if mode is None and size > 1:
            raise ValueError(f"tensor size {size} needs a mode, one of {', '.join(TENSOR_MODES)}")
        if depth != 1 and mode != "2.5d":
            raise ValueError(f"tensor depth {depth} is only used by mode '2.5d', got mode {mode!r}")
        if "ring_attention" in self.model_fields_set and mode != "sequence":
            raise ValueError(
                f"ring_attention={self.ring_attention!r} is only used by mode 'sequence', "
                f"got mode {mode!r}; remove it or set mode='sequence'"
            )
        if mode == "2d" and math.isqrt(size) ** 2 != size:
            raise ValueError(f"2d needs a square tensor size, got {size}")
        if mode == "2.5d":
            q2, rest = divmod(size, depth)
            if rest or math.isqrt(q2) ** 2 != q2:
                raise ValueError(
                    f"2.5d needs tensor size = depth x q^2, got size {size} with depth {depth}"
                )
        if mode == "3d" and round(size ** (1 / 3)) ** 3 != size:
            raise ValueError(f"3d needs a cubic tensor size (1, 8, 27, ...), got {size}")
        return self


class PipelineConfig(_Section):
    """``parallel.pipeline``: an int (the size) or a dict with these keys."""

    size: Count = Field(1, description="number of pipeline stages")
    num_chunks: Count = Field(
        1, description="model chunks per stage; > 1 selects the interleaved 1F1B schedule"
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


class ParallelConfig(_Section):
    """``parallel``: how the world is cut. The data-parallel size is derived."""

    pipeline: PipelineConfig = Field(default_factory=PipelineConfig)
    tensor: TensorConfig = Field(default_factory=TensorConfig)

    @field_validator("pipeline", "tensor", mode="before")
    @classmethod
    def _int_is_size(cls, value: Any) -> Any:
        return {"size": value} if isinstance(value, int) and not isinstance(value, bool) else value


class Fp16Config(_Section):
    """``fp16``: mixed precision and the dynamic loss scaler."""

    # not strict: the strings "torch", "naive", ... (YAML) are the enum's values
    mode: AMP_TYPE | None = Field(None, strict=False, description="torch, naive, apex or bf16")
    initial_scale: LossScale = Field(2.0**16, description="first loss scale")
    growth_factor: float = Field(
        2.0, gt=1, description="scale multiplier after growth_interval good steps"
    )
    backoff_factor: float = Field(0.5, gt=0, lt=1, description="scale multiplier on overflow")
    growth_interval: Count = Field(1000, description="good steps before the scale grows")
    hysteresis: Count = Field(2, description="naive: overflows tolerated before backing off")
    min_scale: LossScale = Field(1.0, description="naive: smallest loss scale")
    max_scale: LossScale = Field(2.0**32, description="naive: largest loss scale")
    verbose: bool = Field(False, description="log scale changes")
    opt_level: Literal["O0", "O1", "O2", "O3"] = Field("O1", description="apex only")

    @model_validator(mode="after")
    def _apex_installed(self) -> Fp16Config:
        if self.mode is AMP_TYPE.APEX and importlib.util.find_spec("apex") is None:
            raise ValueError(  # the same words as amp.apex_amp, which checks again
                "fp16 mode 'apex' needs NVIDIA apex, which is not installed; use "
                "fp16=dict(mode=AMP_TYPE.TORCH) (autocast + GradScaler), AMP_TYPE.NAIVE "
                "(fp16 model, fp32 master weights) or AMP_TYPE.BF16"
            )
        return self


class GradientHandlerConfig(BaseModel):
    """One entry of ``gradient_handler``: ``dict(type=name, **kwargs)``."""

    model_config = ConfigDict(**STRICT, extra="allow")
    type: str

    @field_validator("type")
    @classmethod
    def _known_type(cls, value: str) -> str:
        if value not in GRADIENT_HANDLERS:
            close = difflib.get_close_matches(value, GRADIENT_HANDLERS, n=1)
            hint = f" — did you mean '{close[0]}'?" if close else ""
            raise ValueError(
                f"unknown gradient handler {quote(value)}{hint} "
                f"(allowed: {', '.join(GRADIENT_HANDLERS)})"
            )
        return value

    @model_validator(mode="after")
    def _known_kwargs(self) -> GradientHandlerConfig:
        allowed = HANDLER_KWARGS[self.type]
        for key, value in self.kwargs.items():
            if key not in allowed:
                close = difflib.get_close_matches(key, allowed, n=1)
                hint = f" — did you mean '{close[0]}'?" if close else ""
                takes = ", ".join(allowed) if allowed else "none"
                raise ValueError(
                    f"{self.type} got unknown keyword argument {quote(key)}{hint} "
                    f"(it takes: {takes})"
                )
            if key == "bucket_size_mb" and not (
                isinstance(value, int | float)
                and not isinstance(value, bool)
                and math.isfinite(value)
                and 0 < value <= MAX_MB
            ):
                raise ValueError(
                    f"{self.type}: bucket_size_mb must be a number > 0 and <= {MAX_MB:.0f}, "
                    f"got {quote(value)}"
                )
        return self

    @property
    def kwargs(self) -> dict[str, Any]:
        return dict(self.model_extra or {})


class MoeConfig(_Section):
    """``moe``: mixture of experts."""

    expert_parallel_size: Count = Field(
        1, description="data ranks across which one layer's experts are spread"
    )
