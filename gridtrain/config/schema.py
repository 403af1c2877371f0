"""The root of the config: every top-level engine key, the checks that span sections, and
the sizes derived from them.

Lower-case top-level keys are engine keys; a misspelt one is an error that suggests the
closest key. UPPER_CASE keys are free user constants, readable as attributes
(``cfg.TRAIN_ITERS``). Each section's schema lives in its own module of this package.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    NonNegativeFloat,
    ValidationError,
    model_validator,
)

from gridtrain.config.activation_checkpoint import ActivationCheckpointConfig
from gridtrain.config.attention import AttentionConfig
from gridtrain.config.chunked_loss import ChunkedLossConfig
from gridtrain.config.compile import CompileConfig
from gridtrain.config.errors import ConfigError, explain, quote, unknown_key
from gridtrain.config.fp8 import Fp8Config
from gridtrain.config.fp16 import Fp16Config
from gridtrain.config.gradient_handlers import GradientHandlerConfig
from gridtrain.config.limits import MAX_SEED, MAX_TIMEOUT_S, STRICT, Count, NonNegativeCount
from gridtrain.config.loading import read_config_file
from gridtrain.config.moe import MoeConfig
from gridtrain.config.parallel import ParallelConfig
from gridtrain.config.zero import ZeroConfig

if TYPE_CHECKING:
    from gridtrain.config.tensor import ModeGeometry


class Config(BaseModel):
    """The validated config. Engine keys are typed fields; UPPER_CASE keys are user constants."""

    # extra keys are the UPPER_CASE user constants (_split_keys refuses any other)
    model_config = ConfigDict(**STRICT, extra="allow")

    parallel: ParallelConfig = Field(
        default_factory=ParallelConfig,
        description="how the world is cut into pipeline stages and tensor groups",
    )
    fp16: Fp16Config | None = Field(None, description="mixed precision; None trains in fp32")
    gradient_handler: list[GradientHandlerConfig] = Field(
        default_factory=list, description="handlers run after backward; [] picks the default"
    )
    gradient_accumulation: Count = Field(1, description="micro-steps per optimizer step")
    clip_grad_norm: NonNegativeFloat = Field(0.0, description="max global grad norm; 0 = off")
    num_microbatches: Count | None = Field(
        None, description="pipeline micro-batches per batch (legacy NUM_MICRO_BATCHES too)"
    )
    seed: Annotated[int, Field(ge=0, le=MAX_SEED)] | None = Field(
        None, description="overrides the seed given to launch() (0 to 2**63 - 1)"
    )
    cudnn_benchmark: bool = Field(False, description="torch.backends.cudnn.benchmark")
    cudnn_deterministic: bool = Field(False, description="torch.backends.cudnn.deterministic")
    moe: MoeConfig = Field(default_factory=MoeConfig, description="mixture of experts")
    zero: ZeroConfig | None = Field(
        None, description="ZeRO stage 1|2|3 (+ offload); None: plain data parallelism"
    )
    chunked_loss: ChunkedLossConfig | None = Field(
        None, description="LM head + cross entropy in token chunks; None: whole logits"
    )
    compile: CompileConfig | Literal[False] | None = Field(
        None,
        description="torch.compile per transformer block and the loss; None: on for a CUDA "
        "device (compute capability 7.0+, Triton installed), eager on the CPU; False: eager",
    )
    attention: AttentionConfig | Literal[False] | None = Field(
        None,
        description="SDPA kernel preference; None: cuDNN first on compute capability 9.0+, "
        "torch's own order elsewhere; False: torch's own order",
    )
    fused_optimizer: bool | None = Field(
        None,
        description="switch a torch Adam/AdamW/SGD built with neither fused nor foreach to "
        "fused=True where torch has the kernel for its parameters; None: on a CUDA device only",
    )
    activation_checkpoint: ActivationCheckpointConfig | None = Field(
        None, description="recompute each block in the backward; None: keep activations"
    )
    fp8: Fp8Config | None = Field(
        None, description="float8 Linear matmuls (torchao); None: the fp16 section's precision"
    )
    max_nonfinite_steps: NonNegativeCount = Field(
        3,
        description="consecutive steps with a non-finite loss or gradient norm before training "
        "stops (each is skipped on every rank); 0 = never stop",
    )
    timeout_s: Annotated[float, Field(gt=0, le=MAX_TIMEOUT_S)] = Field(
        600.0,
        description="collective timeout in seconds (init_process_group and every group); at "
        "most 1e9 (c10d counts int64 nanoseconds)",
    )
    source: str | None = Field(None, description="set by from_file: the path it came from")

    @model_validator(mode="before")
    @classmethod
    def _split_keys(cls, data: Any) -> Any:
        """Engine keys must be known (a misspelling is an error, never a user constant);
        UPPER_CASE keys pass as user constants."""
        if not isinstance(data, dict):
            return data
        allowed = [k for k in cls.model_fields]
        for key in data:
            if not isinstance(key, str):
                raise ValueError(f"config keys must be strings, got {quote(key)}")
            if key not in allowed and not key.isupper():
                raise ValueError(unknown_key(key, allowed))
        if data.get("num_microbatches") is None and "NUM_MICRO_BATCHES" in data:
            data = {**data, "num_microbatches": data["NUM_MICRO_BATCHES"]}
        return data

    @model_validator(mode="after")
    def _consistent(self) -> Config:
        """The pairings of sections that cannot run together, each checked by its section."""
        if self.fp8 is not None:
            amp = self.fp16.mode if self.fp16 is not None else None
            amp = getattr(amp, "value", amp)  # an AMP_TYPE member or its string
            self.fp8.check_with(self.parallel.tensor.mode, amp)
        if self.chunked_loss is not None and self.zero is not None:
            self.chunked_loss.check_zero_stage(self.zero.stage)
        self.parallel.pipeline.check_microbatches(self.num_microbatches)
        return self

    # ---- loading -------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Config:
        """Validate a plain dict; raises ``ConfigError`` naming the offending key."""
        try:
            return cls.model_validate(data)
        except ValidationError as err:
            raise ConfigError(explain(err)) from None

    @classmethod
    def from_file(cls, path: str | Path) -> Config:
        """Load a ``.py`` (module globals), ``.yaml`` or ``.yml`` config."""
        path = Path(path)
        data = read_config_file(path)
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
        """Pipeline stages (``parallel.pipeline.size``)."""
        return self.parallel.pipeline.size

    @property
    def tensor_size(self) -> int:
        """Processes in one tensor group (``parallel.tensor.size``)."""
        return self.parallel.tensor.size

    @property
    def tensor_mode(self) -> str | None:
        """The tensor-parallel mode (``parallel.tensor.mode``), None without one."""
        return self.parallel.tensor.mode

    @property
    def tensor_geometry(self) -> ModeGeometry:
        """The tensor mode's torch-free geometry: its groups, sizes and cost formulas."""
        return self.parallel.tensor.geometry

    def data_size(self, world_size: int) -> int:
        """The data-parallel size world / (pipeline x tensor); raises if it does not divide."""
        self.check_world_size(world_size)
        return world_size // (self.pipeline_size * self.tensor_size)

    def check_run(self, world_size: int) -> None:
        """What ``gridtrain run`` checks before it starts anything: the layout for
        ``world_size`` and what the engine will need (``num_microbatches`` for a pipeline).

        ``launch()`` checks only the layout, since a pipeline group may be used
        without the engine's schedule; ``gt.initialize`` checks the rest again.
        """
        self.check_world_size(world_size)
        p = self.pipeline_size
        if p > 1 and self.num_microbatches is None:
            raise ConfigError(  # the same words as gt.initialize uses
                f"parallel.pipeline = {p} needs num_microbatches in the config "
                f"(e.g. num_microbatches = {2 * p})"
            )

    def check_world_size(self, world_size: int) -> None:
        """Every layout check that needs the world size, made before any process group exists."""
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
