"""Typed configuration: a pydantic schema for every engine key, loaded from .py, .yaml or dict.

Lower-case top-level keys are engine keys; a misspelt one is an error that
suggests the closest key. UPPER_CASE keys are free user constants, readable as
attributes (``cfg.TRAIN_ITERS``). The sections live in ``config_sections``.
"""

from __future__ import annotations

import difflib
import runpy
import traceback
import types
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    NonNegativeFloat,
    ValidationError,
    model_validator,
)

from gridtrain.config_sections import (
    GRADIENT_HANDLERS,
    HANDLER_KWARGS,
    MAX_MB,
    MAX_SEED,
    MAX_TIMEOUT_S,
    STRICT,
    TENSOR_MODES,
    Count,
    Fp16Config,
    GradientHandlerConfig,
    Megabytes,
    MoeConfig,
    NonNegativeCount,
    ParallelConfig,
    PipelineConfig,
    TensorConfig,
    _Section,
    _suggest,
    quote,
)

__all__ = [
    "GRADIENT_HANDLERS",
    "HANDLER_KWARGS",
    "TENSOR_MODES",
    "Config",
    "ConfigError",
    "Fp16Config",
    "GradientHandlerConfig",
    "MoeConfig",
    "ParallelConfig",
    "PipelineConfig",
    "TensorConfig",
    "ZeroConfig",
    "ChunkedLossConfig",
    "CompileConfig",
    "AttentionConfig",
    "Fp8Config",
    "ActivationCheckpointConfig",
]


class ZeroConfig(_Section):
    """``zero``: ZeRO sharding over each parameter's data-parallel group
    (``gridtrain.parallel.zero``); an int is the stage."""

    stage: Literal[1, 2, 3] = Field(
        description="1: optimizer state (and fp32 masters), 2: also gradients, 3: also "
        "parameters (FSDP2)"
    )
    offload: bool = Field(
        False,
        description="keep optimizer state and fp32 masters in CPU memory and step there; at "
        "stage 3 (Gemini) the device keeps only compute-dtype parameters, where they fit",
    )
    bucket_size_mb: Megabytes = Field(
        25.0, description="stages 1-2: size of one reduce-scatter / all-gather bucket"
    )
    device_param_mb: Annotated[float, Field(ge=0, le=MAX_MB)] | None = Field(
        None,
        description="stage 3 offload: MiB of compute-dtype parameters kept on the device, "
        "chunk by chunk in forward order (the rest stream); None: 55% of the CUDA memory limit",
    )
    delayed_update: bool = Field(
        False,
        description="stage 3 offload: ZeRO-Offload's one-step delayed parameter update (the "
        "host step overlaps the next forward and backward; gradients are one step stale)",
    )

    @model_validator(mode="before")
    @classmethod
    def _int_is_stage(cls, data: Any) -> Any:
        return {"stage": data} if isinstance(data, int) and not isinstance(data, bool) else data

    @model_validator(mode="after")
    def _offload_keys(self) -> ZeroConfig:
        gemini = self.stage == 3 and self.offload
        for key in ("device_param_mb", "delayed_update"):
            if getattr(self, key) not in (None, False) and not gemini:
                raise ValueError(
                    f"zero.{key} applies to stage 3 with offload=True (Gemini), got stage "
                    f"{self.stage}, offload {self.offload}"
                )
        return self


class _SwitchSection(_Section):
    """A section that can also be switched on with ``True`` (which takes its defaults)."""

    @model_validator(mode="before")
    @classmethod
    def _true_is_default(cls, data: Any) -> Any:
        return {} if data is True else data


class ChunkedLossConfig(_SwitchSection):
    """``chunked_loss``: the LM head and its cross entropy in token chunks
    (``gridtrain.parallel.tensor.chunked_loss``); ``True`` takes the defaults."""

    chunk_tokens: Count = Field(
        8192, description="tokens per chunk: one chunk's logits exist at a time"
    )
    recompute: bool = Field(
        False,
        description="False: each chunk's gradients are taken in the forward and only scaled in "
        "the backward (no matmul twice; keeps a hidden-sized gradient and the head weight's; "
        "fp16 runs always recompute, as a chunk's weight gradient could overflow fp16); True: "
        "recompute each chunk's logits in the backward (one more head matmul, least memory)",
    )


