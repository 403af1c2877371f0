"""The training engine: initialize, Engine, schedules, checkpoints."""

from gridtrain.engine.checkpoint import load_checkpoint, save_checkpoint
from gridtrain.engine.engine import Engine
from gridtrain.engine.initialize import initialize
from gridtrain.engine.schedules import NonPipelineSchedule, Schedule, StepFunctions

__all__ = [
    "Engine",
    "NonPipelineSchedule",
    "Schedule",
    "StepFunctions",
    "initialize",
    "load_checkpoint",
    "save_checkpoint",
]

# Trainer and hooks (additive; see trainer.py, hooks*.py)
from gridtrain.engine.hooks import (  # noqa: E402
    BaseHook,
    LoadCheckpointHook,
    LRSchedulerHook,
    SaveCheckpointHook,
    checkpoint_path,
    latest_checkpoint_epoch,
)
from gridtrain.engine.hooks_log import (  # noqa: E402
    CSVLogHook,
    LogMetricByEpochHook,
    LossCurveHook,
    TensorboardHook,
)
from gridtrain.engine.hooks_metrics import AccuracyHook, LossHook, ThroughputHook  # noqa: E402
from gridtrain.engine.metrics import MetricRecord  # noqa: E402
from gridtrain.engine.trainer import Trainer  # noqa: E402

__all__ += [
    "AccuracyHook",
    "BaseHook",
    "CSVLogHook",
    "LRSchedulerHook",
    "LoadCheckpointHook",
    "LogMetricByEpochHook",
    "LossCurveHook",
    "LossHook",
    "MetricRecord",
    "SaveCheckpointHook",
    "TensorboardHook",
    "ThroughputHook",
    "Trainer",
    "checkpoint_path",
    "latest_checkpoint_epoch",
]
