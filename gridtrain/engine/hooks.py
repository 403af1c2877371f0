"""Trainer hooks: the base class, the learning-rate hook and the checkpoint hooks.

A hook is called by :class:`~gridtrain.engine.trainer.Trainer` at fixed points
of the loop (``before_train``, ``before_train_epoch``, ``before_train_iter``,
``after_train_iter``, ``after_train_epoch``, the same six for ``test``, and
``after_train``); hooks run in ascending ``priority``. Every rank runs every
hook, so a hook may call collectives; only what touches the file system or the
console is limited to one rank. Metric hooks live in ``hooks_metrics.py``,
logging hooks in ``hooks_log.py``.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torch import Tensor

if TYPE_CHECKING:
    from gridtrain.engine.trainer import Trainer

logger = logging.getLogger("gridtrain")


class BaseHook:
    """A no-op at every point of the training loop; subclasses override what they need.

    ``priority``: hooks run in ascending priority (ties keep the order given).
    ``needs_output``: the trainer asks the schedule for outputs and labels only
    when some hook sets this.
    """

    needs_output = False

    def __init__(self, priority: int = 0):
        self.priority = priority

    def after_hook_is_attached(self, trainer: Trainer) -> None:
        """Called once when ``fit``/``evaluate`` receives the hook."""

    def before_train(self, trainer: Trainer) -> None:
        pass

    def after_train(self, trainer: Trainer) -> None:
        pass

    def before_train_epoch(self, trainer: Trainer) -> None:
        pass

    def after_train_epoch(self, trainer: Trainer) -> None:
        pass

    def before_train_iter(self, trainer: Trainer) -> None:
        pass

    def after_train_iter(
        self, trainer: Trainer, output: Any, label: Any, loss: Tensor | None
    ) -> None:
        pass

    def before_test(self, trainer: Trainer) -> None:
        pass

    def after_test(self, trainer: Trainer) -> None:
        pass

    def before_test_epoch(self, trainer: Trainer) -> None:
        pass

    def after_test_epoch(self, trainer: Trainer) -> None:
        pass

    def before_test_iter(self, trainer: Trainer) -> None:
        pass

    def after_test_iter(
        self, trainer: Trainer, output: Any, label: Any, loss: Tensor | None
    ) -> None:
        pass

    def step_metrics(self, trainer: Trainer) -> dict[str, float]:
        """Values for the progress bar after a step (called on every rank: may reduce)."""
        return {}


class LRSchedulerHook(BaseHook):
    """Steps ``lr_scheduler`` after every epoch (``by_epoch=True``) or after every
    optimizer step, and records the learning rate as the ``lr`` train metric (per
    step and per epoch).

    A scheduler passed to ``gridtrain.initialize`` is already stepped by the
    engine after each optimizer step; give it here with ``by_epoch=False`` and the
    hook only records it. To step per epoch (the legacy default), do not pass the
    scheduler to ``initialize``.
    """

    def __init__(self, lr_scheduler: Any, by_epoch: bool = True, priority: int = 1):
        super().__init__(priority)
        if not hasattr(lr_scheduler, "step"):
            raise TypeError(
                f"lr_scheduler must have a step() method, got {type(lr_scheduler).__name__}"
            )
        self.lr_scheduler = lr_scheduler
        self.by_epoch = by_epoch
        self._engine_steps_it = False
        self._optimizer_steps = 0
        self._step_lr = 0.0

    def _lr(self) -> float:
        if hasattr(self.lr_scheduler, "get_last_lr"):
            return float(self.lr_scheduler.get_last_lr()[0])
        return float(self.lr_scheduler.optimizer.param_groups[0]["lr"])

    def after_hook_is_attached(self, trainer: Trainer) -> None:
        self._engine_steps_it = getattr(trainer.engine, "lr_scheduler", None) is self.lr_scheduler
        if self._engine_steps_it and self.by_epoch:
            raise ValueError(
                "LRSchedulerHook(by_epoch=True): this lr_scheduler was passed to "
                "gridtrain.initialize, so the engine already steps it after every optimizer "
                "step; pass by_epoch=False (record only) or keep it out of initialize"
            )
        # LoadCheckpointHook restores the scheduler it finds here
        trainer.states["lr_scheduler"] = self.lr_scheduler

    def before_train(self, trainer: Trainer) -> None:
        trainer.train_metric("lr")
        self._optimizer_steps = getattr(trainer.engine, "global_step", 0)

    def after_train_iter(self, trainer, output, label, loss) -> None:
        # the lr this step used (the engine may have stepped its scheduler since)
        trainer.train_metric("lr").add_step(self._step_lr, trainer.cur_step)
        if not self.by_epoch and not self._engine_steps_it:
            # step once per optimizer step (none inside an accumulation window or on overflow)
            steps = getattr(trainer.engine, "global_step", None)
            if steps is None or steps != self._optimizer_steps:
                self.lr_scheduler.step()
            self._optimizer_steps = steps if steps is not None else 0

    def before_train_iter(self, trainer: Trainer) -> None:
        self._step_lr = self._lr()

    def after_train_epoch(self, trainer: Trainer) -> None:
        record = trainer.train_metric("lr")
        record.add_epoch(record.step[-1] if record.step else self._lr(), trainer.cur_step)
        if self.by_epoch:
            self.lr_scheduler.step()

    def step_metrics(self, trainer: Trainer) -> dict[str, float]:
        return {"lr": self._lr()}


def _lr_scheduler(trainer: Trainer) -> Any:
    """The scheduler to checkpoint: an LRSchedulerHook's, else the one the engine steps."""
    return trainer.states.get("lr_scheduler") or getattr(trainer.engine, "lr_scheduler", None)


