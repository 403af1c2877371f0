"""Typed configuration: a pydantic schema for every engine key, loaded from .py, .yaml or dict.

One module per section (``parallel``, ``tensor``, ``pipeline``, ``fp16``, ``zero``, ``moe``,
``gradient_handlers``, ``compile``, ``attention``, ``chunked_loss``,
``activation_checkpoint``, ``fp8``), the root with the top-level keys (``schema``), file
reading with the strict YAML loader (``loading``), the bounds every number is held to
(``limits``) and the error type with its quoting and suggestions (``errors``). This package
imports nothing else of gridtrain but the tensor modes' torch-free geometry
(``gridtrain.parallel.tensor.modes``: mode names, size rules); every other layer imports
what it needs from here.
"""

from gridtrain.config.activation_checkpoint import ActivationCheckpointConfig
from gridtrain.config.attention import AttentionConfig
from gridtrain.config.chunked_loss import ChunkedLossConfig
from gridtrain.config.compile import CompileConfig
from gridtrain.config.env import CONFIG_ENV
from gridtrain.config.errors import ConfigError, quote
from gridtrain.config.fp8 import Fp8Config
from gridtrain.config.fp16 import AMP_TYPE, Fp16Config
from gridtrain.config.gradient_handlers import (
    GRADIENT_HANDLERS,
    HANDLER_KWARGS,
    GradientHandlerConfig,
)
from gridtrain.config.limits import MAX_SEED, MAX_TIMEOUT_S
from gridtrain.config.moe import MoeConfig
from gridtrain.config.parallel import ParallelConfig
from gridtrain.config.pipeline import PipelineConfig
from gridtrain.config.schema import Config
from gridtrain.config.tensor import STYLES, TENSOR_MODES, TensorConfig
from gridtrain.config.zero import ZeroConfig

__all__ = [
    "CONFIG_ENV",
    "AMP_TYPE",
    "GRADIENT_HANDLERS",
    "HANDLER_KWARGS",
    "MAX_SEED",
    "MAX_TIMEOUT_S",
    "STYLES",
    "TENSOR_MODES",
    "ActivationCheckpointConfig",
    "AttentionConfig",
    "ChunkedLossConfig",
    "CompileConfig",
    "Config",
    "ConfigError",
    "Fp8Config",
    "Fp16Config",
    "GradientHandlerConfig",
    "MoeConfig",
    "ParallelConfig",
    "PipelineConfig",
    "TensorConfig",
    "ZeroConfig",
    "quote",
]
