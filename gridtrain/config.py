"""Typed configuration: a pydantic schema for every engine key, loaded from .py, .yaml or dict.

Lower-case top-level keys are engine keys; a misspelt one is an error that
suggests the closest key. UPPER_CASE keys are free user constants, readable as
attributes (``cfg.TRAIN_ITERS``).
"""

from __future__ import annotations

import difflib
import math
import runpy
import types
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    NonNegativeFloat,
    PositiveInt,
    ValidationError,
    field_validator,
    model_validator,
)

from gridtrain.amp.types import AMP_TYPE

TENSOR_MODES = ("1d", "2d", "2.5d", "3d", "sequence")
GRADIENT_HANDLERS = (
    "DataParallelGradientHandler",
    "SequenceParallelGradientHandler",
    "PipelineSharedModuleGradientHandler",
    "MoeGradientHandler",
)


class ConfigError(ValueError):
    """A config that cannot run; the message names the key, the value and what is allowed."""


def _suggest(key: str, allowed: list[str]) -> str:
    close = difflib.get_close_matches(key, allowed, n=1, cutoff=0.6)
    hint = f" — did you mean '{close[0]}'?" if close else ""
    return f"unknown key '{key}'{hint} (allowed: {', '.join(sorted(allowed))})"


class _Section(BaseModel):
    """A config section: unknown keys are errors that suggest the closest known key."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

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

    size: PositiveInt = Field(1, description="processes in one tensor-parallel group")
    mode: Literal["1d", "2d", "2.5d", "3d", "sequence"] | None = Field(
        None, description="tensor-parallel algorithm; None means no tensor parallelism"
    )
    depth: PositiveInt = Field(1, description="2.5d only: number of q x q layers")
    ring_attention: Literal["standard", "online"] = Field(
        "standard",
        description="sequence only: 'standard' keeps S x S/N scores, 'online' uses online softmax",
    )

    @model_validator(mode="after")
    def _layout(self) -> TensorConfig:
        size, mode, depth = self.size, self.mode, self.depth
        if mode is None and size > 1:
            raise ValueError(f"tensor size {size} needs a mode, one of {', '.join(TENSOR_MODES)}")
        if depth != 1 and mode != "2.5d":
            raise ValueError(f"tensor depth {depth} is only used by mode '2.5d', got mode {mode!r}")
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

    size: PositiveInt = Field(1, description="number of pipeline stages")
    num_chunks: PositiveInt = Field(
        1, description="model chunks per stage; > 1 selects the interleaved 1F1B schedule"
    )
    partition: Literal["uniform", "parameters"] = Field(
        "uniform", description="cut layers evenly by count, or balance parameter counts"
    )
    tensor_shape: tuple[int, ...] | None = Field(
        None, description="fixed activation shape between stages; None exchanges shapes"
    )


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

    mode: AMP_TYPE | None = Field(None, description="torch, naive, apex or bf16")
    initial_scale: float = Field(2.0**16, gt=0, description="first loss scale")
    growth_factor: float = Field(
        2.0, gt=1, description="scale multiplier after growth_interval good steps"
    )
    backoff_factor: float = Field(0.5, gt=0, lt=1, description="scale multiplier on overflow")
    growth_interval: PositiveInt = Field(1000, description="good steps before the scale grows")
    hysteresis: PositiveInt = Field(2, description="naive: overflows tolerated before backing off")
    min_scale: float = Field(1.0, gt=0, description="naive: smallest loss scale")
    max_scale: float = Field(2.0**32, gt=0, description="naive: largest loss scale")
    verbose: bool = Field(False, description="log scale changes")
    opt_level: Literal["O0", "O1", "O2", "O3"] = Field("O1", description="apex only")


class GradientHandlerConfig(BaseModel):
    """One entry of ``gradient_handler``: ``dict(type=name, **kwargs)``."""

    model_config = ConfigDict(extra="allow")
    type: str

    @field_validator("type")
    @classmethod
    def _known_type(cls, value: str) -> str:
        if value not in GRADIENT_HANDLERS:
            close = difflib.get_close_matches(value, GRADIENT_HANDLERS, n=1)
            hint = f" — did you mean '{close[0]}'?" if close else ""
            raise ValueError(
                f"unknown gradient handler '{value}'{hint} (allowed: {', '.join(GRADIENT_HANDLERS)})"
            )
        return value

    @property
    def kwargs(self) -> dict[str, Any]:
        return dict(self.model_extra or {})


class MoeConfig(_Section):
    """``moe``: mixture of experts."""

    expert_parallel_size: PositiveInt = Field(
        1, description="data ranks across which one layer's experts are spread"
    )


class Config(BaseModel):
    """The validated config. Engine keys are typed fields; UPPER_CASE keys are user constants."""

    model_config = ConfigDict(extra="allow", validate_assignment=True)

    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    fp16: Fp16Config | None = Field(None, description="mixed precision; None trains in fp32")
    gradient_handler: list[GradientHandlerConfig] = Field(
        default_factory=list, description="handlers run after backward; [] picks the default"
    )
    gradient_accumulation: PositiveInt = Field(1, description="micro-steps per optimizer step")
    clip_grad_norm: NonNegativeFloat = Field(0.0, description="max global grad norm; 0 = off")
    num_microbatches: PositiveInt | None = Field(
        None, description="pipeline micro-batches per batch (legacy NUM_MICRO_BATCHES too)"
    )
    seed: int | None = Field(None, description="overrides the seed given to launch()")
    cudnn_benchmark: bool = Field(False, description="torch.backends.cudnn.benchmark")
    cudnn_deterministic: bool = Field(False, description="torch.backends.cudnn.deterministic")
    moe: MoeConfig = Field(default_factory=MoeConfig)
    source: str | None = Field(None, description="set by from_file: the path it came from")

    @model_validator(mode="before")
    @classmethod
    def _split_keys(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        allowed = [k for k in cls.model_fields]
        for key in data:
            if not isinstance(key, str):
                raise ValueError(f"config keys must be strings, got {key!r}")
            if key not in allowed and not key.isupper():
                raise ValueError(_suggest(key, allowed))
        if data.get("num_microbatches") is None and "NUM_MICRO_BATCHES" in data:
            data = {**data, "num_microbatches": data["NUM_MICRO_BATCHES"]}
        return data

    # ---- loading -------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Config:
        """Validate a plain dict; raises ``ConfigError`` naming the offending key."""
        try:
            return cls.model_validate(data)
        except ValidationError as err:
            raise ConfigError(_explain(err)) from None

    @classmethod
    def from_file(cls, path: str | Path) -> Config:
        """Load a ``.py`` (module globals), ``.yaml`` or ``.yml`` config."""
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file '{path}' does not exist")
        if path.suffix == ".py":
            data = {
                k: v
                for k, v in runpy.run_path(str(path)).items()
                if not k.startswith("_")
                and not isinstance(v, types.ModuleType | types.FunctionType | type)
            }
        elif path.suffix in (".yaml", ".yml"):
            data = yaml.safe_load(path.read_text()) or {}
            if not isinstance(data, dict):
                raise ConfigError(
                    f"config file '{path}' must hold a mapping, got {type(data).__name__}"
                )
        else:
            raise ConfigError(f"config file '{path}' must end in .py, .yaml or .yml")
        data.setdefault("source", str(path))
        return cls.from_dict(data)

    @classmethod
    def load(cls, config: Config | dict | str | Path | None) -> Config:
        """Accept a Config, a dict, a path, or None (an empty config)."""
        if isinstance(config, Config):
            return config
        if config is None:
            return cls()
        if isinstance(config, dict):
            return cls.from_dict(config)
        return cls.from_file(config)

    # ---- derived sizes -------------------------------------------------------------------
    @property
    def pipeline_size(self) -> int:
        return self.parallel.pipeline.size

    @property
    def tensor_size(self) -> int:
        return self.parallel.tensor.size

    @property
    def tensor_mode(self) -> str | None:
        return self.parallel.tensor.mode

    def data_size(self, world_size: int) -> int:
        """The data-parallel size world / (pipeline x tensor); raises if it does not divide."""
        self.check_world_size(world_size)
        return world_size // (self.pipeline_size * self.tensor_size)

    def check_world_size(self, world_size: int) -> None:
        """Every check that needs the world size, made before any process group exists."""
        p, t = self.pipeline_size, self.tensor_size
        if world_size < 1:
            raise ConfigError(f"world size must be >= 1, got {world_size}")
        if world_size % (p * t):
            raise ConfigError(
                f"world size {world_size} is not divisible by pipeline {p} x tensor {t}"
            )
        data, ep = world_size // (p * t), self.moe.expert_parallel_size
        if data % ep:
            raise ConfigError(
                f"moe.expert_parallel_size {ep} must divide the data-parallel size {data} "
                f"(world {world_size} / (pipeline {p} x tensor {t}))"
            )

    def user_constants(self) -> dict[str, Any]:
        """The UPPER_CASE keys, as given."""
        return dict(self.model_extra or {})


def _explain(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"])
        msg = e["msg"].removeprefix("Value error, ")
        where = f"key '{loc}': " if loc else ""
        got = f" (got {e['input']!r})" if e["type"] not in ("value_error", "missing") else ""
        lines.append(f"{where}{msg}{got}")
    return "invalid config: " + "; ".join(lines)
