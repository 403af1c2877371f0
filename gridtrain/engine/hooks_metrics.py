"""Metric hooks: loss, accuracy and throughput, identical on every rank.

Per-step values stay on the device during an epoch; one collective at the end
of the epoch (``reduce_to_all``) turns them into global numbers, so metric
hooks add no host synchronisation to a training step. The progress bar is the
exception: asking for it reduces the current step's loss each step.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from gridtrain.engine.hooks import BaseHook
from gridtrain.engine.metrics import has_metric_values, max_over_world, reduce_to_all

if TYPE_CHECKING:
    from gridtrain.engine.trainer import Trainer


def _weighted_loss(trainer: Trainer, loss: Tensor | None) -> Tensor:
    """[loss x samples, samples] of this step on this rank (zeros where there is no loss)."""
    n = float(trainer.last_samples)
    if has_metric_values(trainer.ctx):
        if loss is None:
            raise RuntimeError(
                "LossHook: the schedule returned no loss on the last pipeline stage; "
                "it must be called with return_loss=True"
            )
        return torch.stack([loss.detach().float().reshape(()) * n, loss.new_tensor(n).float()])
    return torch.zeros(2, device=trainer.ctx.device)


class LossHook(BaseHook):
    """Records ``loss``: the train loss of every step and its epoch mean, and the test
    loss of every evaluation. Each is the mean over all samples the data-parallel
    ranks drew (batch means weighted by batch size, so a short last batch counts
    for what it holds)."""

    def __init__(self, priority: int = 0):
        super().__init__(priority)
        self._steps: list[Tensor] = []
        self._test: Tensor | None = None

    def before_train_epoch(self, trainer: Trainer) -> None:
        self._steps = []

    def after_train_iter(self, trainer, output, label, loss) -> None:
        self._steps.append(_weighted_loss(trainer, loss))

    def step_metrics(self, trainer: Trainer) -> dict[str, float]:
        if not self._steps:
            return {}
        loss_sum, n = reduce_to_all(self._steps[-1], trainer.ctx).tolist()
        return {"loss": loss_sum / max(n, 1.0)}

    def after_train_epoch(self, trainer: Trainer) -> None:
        record = trainer.train_metric("loss")
        if not self._steps:
            return
        sums = reduce_to_all(torch.stack(self._steps), trainer.ctx)  # (steps, 2)
        first = trainer.cur_step - len(self._steps) + 1
        for i, (loss_sum, n) in enumerate(sums.tolist()):
            record.add_step(loss_sum / max(n, 1.0), first + i)
        total = sums.sum(dim=0)
        record.add_epoch(float(total[0] / total[1].clamp(min=1.0)), trainer.cur_step)
        self._steps = []

    def before_test_epoch(self, trainer: Trainer) -> None:
        self._test = torch.zeros(2, device=trainer.ctx.device)

    def after_test_iter(self, trainer, output, label, loss) -> None:
        self._test += _weighted_loss(trainer, loss)

    def after_test_epoch(self, trainer: Trainer) -> None:
        loss_sum, n = reduce_to_all(self._test, trainer.ctx).tolist()
        trainer.test_metric("loss").add_epoch(loss_sum / max(n, 1.0), trainer.cur_step)


class AccuracyHook(BaseHook):
    """Records ``accuracy`` (correct / total over all data-parallel ranks) for each train
    epoch and each evaluation.

    ``accuracy_func(logits, labels, ctx) -> (correct, total)`` defaults to
    ``gt.nn.accuracy``, which counts the data-parallel rank's batch the way the
    configured tensor mode lays out logits and labels.
    """

    needs_output = True

    def __init__(self, accuracy_func: Callable | None = None, priority: int = 0):
        super().__init__(priority)
        if accuracy_func is None:
            from gridtrain.nn import accuracy as accuracy_func
        self.accuracy_func = accuracy_func
        self._counts: Tensor | None = None

    def _reset(self, trainer: Trainer) -> None:
        self._counts = torch.zeros(2, dtype=torch.float64, device=trainer.ctx.device)

    def _update(self, trainer: Trainer, output: Any, label: Any) -> None:
        if not has_metric_values(trainer.ctx):
            return
        if output is None or label is None:
            raise RuntimeError(
                "AccuracyHook: the schedule returned no output/label on the last stage; "
                "call fit/evaluate with return_output_label=True (the default with this hook)"
            )
        if isinstance(output, tuple | list):
            output = output[0]
        correct, total = self.accuracy_func(output.detach(), label, trainer.ctx)
        self._counts += torch.stack([torch.as_tensor(correct), torch.as_tensor(total)]).to(
            self._counts
        )

    def _finish(self, trainer: Trainer, phase: str) -> None:
        correct, total = reduce_to_all(self._counts, trainer.ctx).tolist()
        metric = trainer.train_metric if phase == "train" else trainer.test_metric
        metric("accuracy").add_epoch(correct / max(total, 1.0), trainer.cur_step)

    def before_train_epoch(self, trainer: Trainer) -> None:
        self._reset(trainer)

    def after_train_iter(self, trainer, output, label, loss) -> None:
        self._update(trainer, output, label)

    def after_train_epoch(self, trainer: Trainer) -> None:
        self._finish(trainer, "train")

    def before_test_epoch(self, trainer: Trainer) -> None:
        self._reset(trainer)

    def after_test_iter(self, trainer, output, label, loss) -> None:
        self._update(trainer, output, label)

    def after_test_epoch(self, trainer: Trainer) -> None:
        self._finish(trainer, "test")


def _synchronize(trainer: Trainer) -> None:
    if trainer.ctx.device.type == "cuda":
        torch.cuda.synchronize(trainer.ctx.device)


class ThroughputHook(BaseHook):
    """Records ``throughput`` (samples per second over all data-parallel ranks, timed by
    the slowest rank, data loading and hooks included) and ``step_time`` (seconds
    per step) for each train epoch and each evaluation."""

    def __init__(self, priority: int = 0):
        super().__init__(priority)
        self._start = 0.0
        self._samples = 0
        self._steps = 0

    def _begin(self, trainer: Trainer) -> None:
        _synchronize(trainer)
        self._start = time.perf_counter()
        self._samples = 0
        self._steps = 0

    def _count(self, trainer: Trainer) -> None:
        self._samples += trainer.last_samples
        self._steps += 1

    def _end(self, trainer: Trainer, phase: str) -> None:
        _synchronize(trainer)
        elapsed = max_over_world(time.perf_counter() - self._start, trainer.ctx)
        samples = float(reduce_to_all(torch.tensor([float(self._samples)]), trainer.ctx)[0])
        metric = trainer.train_metric if phase == "train" else trainer.test_metric
        metric("throughput").add_epoch(samples / max(elapsed, 1e-12), trainer.cur_step)
        metric("step_time").add_epoch(elapsed / max(self._steps, 1), trainer.cur_step)

    def before_train_epoch(self, trainer: Trainer) -> None:
        self._begin(trainer)

    def after_train_iter(self, trainer, output, label, loss) -> None:
        self._count(trainer)

    def after_train_epoch(self, trainer: Trainer) -> None:
        self._end(trainer, "train")

    def before_test_epoch(self, trainer: Trainer) -> None:
        self._begin(trainer)

    def after_test_iter(self, trainer, output, label, loss) -> None:
        self._count(trainer)

    def after_test_epoch(self, trainer: Trainer) -> None:
        self._end(trainer, "test")
