"""gridtrain: a config-driven engine for data, tensor, pipeline, sequence and expert parallelism."""

from gridtrain.config import Config, ConfigError
from gridtrain.launch import launch, launch_from_openmpi, launch_from_slurm, launch_from_torch
from gridtrain.parallel.context import ParallelContext, destroy, get_context
from gridtrain.parallel.mode import ParallelMode

__all__ = [
    "Config",
    "ConfigError",
    "ParallelContext",
    "ParallelMode",
    "destroy",
    "get_context",
    "launch",
    "launch_from_openmpi",
    "launch_from_slurm",
    "launch_from_torch",
]
