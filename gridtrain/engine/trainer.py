"""Trainer: the epoch loop around an engine, with hooks and a progress bar.

```python
trainer = Trainer(engine)
trainer.fit(train_dl, epochs=10, test_dataloader=test_dl, hooks=[
    LossHook(), AccuracyHook(), LRSchedulerHook(lr_sched), LogMetricByEpochHook()],
    display_progress=True)
trainer.states["metrics"]["test"]["accuracy"].epoch   # same numbers on every rank
```
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch
from tqdm import tqdm

from gridtrain.engine.compile import compile_seconds
from gridtrain.engine.hooks import BaseHook
from gridtrain.engine.metrics import MetricRecord
from gridtrain.parallel.context import ParallelContext, get_context

logger = logging.getLogger("gridtrain")


def batch_size_of(batch: Any) -> int:
    """Samples in a batch: the leading size of its first tensor (tuple, list, dict or tensor)."""
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.dim() else 1
    if isinstance(batch, dict):
        batch = list(batch.values())
    if isinstance(batch, list | tuple):
        for item in batch:
            n = batch_size_of(item)
            if n:
                return n
    return 0


class _CountingIterator:
    """Passes batches through and counts the samples the schedule draws."""

    def __init__(self, iterable: Iterable):
        self._it = iter(iterable)
        self.samples = 0

    def __iter__(self) -> Iterator:
        return self

    def __next__(self) -> Any:
        batch = next(self._it)
        self.samples += batch_size_of(batch)
        return batch


class Trainer:
    """Runs ``engine`` over dataloaders for some epochs or steps, calling hooks.

    State the hooks read and write: ``cur_epoch`` (epochs completed),
    ``cur_step`` (steps completed, counted over the whole run),
    ``steps_per_epoch``, ``total_epochs``, ``last_samples`` (samples this rank's
    data-parallel replica drew in the last step), ``compile_s`` (seconds the first
    step spent in torch.compile, shown in the progress bar; None until then and where
    nothing is compiled) and ``states`` (a dict;
    ``states["metrics"][phase][name]`` is a :class:`MetricRecord`, phase =
    ``"train"`` or ``"test"``).
    """

    def __init__(self, engine: Any, ctx: ParallelContext | None = None):
        for name in ("train", "eval", "zero_grad", "step", "execute_schedule"):
            if not callable(getattr(engine, name, None)):
                raise TypeError(
                    f"Trainer needs an engine from gridtrain.initialize (missing {name}()), "
                    f"got {type(engine).__name__}"
                )
        self.engine = engine
        self.ctx = ctx or getattr(engine, "ctx", None) or get_context()
        self.cur_epoch = 0
        self.cur_step = 0
        self.steps_per_epoch = 0
        self.total_epochs = 0
        self.last_samples = 0
        self.compile_s: float | None = None
        self.states: dict[str, Any] = {"metrics": {"train": {}, "test": {}}}
        self.hooks: list[BaseHook] = []

    # ---- metric records ------------------------------------------------------------------
    def train_metric(self, name: str) -> MetricRecord:
        """The train record ``name`` (created on first use)."""
        return self.states["metrics"]["train"].setdefault(name, MetricRecord(name))

    def test_metric(self, name: str) -> MetricRecord:
        """The test record ``name`` (created on first use)."""
        return self.states["metrics"]["test"].setdefault(name, MetricRecord(name))

    def summary(self) -> dict[str, dict[str, float]]:
        """The latest value of every metric: ``{"train": {...}, "test": {...}}``."""
        return {
            phase: {name: r.last for name, r in records.items() if r.last is not None}
            for phase, records in self.states["metrics"].items()
        }

    # ---- hooks -----------------------------------------------------------------------------
    def _attach(self, hooks: Sequence[BaseHook] | None) -> None:
        hooks = list(hooks or [])
        for i, hook in enumerate(hooks):
            if not isinstance(hook, BaseHook):
                raise TypeError(
                    f"hooks[{i}] must be a gridtrain.engine.BaseHook, got {type(hook).__name__}"
                )
        self.hooks = sorted(hooks, key=lambda h: h.priority)  # stable: ties keep given order
        for hook in self.hooks:
            hook.after_hook_is_attached(self)

    def _call(self, point: str, *args: Any) -> None:
        for hook in self.hooks:
            getattr(hook, point)(self, *args)

    def _step_metrics(self) -> dict[str, str]:
        values: dict[str, float] = {}
        for hook in self.hooks:
            values.update(hook.step_metrics(self))
        if self.compile_s is not None:
            values["compile_s"] = self.compile_s
        return {k: f"{v:.4g}" for k, v in values.items()}

    def _compile_clock(self) -> float | None:
        """torch.compile's seconds so far, before the run's first step of a compiled engine."""
        speed = getattr(self.engine, "speed", None)
        if self.cur_step > 0 or speed is None or not speed.compiled:
            return None
        return compile_seconds()

    def _note_compile(self, before: float | None) -> None:
        if before is None:
            return
        self.compile_s = compile_seconds() - before
        if self.ctx.global_rank == 0:
            logger.info("first step: %.1f s in torch.compile", self.compile_s)

    def _wants_output(self, return_output_label: bool | None) -> bool:
        if return_output_label is not None:
            return return_output_label
        return any(h.needs_output for h in self.hooks)

    def _progress(self, total: int, desc: str, display: bool) -> tqdm:
        return tqdm(total=total, desc=desc, disable=not (display and self.ctx.global_rank == 0))

    # ---- loops -------------------------------------------------------------------------------
    def fit(
        self,
        train_dataloader: Iterable,
        epochs: int,
        max_steps: int | None = None,
        test_dataloader: Iterable | None = None,
        test_interval: int = 1,
        hooks: Sequence[BaseHook] | None = None,
        display_progress: bool = False,
        return_output_label: bool | None = None,
    ) -> dict[str, dict[str, float]]:
        """Train for ``epochs`` epochs (stopping early at ``max_steps`` steps), evaluating on
        ``test_dataloader`` every ``test_interval`` epochs and after the last; returns
        :meth:`summary`. ``display_progress`` shows a tqdm bar on global rank 0 (and
        reduces the step's loss each step for it). ``return_output_label`` defaults to
        whether a hook needs outputs (``AccuracyHook`` does).
        """
        if not isinstance(epochs, int) or epochs < 1:
            raise ValueError(f"epochs must be a positive int, got {epochs!r}")
        if max_steps is not None and (not isinstance(max_steps, int) or max_steps < 1):
            raise ValueError(f"max_steps must be None or a positive int, got {max_steps!r}")
        if not isinstance(test_interval, int) or test_interval < 1:
            raise ValueError(f"test_interval must be a positive int, got {test_interval!r}")
        self.steps_per_epoch = len(train_dataloader)
        if self.steps_per_epoch == 0:
            raise ValueError("train_dataloader is empty (len 0): nothing to train on")
        self.total_epochs = epochs
        self._attach(hooks)
        want_output = self._wants_output(return_output_label)

        self._call("before_train")
        while self.cur_epoch < epochs and not self._reached(max_steps):
            self._train_epoch(train_dataloader, max_steps, display_progress, want_output)
            last = self.cur_epoch >= epochs or self._reached(max_steps)
            if test_dataloader is not None and (last or self.cur_epoch % test_interval == 0):
                self._test_epoch(test_dataloader, display_progress, want_output)
        self._call("after_train")
        return self.summary()

    def evaluate(
        self,
        test_dataloader: Iterable,
        hooks: Sequence[BaseHook] | None = None,
        display_progress: bool = False,
        return_output_label: bool | None = None,
    ) -> dict[str, float]:
        """One pass over ``test_dataloader`` without gradients; returns the test metrics."""
        self._attach(hooks)
        self._call("before_test")
        self._test_epoch(test_dataloader, display_progress, self._wants_output(return_output_label))
        self._call("after_test")
        return self.summary()["test"]

    def _reached(self, max_steps: int | None) -> bool:
        return max_steps is not None and self.cur_step >= max_steps

    def _set_sampler_epoch(self, dataloader: Iterable) -> None:
        # DistributedSampler reshuffles per epoch only when told the epoch
        sampler = getattr(dataloader, "sampler", None)
        if hasattr(sampler, "set_epoch"):
            sampler.set_epoch(self.cur_epoch)

    def _train_epoch(
        self, dataloader: Iterable, max_steps: int | None, display: bool, want_output: bool
    ) -> None:
        engine = self.engine
        engine.train()
        self._set_sampler_epoch(dataloader)
        data = _CountingIterator(dataloader)
        desc = f"Epoch {self.cur_epoch + 1}/{self.total_epochs} train"
        self._call("before_train_epoch")
        with self._progress(self.steps_per_epoch, desc, display) as bar:
            for _ in range(self.steps_per_epoch):
                self._call("before_train_iter")
                before, compiling = data.samples, self._compile_clock()
                engine.zero_grad()
                try:
                    output, label, loss = engine.execute_schedule(
                        data, forward_only=False, return_loss=True, return_output_label=want_output
                    )
                except StopIteration:  # a loader shorter than its len(): end the epoch
                    break
                engine.step()
                self._note_compile(compiling)
                self.last_samples = data.samples - before
                self.cur_step += 1
                self._call("after_train_iter", output, label, loss)
                if display:
                    bar.set_postfix(self._step_metrics(), refresh=False)
                bar.update()
                if self._reached(max_steps):
                    break
        settle = getattr(engine, "settle", None)  # pending device-side skip flags
        if settle is not None:
            settle()
        self.cur_epoch += 1
        self._call("after_train_epoch")

    def _test_epoch(self, dataloader: Iterable, display: bool, want_output: bool) -> None:
        engine = self.engine
        engine.eval()
        data = _CountingIterator(dataloader)
        steps = len(dataloader)
        self._call("before_test_epoch")
        with self._progress(steps, f"Epoch {self.cur_epoch} test", display) as bar:
            with torch.no_grad():
                for _ in range(steps):
                    self._call("before_test_iter")
                    before = data.samples
                    try:
                        output, label, loss = engine.execute_schedule(
                            data,
                            forward_only=True,
                            return_loss=True,
                            return_output_label=want_output,
                        )
                    except StopIteration:
                        break
                    self.last_samples = data.samples - before
                    self._call("after_test_iter", output, label, loss)
                    bar.update()
        self._call("after_test_epoch")
        engine.train()
