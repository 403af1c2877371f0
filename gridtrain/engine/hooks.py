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
    hook only records it. To step per epoch, do not pass the scheduler to ``initialize``.
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


def checkpoint_path(
    checkpoint_dir: str | Path, epoch: int, suffix: str = "", sharded: bool = False
) -> Path:
    """Where ``SaveCheckpointHook`` writes the checkpoint taken after ``epoch`` epochs: the
    directory ``epoch_<n><suffix>`` (sharded) or the file ``epoch_<n><suffix>.pt`` (dense)."""
    name = f"epoch_{epoch}{suffix}"
    return Path(checkpoint_dir) / (name if sharded else f"{name}.pt")


def epoch_checkpoints(checkpoint_dir: str | Path, suffix: str = "") -> dict[int, Path]:
    """Complete checkpoints named ``epoch_<n><suffix>`` (either format) by epoch; where both
    formats exist for one epoch, the newer."""
    from gridtrain.engine.checkpoint import files

    pattern = re.compile(rf"epoch_(\d+){re.escape(suffix)}(\.pt)?")
    found: dict[int, tuple[int, Path]] = {}
    directory = Path(checkpoint_dir)
    if not directory.is_dir():
        return {}
    for path in directory.iterdir():
        match = pattern.fullmatch(path.name)
        if match is None:
            continue
        if match.group(2) is None and files.is_complete_dir(path):
            stamp = (path / files.MARKER).stat().st_mtime_ns
        elif match.group(2) is not None and files.is_dense_file(path):
            stamp = path.stat().st_mtime_ns
        else:
            continue
        epoch = int(match.group(1))
        if epoch not in found or stamp > found[epoch][0]:
            found[epoch] = (stamp, path)
    return {epoch: path for epoch, (_, path) in found.items()}


def latest_checkpoint_epoch(checkpoint_dir: str | Path, suffix: str = "") -> int | None:
    """The largest epoch with a complete checkpoint (either format) in ``checkpoint_dir``."""
    epochs = epoch_checkpoints(checkpoint_dir, suffix)
    return max(epochs) if epochs else None


def _counters(trainer: Trainer) -> dict[str, Any]:
    """What a resume needs besides model and optimizer (saved as the checkpoint's ``extra``)."""
    settle = getattr(trainer.engine, "settle", None)  # a step counted but not yet confirmed
    if settle is not None:
        settle()
    return {
        "trainer": {"cur_epoch": trainer.cur_epoch, "cur_step": trainer.cur_step},
        "engine": {"global_step": getattr(trainer.engine, "global_step", 0)},
    }


class SaveCheckpointHook(BaseHook):
    """Saves model, optimizer, LR scheduler, RNG states and the trainer's counters every
    ``interval`` epochs (and after the last one), n = epochs completed, to
    ``checkpoint_dir/epoch_<n><suffix>`` (``sharded=True``, the default: every rank writes
    its own shards through DCP) or ``checkpoint_dir/epoch_<n><suffix>.pt`` (``sharded=False``:
    one dense file written by rank 0). ``async_save=True`` (sharded) writes in the
    background while training goes on; the hook waits for the last save after training.

    Each checkpoint appears only when complete, so ``LoadCheckpointHook(path="auto")``
    after a crash resumes from the newest one.
    """

    def __init__(
        self,
        interval: int = 1,
        checkpoint_dir: str | Path = "checkpoints",
        suffix: str = "",
        priority: int = 10,
        sharded: bool = True,
        async_save: bool = False,
    ):
        super().__init__(priority)
        if interval < 1:
            raise ValueError(f"SaveCheckpointHook interval must be >= 1, got {interval}")
        if async_save and not sharded:
            raise ValueError("SaveCheckpointHook: async_save=True needs sharded=True")
        self.interval = interval
        self.checkpoint_dir = Path(checkpoint_dir)
        self.suffix = suffix
        self.sharded = sharded
        self.async_save = async_save
        self.saved: list[Path] = []
        self._pending = None

    def _save(self, trainer: Trainer) -> None:
        from gridtrain.engine.checkpoint import save_checkpoint

        path = checkpoint_path(self.checkpoint_dir, trainer.cur_epoch, self.suffix, self.sharded)
        engine = trainer.engine
        self._pending = save_checkpoint(
            path,
            trainer.cur_epoch,
            engine.model,
            engine.optimizer,
            _lr_scheduler(trainer),
            sharded=self.sharded,
            async_save=self.async_save,
            extra=_counters(trainer),
        )
        self.saved.append(path)
        if trainer.ctx.global_rank == 0:
            logger.info("%s checkpoint %s", "saving" if self._pending else "saved", path)

    def after_train_epoch(self, trainer: Trainer) -> None:
        # trainer.cur_epoch already counts the epoch that just ended
        if trainer.cur_epoch % self.interval == 0:
            self._save(trainer)

    def after_train(self, trainer: Trainer) -> None:
        if trainer.cur_epoch % self.interval != 0 and trainer.cur_step > 0:
            self._save(trainer)
        if self._pending is not None:
            self._pending.wait()
            self._pending = None


