"""The Engine: forward, backward and optimizer steps with every configured feature applied.

Built by ``gridtrain.initialize``. A training step is

    engine.zero_grad(); out = engine(x); loss = engine.criterion(out, y)
    engine.backward(loss); engine.step()

or ``engine.execute_schedule(data_iter)`` in place of the middle three. With
``gradient_accumulation = N`` the same loop runs every micro-step; ``zero_grad``
and ``step`` only act at the window's edges.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

from torch import Tensor, nn

from gridtrain.amp.optimizer import AmpOptimizer
from gridtrain.amp.torch_amp import autocast
from gridtrain.engine.accumulation import GradientAccumulation
from gridtrain.engine.clip import clip_grad_norm
from gridtrain.engine.data_parallel import OverlappedDataParallel
from gridtrain.engine.schedule import Schedule
from gridtrain.gradient_handlers.base import GradientHandler
from gridtrain.parallel.context import ParallelContext
from gridtrain.parallel.tensor.layers import split_batch

logger = logging.getLogger("gridtrain")


class _SplitCriterion(nn.Module):
    """``engine.criterion``: splits label tensors per tensor mode, then calls the user's loss."""

    def __init__(self, criterion: nn.Module, engine: Engine):
        super().__init__()
        self.module = criterion
        self._engine = [engine]  # a list keeps the engine out of nn.Module's child registry

    def forward(self, output: Any, *labels: Any, **kwargs: Any) -> Tensor:
        engine = self._engine[0]
        return engine.compute_loss(output, *engine.split_batch(labels), **kwargs)


