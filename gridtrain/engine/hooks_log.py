"""Logging hooks: console lines per epoch, TensorBoard, CSV and a loss-curve PNG.

They only read the trainer's metric records, which the metric hooks made equal
on every rank, so they write from global rank 0 alone and run no collectives.
Give them a higher priority than the metric hooks (the default 10 does).
"""

from __future__ import annotations

import csv
import logging
from pathlib import Path
from typing import TYPE_CHECKING

from gridtrain.engine.hooks import BaseHook
from gridtrain.engine.metrics import MetricRecord

if TYPE_CHECKING:
    from gridtrain.engine.trainer import Trainer

logger = logging.getLogger("gridtrain")


def _fmt(value: float) -> str:
    return f"{value:.4g}" if abs(value) < 1e4 else f"{value:.1f}"


def _epoch_line(records: dict[str, MetricRecord]) -> str:
    return ", ".join(f"{name}={_fmt(r.epoch[-1])}" for name, r in records.items() if r.epoch)


class LogMetricByEpochHook(BaseHook):
    """Logs every metric's epoch value through ``logging.getLogger("gridtrain")`` on
    global rank 0, every ``interval`` train epochs and after every evaluation."""

    def __init__(self, interval: int = 1, priority: int = 10):
        super().__init__(priority)
        if interval < 1:
            raise ValueError(f"LogMetricByEpochHook interval must be >= 1, got {interval}")
        self.interval = interval
        self.lines: list[str] = []  # what was logged, for tests and notebooks

    def _log(self, trainer: Trainer, phase: str) -> None:
        if trainer.ctx.global_rank != 0:
            return
        line = f"epoch {trainer.cur_epoch}/{trainer.total_epochs} {phase}: " + _epoch_line(
            trainer.states["metrics"][phase]
        )
        self.lines.append(line)
        logger.info(line)

    def after_train_epoch(self, trainer: Trainer) -> None:
        if trainer.cur_epoch % self.interval == 0:
            self._log(trainer, "train")

    def after_test_epoch(self, trainer: Trainer) -> None:
        self._log(trainer, "test")


class _Writer(BaseHook):
    """Writes the records each epoch: per-step values once, then each epoch value."""

    def __init__(self, priority: int):
        super().__init__(priority)
        self._written: dict[tuple[str, str], tuple[int, int]] = {}

    def _emit(self, phase: str, name: str, kind: str, step: int, value: float) -> None:
        raise NotImplementedError

    def _flush(self) -> None:
        pass

    def _write_new(self, trainer: Trainer, phase: str) -> None:
        if trainer.ctx.global_rank != 0:
            return
        for name, record in trainer.states["metrics"][phase].items():
            steps_done, epochs_done = self._written.get((phase, name), (0, 0))
            for i in range(steps_done, len(record.step)):
                self._emit(phase, name, "step", record.step_at[i], record.step[i])
            for i in range(epochs_done, len(record.epoch)):
                self._emit(phase, name, "epoch", record.epoch_step[i], record.epoch[i])
            self._written[(phase, name)] = (len(record.step), len(record.epoch))
        self._flush()

    def after_train_epoch(self, trainer: Trainer) -> None:
        self._write_new(trainer, "train")

    def after_test_epoch(self, trainer: Trainer) -> None:
        self._write_new(trainer, "test")


class TensorboardHook(_Writer):
    """Writes every metric to TensorBoard under ``log_dir`` from global rank 0: tags
    ``train/<name>`` per step (loss, lr), ``train_epoch/<name>`` and ``test/<name>``
    per epoch, all on the global-step axis."""

    def __init__(self, log_dir: str | Path = "runs", priority: int = 10):
        super().__init__(priority)
        self.log_dir = Path(log_dir)
        self._writer = None

    def before_train(self, trainer: Trainer) -> None:
        if trainer.ctx.global_rank == 0 and self._writer is None:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(log_dir=str(self.log_dir))

    before_test = before_train

    def _emit(self, phase, name, kind, step, value) -> None:
        tag = f"{phase}/{name}" if kind == "step" or phase == "test" else f"{phase}_epoch/{name}"
        self._writer.add_scalar(tag, value, step)

    def _flush(self) -> None:
        self._writer.flush()

    def after_train(self, trainer: Trainer) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None


class CSVLogHook(_Writer):
    """Appends every metric value to the CSV file ``path`` from global rank 0, one row
    per value: ``phase,kind,step,metric,value`` (kind = step or epoch)."""

    HEADER = ("phase", "kind", "step", "metric", "value")

    def __init__(self, path: str | Path = "metrics.csv", priority: int = 10):
        super().__init__(priority)
        self.path = Path(path)
        self._rows: list[tuple] = []

    def _emit(self, phase, name, kind, step, value) -> None:
        self._rows.append((phase, kind, step, name, repr(value)))

    def _flush(self) -> None:
        new_file = not self.path.exists()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a", newline="") as f:
            out = csv.writer(f)
            if new_file:
                out.writerow(self.HEADER)
            out.writerows(self._rows)
        self._rows = []


class LossCurveHook(BaseHook):
    """Draws the train loss per step and the test loss per evaluation into the PNG
    ``path`` (rewritten after every epoch, so it can be watched while training)."""

    def __init__(self, path: str | Path = "loss.png", priority: int = 11):
        super().__init__(priority)
        self.path = Path(path)

    def _draw(self, trainer: Trainer) -> None:
        if trainer.ctx.global_rank != 0:
            return
        import matplotlib

        matplotlib.use("Agg")  # files only, never a window
        import matplotlib.pyplot as plt

        train = trainer.states["metrics"]["train"].get("loss")
        test = trainer.states["metrics"]["test"].get("loss")
        if train is None or not train.step:
            return
        fig, ax = plt.subplots(figsize=(6, 4))
        ax.plot(train.step_at, train.step, label="train loss", lw=1)
        if test is not None and test.epoch:
            ax.plot(test.epoch_step, test.epoch, "o-", label="test loss")
        ax.set_xlabel("step")
        ax.set_ylabel("loss")
        ax.legend()
        ax.grid(alpha=0.3)
        fig.tight_layout()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(self.path, dpi=100)
        plt.close(fig)

    def after_train_epoch(self, trainer: Trainer) -> None:
        self._draw(trainer)

    def after_test_epoch(self, trainer: Trainer) -> None:
        self._draw(trainer)
