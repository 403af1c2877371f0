"""The training engine: initialize, Engine, schedules, checkpoints, the Trainer and its hooks."""

from gridtrain.engine.checkpoint import (
    CheckpointError,
    CheckpointFuture,
    UnsafeCheckpointError,
    full_optimizer_state_dict,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
    wait_pending,
)
from gridtrain.engine.engine import Engine
from gridtrain.engine.hooks import (
    BaseHook,
    LoadCheckpointHook,
    LRSchedulerHook,
    SaveCheckpointHook,
    checkpoint_path,
    epoch_checkpoints,
    latest_checkpoint_epoch,
)
from gridtrain.engine.hooks_log import (
    CSVLogHook,
    LogMetricByEpochHook,
    LossCurveHook,
    TensorboardHook,
)
from gridtrain.engine.hooks_metrics import AccuracyHook, LossHook, ThroughputHook
from gridtrain.engine.initialize import initialize
from gridtrain.engine.metrics import MetricRecord
from gridtrain.engine.nonfinite import NonFiniteLossError
from gridtrain.engine.schedules import NonPipelineSchedule, Schedule, StepFunctions
from gridtrain.engine.trainer import Trainer

__all__ = [
    "AccuracyHook",
    "BaseHook",
    "CSVLogHook",
    "CheckpointError",
    "CheckpointFuture",
    "Engine",
    "LRSchedulerHook",
    "LoadCheckpointHook",
    "LogMetricByEpochHook",
    "LossCurveHook",
    "LossHook",
    "MetricRecord",
    "NonFiniteLossError",
    "NonPipelineSchedule",
    "SaveCheckpointHook",
    "Schedule",
    "StepFunctions",
    "TensorboardHook",
    "ThroughputHook",
    "Trainer",
    "full_optimizer_state_dict",
    "UnsafeCheckpointError",
    "checkpoint_path",
    "epoch_checkpoints",
    "initialize",
    "latest_checkpoint",
    "latest_checkpoint_epoch",
    "load_checkpoint",
    "save_checkpoint",
    "wait_pending",
]