def checkpoint_path(checkpoint_dir: str | Path, epoch: int, suffix: str = "") -> Path:
    """Where ``SaveCheckpointHook`` writes the checkpoint taken after ``epoch`` epochs."""
    return Path(checkpoint_dir) / f"epoch_{epoch}{suffix}.pt"


def latest_checkpoint_epoch(checkpoint_dir: str | Path, suffix: str = "") -> int | None:
    """The largest epoch with a checkpoint in ``checkpoint_dir``, or None."""
    pattern = re.compile(rf"epoch_(\d+){re.escape(suffix)}\.pt")
    epochs = [
        int(m.group(1))
        for p in Path(checkpoint_dir).glob("epoch_*.pt")
        if (m := pattern.fullmatch(p.name))
    ]
    return max(epochs) if epochs else None


class SaveCheckpointHook(BaseHook):
    """Saves model, optimizer and LR scheduler every ``interval`` epochs (and after the
    last one) to ``checkpoint_dir/epoch_<n><suffix>.pt``, n = epochs completed.

    Calls ``gridtrain.save_checkpoint`` on every rank (it gathers the full,
    layout-free state dict collectively and writes once).
    """

    def __init__(
        self,
        interval: int = 1,
        checkpoint_dir: str | Path = "checkpoints",
        suffix: str = "",
        priority: int = 10,
    ):
        super().__init__(priority)
        if interval < 1:
            raise ValueError(f"SaveCheckpointHook interval must be >= 1, got {interval}")
        self.interval = interval
        self.checkpoint_dir = Path(checkpoint_dir)
        self.suffix = suffix
        self.saved: list[Path] = []

    def _save(self, trainer: Trainer) -> None:
        from gridtrain.engine.checkpoint import save_checkpoint

        path = checkpoint_path(self.checkpoint_dir, trainer.cur_epoch, self.suffix)
        if trainer.ctx.global_rank == 0:
            path.parent.mkdir(parents=True, exist_ok=True)
        engine = trainer.engine
        save_checkpoint(
            path,
            trainer.cur_epoch,
            engine.model,
            engine.optimizer,
            _lr_scheduler(trainer),
        )
        self.saved.append(path)
        if trainer.ctx.global_rank == 0:
            logger.info("saved checkpoint %s", path)

    def after_train_epoch(self, trainer: Trainer) -> None:
        # trainer.cur_epoch already counts the epoch that just ended
        if trainer.cur_epoch % self.interval == 0:
            self._save(trainer)

    def after_train(self, trainer: Trainer) -> None:
        if trainer.cur_epoch % self.interval != 0 and trainer.cur_step > 0:
            self._save(trainer)


class LoadCheckpointHook(BaseHook):
    """Before training, loads ``checkpoint_dir``'s checkpoint of ``epoch`` (None: the
    latest) into the model, optimizer and LR scheduler, and resumes the trainer's
    epoch and step counters from it. ``finetune=True`` loads the model only and
    starts counting from zero. Runs first (priority 0) so later hooks see the
    restored state.
    """

    def __init__(
        self,
        checkpoint_dir: str | Path = "checkpoints",
        epoch: int | None = None,
        finetune: bool = False,
        suffix: str = "",
        priority: int = -10,
    ):
        super().__init__(priority)
        self.checkpoint_dir = Path(checkpoint_dir)
        self.epoch = epoch
        self.finetune = finetune
        self.suffix = suffix
        self.loaded_epoch: int | None = None

    def before_train(self, trainer: Trainer) -> None:
        from gridtrain.engine.checkpoint import load_checkpoint

        epoch = self.epoch
        if epoch is None:
            epoch = latest_checkpoint_epoch(self.checkpoint_dir, self.suffix)
            if epoch is None:
                raise FileNotFoundError(
                    f"LoadCheckpointHook: no epoch_<n>{self.suffix}.pt checkpoint in "
                    f"checkpoint_dir '{self.checkpoint_dir}'"
                )
        path = checkpoint_path(self.checkpoint_dir, epoch, self.suffix)
        if not path.is_file():
            raise FileNotFoundError(
                f"LoadCheckpointHook: checkpoint for epoch {epoch} not found at '{path}'"
            )
        engine = trainer.engine
        if self.finetune:
            load_checkpoint(path, engine.model)
            return
        self.loaded_epoch = load_checkpoint(
            path, engine.model, engine.optimizer, _lr_scheduler(trainer)
        )
        trainer.cur_epoch = self.loaded_epoch
        trainer.cur_step = self.loaded_epoch * trainer.steps_per_epoch
        if trainer.ctx.global_rank == 0:
            logger.info("resumed from %s (epoch %d)", path, self.loaded_epoch)


__all__ = [
    "BaseHook",
    "LRSchedulerHook",
    "LoadCheckpointHook",
    "SaveCheckpointHook",
    "checkpoint_path",
    "latest_checkpoint_epoch",
]