class CompileConfig(_SwitchSection):
    """``compile``: torch.compile per repeated block (``gridtrain.engine.compile``);
    ``True`` takes the defaults."""

    backend: str = Field(
        "inductor", description="torch.compile backend: inductor, aot_eager, eager, ..."
    )
    mode: (
        Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"] | None
    ) = Field(None, description="torch.compile mode (None: the backend's default)")
    fullgraph: bool = Field(False, description="fail on a graph break inside a block")
    dynamic: bool | None = Field(
        None, description="dynamic shapes: None lets torch decide after a shape change"
    )
    per_block: bool | None = Field(
        None,
        description="compile each entry of the model's block list (transformer.h, layers); "
        "False: the whole model; None: per block where tensor or pipeline parallelism or ZeRO "
        "3 put collectives or hooks in the model, else whole",
    )
    loss: bool | None = Field(
        None,
        description="compile the criterion too, so the LM head's cross entropy reads the bf16 "
        "logits once and never writes them in fp32; None: unless a tensor mode or chunked_loss "
        "puts collectives or deferred logits in it",
    )
    options: dict[str, Any] | None = Field(
        None,
        description="backend options passed to torch.compile(options=...), e.g. inductor's "
        "{'coordinate_descent_tuning': True}; not together with mode",
    )

    @model_validator(mode="after")
    def _options_known(self) -> CompileConfig:
        if self.options is None:
            return self
        if self.mode is not None:
            raise ValueError(
                f"compile.mode ({self.mode!r}) and compile.options cannot both be set (torch."
                "compile takes one): a mode is a preset of options, so give its options instead"
            )
        if self.backend == "inductor":
            import torch._inductor

            known = set(torch._inductor.list_options())
            # torch.compile reads 'a-b' as 'a_b'
            unknown = sorted(k for k in self.options if k.replace("-", "_") not in known)
            if unknown:
                close = difflib.get_close_matches(unknown[0], known, n=1, cutoff=0.6)
                hint = f" (did you mean '{close[0]}'?)" if close else ""
                raise ValueError(
                    f"compile.options: unknown inductor option {unknown[0]!r}{hint}; "
                    "torch._inductor.list_options() lists the allowed ones"
                )
        return self


SDPA_BACKENDS = ("cudnn", "flash", "efficient", "math")


class AttentionConfig(_Section):
    """``attention``: which fused attention kernels ``scaled_dot_product_attention`` may use
    (``gridtrain.engine.sdpa``), in order of preference."""

    backends: list[Literal["cudnn", "flash", "efficient", "math"]] = Field(
        min_length=1,
        description=f"kernels to allow, first preferred, from {list(SDPA_BACKENDS)}; cuDNN "
        "first is fastest on Hopper",
    )


class ActivationCheckpointConfig(_SwitchSection):
    """``activation_checkpoint``: recompute blocks' activations in the backward
    (``gridtrain.engine.recompute``); ``True`` takes the defaults."""

    every: Count = Field(
        1,
        description="checkpoint every n-th block of the model's block list (1: all, full recompute)",
    )


FP8_RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")


class Fp8Config(_SwitchSection):
    """``fp8``: float8 matmuls in the model's ``nn.Linear`` layers through torchao's float8
    training (``gridtrain.amp.fp8``); ``True`` takes the defaults. Off when absent."""

    recipe: Literal[FP8_RECIPES] = Field(
        "tensorwise",
        description=f"torchao scaling recipe, from {list(FP8_RECIPES)}: one scale per tensor "
        "(fastest), per row, or per row with the weight gradient in high precision",
    )
    skip: list[str] = Field(
        default_factory=lambda: ["*lm_head", "*output", "*head", "*gate", "*router"],
        description="fnmatch patterns of Linear names kept in high precision (the LM head's "
        "logits and an MoE router's scores are the most precision-sensitive; a head tied to "
        "an embedding is always kept)",
    )
    min_features: Count = Field(
        256, description="Linear layers with fewer input or output features stay high precision"
    )


class ConfigError(ValueError):
    """A config that cannot run; the message names the key, the value and what is allowed."""


class Config(BaseModel):
    """The validated config. Engine keys are typed fields; UPPER_CASE keys are user constants."""

    model_config = ConfigDict(**STRICT, extra="allow")

    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
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
    moe: MoeConfig = Field(default_factory=MoeConfig)
    zero: ZeroConfig | None = Field(
        None, description="ZeRO stage 1|2|3 (+ offload); None: plain data parallelism"
    )
    chunked_loss: ChunkedLossConfig | None = Field(
        None, description="LM head + cross entropy in token chunks; None: whole logits"
    )
    compile: CompileConfig | None = Field(
        None, description="torch.compile per transformer block; None: eager"
    )
    attention: AttentionConfig | None = Field(
        None, description="SDPA kernel preference; None: torch's default choice"
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
        if not isinstance(data, dict):
            return data
        allowed = [k for k in cls.model_fields]
        for key in data:
            if not isinstance(key, str):
                raise ValueError(f"config keys must be strings, got {quote(key)}")
            if key not in allowed and not key.isupper():
                raise ValueError(_suggest(key, allowed))
        if data.get("num_microbatches") is None and "NUM_MICRO_BATCHES" in data:
            data = {**data, "num_microbatches": data["NUM_MICRO_BATCHES"]}
        return data

    @model_validator(mode="after")
    def _consistent(self) -> Config:
        if self.fp8 is not None:
            if self.parallel.tensor.mode is not None:
                raise ValueError(
                    f"fp8 converts the model's nn.Linear layers; parallel.tensor.mode "
                    f"{self.parallel.tensor.mode!r} replaces them with its own: use fp8 with "
                    "data, pipeline or ZeRO parallelism (parallel.tensor.mode None)"
                )
            amp = self.fp16.mode if self.fp16 is not None else None
            amp = getattr(amp, "value", amp)  # an AMP_TYPE member or its string
            if amp is not None and str(amp) != "bf16":
                raise ValueError(
                    f"fp8 runs under bf16 or fp32: fp16.mode must be 'bf16' or None, got {amp!r}"
                )
        if self.chunked_loss is not None and self.zero is not None and self.zero.stage == 3:
            raise ValueError(
                "chunked_loss computes the LM head after the model's forward, when ZeRO stage 3 "
                "(FSDP2) has already freed the head's gathered weights: use chunked_loss with "
                "zero.stage 1 or 2, or zero.stage 3 without chunked_loss"
            )
        pipeline, m = self.parallel.pipeline, self.num_microbatches
        if pipeline.num_chunks > 1 and m is not None and m % pipeline.size:
            raise ValueError(  # the same words as pipeline.schedule.check_interleaved
                f"the interleaved schedule (parallel.pipeline.num_chunks={pipeline.num_chunks}) "
                "needs num_microbatches divisible by the pipeline size: num_microbatches "
                f"{m} % pipeline {pipeline.size} != 0"
            )
        return self

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
                for k, v in _run_config(path).items()
                if not k.startswith("_")
                and not isinstance(v, types.ModuleType | types.FunctionType | type)
            }
        elif path.suffix in (".yaml", ".yml"):
            data = _load_yaml(path) or {}
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