class Engine:
    """Runs the model, the loss and the optimizer under the context's configuration."""

    def __init__(
        self,
        model: nn.Module,
        optimizer,
        criterion: nn.Module | None,
        ctx: ParallelContext,
        schedule: Schedule,
        gradient_handlers: list[GradientHandler] | None = None,
        data_parallel: OverlappedDataParallel | None = None,
        autocast_dtype=None,
        lr_scheduler=None,
    ):
        self.model = model
        self.optimizer = optimizer
        self.ctx = ctx
        self.schedule = schedule
        self.lr_scheduler = lr_scheduler
        self.gradient_handlers = list(gradient_handlers or [])
        self.data_parallel = data_parallel
        self.autocast_dtype = autocast_dtype
        self.clip_grad_norm = ctx.config.clip_grad_norm
        self.accumulation = GradientAccumulation(ctx.config.gradient_accumulation)
        self._user_criterion = criterion
        self.criterion = _SplitCriterion(criterion, self) if criterion is not None else None
        self._in_schedule = False
        self.global_step = 0  # optimizer steps taken (skipped overflow steps not counted)
        self.last_grad_norm: Tensor | None = None  # before clipping, when clipping is on
        self.last_step_skipped = False  # the last window overflowed (fp16)

    # ---- modes ---------------------------------------------------------------------------
    def train(self) -> None:
        self.model.train()
        if self.criterion is not None:
            self.criterion.train()

    def eval(self) -> None:
        self.model.eval()
        if self.criterion is not None:
            self.criterion.eval()

    # ---- forward -------------------------------------------------------------------------
    def split_batch(self, obj: Any) -> Any:
        """This rank's part of every tensor in ``obj`` under the tensor mode (tuples/lists/dicts)."""
        if self.ctx.tensor_mode is None or obj is None:
            return obj
        if isinstance(obj, Tensor):
            return split_batch(obj, self.ctx)
        if isinstance(obj, tuple | list):
            return type(obj)(self.split_batch(o) for o in obj)
        if isinstance(obj, dict):
            return {k: self.split_batch(v) for k, v in obj.items()}
        return obj

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Forward on this rank's part of the batch (inputs split per tensor mode, autocast on)."""
        args, kwargs = self.split_batch(args), self.split_batch(kwargs)
        with autocast(self.ctx.device, self.autocast_dtype):
            return self.model(*args, **kwargs)

    def forward_split(self, data: Any) -> Any:
        """Forward on already-split ``data``: a tensor, a tuple of arguments or a dict of kwargs."""
        with autocast(self.ctx.device, self.autocast_dtype):
            if isinstance(data, tuple | list):
                return self.model(*data)
            if isinstance(data, dict):
                return self.model(**data)
            return self.model(data)

    def compute_loss(self, output: Any, *labels: Any, **kwargs: Any) -> Tensor:
        """The user's criterion on already-split labels (under autocast when amp is on)."""
        if self._user_criterion is None:
            raise ValueError(
                "this engine has no criterion: pass criterion= to gridtrain.initialize"
            )
        with autocast(self.ctx.device, self.autocast_dtype):
            return self._user_criterion(output, *labels, **kwargs)

    # ---- backward ------------------------------------------------------------------------
    def scale_loss(self, loss: Tensor) -> Tensor:
        """``loss / gradient_accumulation`` times the fp16 loss scale: what backward differentiates.

        A pipeline schedule calling ``backward`` on its own applies this to the last stage's loss.
        """
        loss = self.accumulation.scale(loss)
        if isinstance(self.optimizer, AmpOptimizer):
            loss = self.optimizer.scale_loss(loss)
        return loss

    def backward(self, loss: Tensor) -> None:
        """Backward of one micro-step's loss (scaled for accumulation and fp16).

        Outside ``execute_schedule`` each call is one micro-step; on the window's
        last one the data-parallel all-reduce overlaps this backward.
        """
        if not self._in_schedule:  # execute_schedule counted this micro-step already
            self.accumulation.begin_micro_step()
            with self.overlap_grad_sync():
                self._backward(loss)
        else:
            self._backward(loss)

    def _backward(self, loss: Tensor) -> None:
        loss = self.accumulation.scale(loss)
        if isinstance(self.optimizer, AmpOptimizer):
            self.optimizer.backward(loss)  # multiplies by the loss scale
        else:
            loss.backward()

    @contextlib.contextmanager
    def overlap_grad_sync(self) -> Iterator[None]:
        """Wrap the last backward before ``step()``: its gradients are all-reduced as they are made.

        A no-op except in the accumulation window's last micro-step on the
        overlapped data-parallel path. Schedules wrap their final backward in it.
        """
        if self.data_parallel is None or not self.accumulation.in_last_micro_step:
            yield
            return
        with self.data_parallel.overlap():
            yield

    # ---- optimizer -----------------------------------------------------------------------
    def zero_grad(self) -> None:
        """Clear gradients, at the start of an accumulation window only."""
        if not self.accumulation.at_window_start:
            return
        self.optimizer.zero_grad(set_to_none=True)
        self.model.zero_grad(set_to_none=True)

    def _params(self) -> list[Tensor]:
        if isinstance(self.optimizer, AmpOptimizer):
            return self.optimizer.grad_params()
        return [p for g in self.optimizer.param_groups for p in g["params"]]

    def step(self) -> bool:
        """At the end of an accumulation window: sync, unscale, clip, step, update scale and LR.

        Returns True when the optimizer stepped; False inside a window or when
        fp16 gradients overflowed (then every rank skipped, the LR scheduler too).
        """
        if not self.accumulation.window_complete:
            return False
        self.accumulation.reset()
        if self.data_parallel is not None:
            self.data_parallel.finish()
        for handler in self.gradient_handlers:
            handler.handle_gradient()
        amp = self.optimizer if isinstance(self.optimizer, AmpOptimizer) else None
        overflow = amp.unscale_and_check() if amp is not None else False
        if self.clip_grad_norm > 0 and not overflow:
            self.last_grad_norm = clip_grad_norm(self._params(), self.clip_grad_norm, self.ctx)
        if not overflow:
            self.optimizer.step()
            self.global_step += 1
        if amp is not None:
            amp.update_scale(overflow)
        if overflow:
            logger.info("fp16 gradients overflowed: step skipped on every rank")
        elif self.lr_scheduler is not None:
            self.lr_scheduler.step()
        self.last_step_skipped = overflow
        return not overflow

    # ---- schedules -----------------------------------------------------------------------
    def execute_schedule(
        self,
        data_iter: Iterator,
        forward_only: bool = False,
        return_loss: bool = True,
        return_output_label: bool = True,
    ) -> tuple[Any, Any, Tensor | None]:
        """One batch through the schedule: (output, label, loss); one micro-step when training."""
        if not isinstance(data_iter, Iterator):
            raise TypeError(
                f"execute_schedule needs an iterator such as iter(train_dataloader), got "
                f"{type(data_iter).__name__}"
            )
        if not forward_only and not return_loss:
            raise ValueError(
                "execute_schedule: return_loss must be True when forward_only is False"
            )
        if not forward_only:
            self.accumulation.begin_micro_step()
        self._in_schedule = True
        try:
            return self.schedule.forward_backward_step(
                self, data_iter, forward_only, return_loss, return_output_label
            )
        except BaseException:
            if not forward_only:  # a failed batch is no micro-step
                self.accumulation.micro_step -= 1
            raise
        finally:
            self._in_schedule = False

    def __repr__(self) -> str:
        return (
            f"Engine(model={type(self.model).__name__}, optimizer={type(self.optimizer).__name__}, "
            f"schedule={type(self.schedule).__name__}, accumulation={self.accumulation.size}, "
            f"clip_grad_norm={self.clip_grad_norm}, ctx={self.ctx!r})"
        )
