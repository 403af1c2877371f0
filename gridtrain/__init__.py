"""gridtrain: a config-driven engine for data, tensor, pipeline, sequence and expert parallelism.

The public names load on first use (PEP 562), so ``gridtrain --help``, the launcher and its
agent start without importing torch's distributed tensor stack; ``import gridtrain as gt``
then ``gt.initialize(...)`` behaves as an eager import would.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import TYPE_CHECKING

from gridtrain.third_party_logs import drop_known_notices

# public name -> the module that defines it (or is it, for _SUBMODULES)
_EXPORTS = {
    "data": "gridtrain.data",
    "nn": "gridtrain.nn",
    "initialize": "gridtrain.adapters",
    "Config": "gridtrain.config",
    "ConfigError": "gridtrain.config",
    "CheckpointError": "gridtrain.engine",
    "Engine": "gridtrain.engine",
    "full_optimizer_state_dict": "gridtrain.engine",
    "latest_checkpoint": "gridtrain.engine",
    "load_checkpoint": "gridtrain.engine",
    "save_checkpoint": "gridtrain.engine",
    "wait_pending": "gridtrain.engine",
    "destroy": "gridtrain.launch",
    "launch": "gridtrain.launch",
    "launch_from_openmpi": "gridtrain.launch",
    "launch_from_slurm": "gridtrain.launch",
    "launch_from_torch": "gridtrain.launch",
    "ParallelContext": "gridtrain.parallel.context",
    "get_context": "gridtrain.parallel.context",
    "full_state_dict": "gridtrain.parallel.dense_state",
    "load_full_state_dict": "gridtrain.parallel.dense_state",
    "lazy_init": "gridtrain.parallel.materialize",
    "ParallelMode": "gridtrain.parallel.mode",
    "PlanError": "gridtrain.parallel.tensor.plan",
}
_SUBMODULES = {"data", "nn"}  # names that are modules themselves (gt.launch is a function)
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
    "latest_checkpoint",
    "launch",
    "launch_from_openmpi",
    "launch_from_slurm",
    "launch_from_torch",
    "lazy_init",
    "load_checkpoint",
    "load_full_state_dict",
    "nn",
    "save_checkpoint",
    "wait_pending",
]


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'gridtrain' has no attribute {name!r}")
    loaded = importlib.import_module(module)
    value = loaded if name in _SUBMODULES else getattr(loaded, name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


class _Package(types.ModuleType):
    """Importing the submodule ``gridtrain.launch`` binds it on this package, over the
    function ``gt.launch`` an eager import gave: keep the function there."""

    def __setattr__(self, name: str, value) -> None:
        if name == "launch" and isinstance(value, types.ModuleType):
            value = value.launch
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package


if TYPE_CHECKING:  # the names as an eager import gives them, for type checkers and IDEs
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

drop_known_notices()  # before a script imports its model: see third_party_logs