def _run_config(path: Path) -> dict[str, Any]:
    """A ``.py`` config's globals; whatever it raises (``sys.exit`` too) becomes a ConfigError."""
    try:
        return runpy.run_path(str(path))
    except (Exception, SystemExit) as err:  # noqa: BLE001 - a config is user code
        lines = [
            f.lineno for f in traceback.extract_tb(err.__traceback__) if f.filename == str(path)
        ]
        where = f" at line {lines[-1]}" if lines else ""
        raise ConfigError(
            f"config file '{path}' raised {quote(err)}{where} while loading; a config must only "
            "assign its keys"
        ) from None


# ---- YAML ------------------------------------------------------------------------------------
MAX_ALIAS_VALUES = 10_000  # values that aliases may repeat, all together: configs need few


class _YamlError(Exception):
    pass


class StrictYamlLoader(yaml.SafeLoader):
    """PyYAML's safe loader that refuses duplicate keys (the first would be dropped silently)
    and aliases that repeat more than ``MAX_ALIAS_VALUES`` values (a few hundred bytes of
    nested aliases expand to billions, and every walk over them, an error's quote too, takes
    as long)."""

    def __init__(self, stream) -> None:
        super().__init__(stream)
        self._sizes: dict[int, int] = {}
        self._repeated = 0

    def _size(self, node: yaml.Node) -> int:
        if id(node) not in self._sizes:  # a node may appear many times; count it once here
            children = node.value if isinstance(node, yaml.SequenceNode) else []
            if isinstance(node, yaml.MappingNode):
                children = [n for pair in node.value for n in pair]
            self._sizes[id(node)] = 1 + sum(self._size(child) for child in children)
        return self._sizes[id(node)]

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            node = self.anchors.get(event.anchor)
            if node is not None:
                self._repeated += self._size(node)
                if self._repeated > MAX_ALIAS_VALUES:
                    raise _YamlError(
                        f"the alias *{quote(event.anchor)[1:-1]} at line "
                        f"{event.start_mark.line + 1} makes aliases repeat more than "
                        f"{MAX_ALIAS_VALUES} values; write the values out"
                    )
        return super().compose_node(parent, index)

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen: dict[Any, int] = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue  # '<<' merges are meant to be overridden
                key = self.construct_object(key_node, deep=True)
                line = key_node.start_mark.line + 1
                try:
                    first = seen.setdefault(key, line)
                except TypeError:
                    continue  # unhashable: the constructor itself refuses it
                if first != line:
                    raise _YamlError(
                        f"duplicate key {quote(key)} at line {line} (first at line {first}); "
                        "YAML would keep only the last"
                    )
        return super().construct_mapping(node, deep)


def _load_yaml(path: Path) -> Any:
    """``path``'s YAML through ``StrictYamlLoader``; every failure a ``ConfigError``."""
    try:
        return yaml.load(path.read_text(), Loader=StrictYamlLoader)  # noqa: S506 - safe loader
    except _YamlError as err:
        raise ConfigError(f"config file '{path}': {err}") from None
    except (yaml.YAMLError, RecursionError) as err:
        text = str(err)
        text = text if len(text) <= 400 else text[:400] + "..."
        raise ConfigError(f"config file '{path}' is not valid YAML: {text}") from None


def _explain(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"])
        msg = e["msg"].removeprefix("Value error, ")
        where = f"key '{loc}': " if loc else ""
        got = ""
        if e["type"] not in ("value_error", "missing"):
            got = f" (got {quote(e['input'])}{_type_hint(e['input'])})"
        lines.append(f"{where}{msg}{got}")
    return "invalid config: " + "; ".join(lines)


def _type_hint(value: Any) -> str:
    if isinstance(value, bool):
        return ", a bool"
    if isinstance(value, str):
        try:
            float(value)
        except ValueError:
            return ""
        return ", a string; write numbers unquoted (YAML reads 1e-3 as a string: write 1.0e-3)"
    return ""
