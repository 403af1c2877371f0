"""gridtrain: a config-driven engine for data, tensor, pipeline, sequence and expert parallelism."""

from gridtrain import data, nn
from gridtrain.adapters import initialize
from gridtrain.config import Config, ConfigError
from gridtrain.engine import (
    CheckpointError,
    Engine,
    full_optimizer_state_dict,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
    wait_pending,
)
from gridtrain.launch import (
    destroy,
    launch,
    launch_from_openmpi,
    launch_from_slurm,
    launch_from_torch,
)
from gridtrain.parallel.context import ParallelContext, get_context
from gridtrain.parallel.dense_state import full_state_dict, load_full_state_dict
from gridtrain.parallel.materialize import lazy_init
from gridtrain.parallel.mode import ParallelMode
from gridtrain.parallel.tensor.plan import PlanError
from gridtrain.third_party_logs import drop_known_notices

__all__ = [
    "CheckpointError",
    "Config",
    "ConfigError",
    "Engine",
    "ParallelContext",
    "ParallelMode",
    "PlanError",
    "data",
    "destroy",
    "full_optimizer_state_dict",
    "full_state_dict",
    "get_context",
    "initialize",
    "launch",
    "launch_from_openmpi",
    "launch_from_slurm",
    "latest_checkpoint",
    "launch_from_torch",
    "lazy_init",
    "nn",
    "load_checkpoint",
    "load_full_state_dict",
    "save_checkpoint",
    "wait_pending",
]

drop_known_notices()  # before a script imports its model: see third_party_logs