class LoadCheckpointHook(BaseHook):
    """Before training, loads a checkpoint into the model, optimizer, LR scheduler and RNG
    states and resumes the trainer's epoch and step counters from it:

    * ``path="auto"``: the newest complete checkpoint in ``checkpoint_dir`` (any name, either
      format), or none: training starts from scratch (a script that restarts after a crash);
    * ``path=<file or directory>``: that checkpoint;
    * otherwise ``checkpoint_dir``'s ``epoch_<epoch><suffix>`` checkpoint (either format;
      ``epoch=None``: the largest epoch there), an error if there is none.

    ``finetune=True`` loads the model only and starts counting from zero. Runs first
    (priority -10) so later hooks see the restored state.
    """

    def __init__(
        self,
        checkpoint_dir: str | Path = "checkpoints",
        epoch: int | None = None,
        finetune: bool = False,
        suffix: str = "",
        priority: int = -10,
        path: str | Path | None = None,
    ):
        super().__init__(priority)
        self.checkpoint_dir = Path(checkpoint_dir)
        self.epoch = epoch
        self.finetune = finetune
        self.suffix = suffix
        self.path = path
        self.loaded_epoch: int | None = None
        self.loaded_path: Path | None = None

    def _find(self) -> Path | None:
        from gridtrain.engine.checkpoint import latest_checkpoint

        if self.path == "auto":
            return latest_checkpoint(self.checkpoint_dir)
        if self.path is not None:
            return Path(self.path)
        epochs = epoch_checkpoints(self.checkpoint_dir, self.suffix)
        if self.epoch is None:
            if not epochs:
                raise FileNotFoundError(
                    f"LoadCheckpointHook: no epoch_<n>{self.suffix} checkpoint in "
                    f"checkpoint_dir '{self.checkpoint_dir}'"
                )
            return epochs[max(epochs)]
        if self.epoch not in epochs:
            raise FileNotFoundError(
                f"LoadCheckpointHook: checkpoint for epoch {self.epoch} not found at "
                f"'{checkpoint_path(self.checkpoint_dir, self.epoch, self.suffix, True)}' or "
                f"'{checkpoint_path(self.checkpoint_dir, self.epoch, self.suffix)}'"
            )
        return epochs[self.epoch]

    def before_train(self, trainer: Trainer) -> None:
        from gridtrain.engine.checkpoint import load_checkpoint

        path = self._find()
        if path is None:
            if trainer.ctx.global_rank == 0:
                logger.info("no checkpoint in %s: training from scratch", self.checkpoint_dir)
            return
        engine = trainer.engine
        if self.finetune:
            load_checkpoint(path, engine.model)
            return
        extra: dict[str, Any] = {}
        self.loaded_epoch = load_checkpoint(
            path, engine.model, engine.optimizer, _lr_scheduler(trainer), extra=extra
        )
        self.loaded_path = path
        counters = extra.get("trainer", {})
        trainer.cur_epoch = counters.get("cur_epoch", self.loaded_epoch)
        trainer.cur_step = counters.get("cur_step", self.loaded_epoch * trainer.steps_per_epoch)
        if "engine" in extra and hasattr(engine, "global_step"):
            engine.global_step = extra["engine"]["global_step"]
        if trainer.ctx.global_rank == 0:
            logger.info("resumed from %s (epoch %d)", path, self.loaded_epoch)


__all__ = [
    "BaseHook",
    "LRSchedulerHook",
    "LoadCheckpointHook",
    "SaveCheckpointHook",
    "checkpoint_path",
    "epoch_checkpoints",
    "latest_checkpoint_epoch",
]
