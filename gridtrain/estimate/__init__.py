"""``gridtrain estimate``: per-rank memory, communication and step time of any model and layout,
at any world size, on one CPU, and a search over layouts.

The per-rank parameter shapes come from the engine's own tensor planner run on a
meta-device model with a process-free ``Layout`` (``shards.py``); activations,
collectives and time follow each mode's forward code (``memory.py``,
``communication.py``, ``timing.py``). ``cli.py`` is the command line.
"""

from gridtrain.estimate.devices import PRESETS as DEVICES
from gridtrain.estimate.devices import DeviceSpec, get_device
from gridtrain.estimate.estimator import Estimate, estimate
from gridtrain.estimate.model_files import from_hf_config, get_model
from gridtrain.estimate.models import PRESETS as MODELS
from gridtrain.estimate.models import ModelSpec
from gridtrain.estimate.scenario import EstimateError, Scenario
from gridtrain.estimate.search import SearchOptions, search
from gridtrain.estimate.shards import tensor_shards

__all__ = [
    "DEVICES",
    "MODELS",
    "DeviceSpec",
    "Estimate",
    "EstimateError",
    "ModelSpec",
    "Scenario",
    "SearchOptions",
    "estimate",
    "from_hf_config",
    "get_device",
    "get_model",
    "search",
    "tensor_shards",
]
