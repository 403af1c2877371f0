"""The Engine: forward, backward and optimizer steps with every configured feature applied.

Built by ``gridtrain.initialize``. A training step is

    engine.zero_grad(); out = engine(x); loss = engine.criterion(out, y)
    engine.backward(loss); engine.step()

or ``engine.execute_schedule(data_iter)`` in place of the middle three. With
``gradient_accumulation = N`` the same loop runs every micro-step; ``zero_grad``
and ``step`` only act at the window's edges. The criterion is always called as
``criterion(output, label)`` with the label as the batch gave it (a tensor, or a
tuple/dict of tensors), split the way the tensor mode needs.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_map

from gridtrain.amp.optimizer import AmpOptimizer
from gridtrain.amp.torch_amp import autocast
from gridtrain.engine.accumulation import GradientAccumulation
from gridtrain.engine.clip import clip_grad_norm
from gridtrain.engine.memory import MemoryMeter, MemoryReport
from gridtrain.engine.nonfinite import (
    NonFiniteGuard,
    Outcome,
    WindowCheck,
    found_inf,
    fused_skip_target,
)
from gridtrain.engine.schedules import Schedule, StepFunctions
from gridtrain.engine.sdpa import attention_for, sdpa_context
from gridtrain.gradient_handlers.base import GradientHandler
from gridtrain.parallel import comm
from gridtrain.parallel.context import ParallelContext
from gridtrain.parallel.mode import ParallelMode
from gridtrain.parallel.sync import GradSync, GradSyncs
from gridtrain.parallel.tags import default_dp_mode
from gridtrain.parallel.tensor.registry import spec_of, split_batch
from gridtrain.parallel.tensor.sequence import mark_sequence_sharded

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
        grad_sync: GradSync,
        autocast_dtype=None,
        lr_scheduler=None,
        plan=None,
        zero=None,
    ):
        self.model = model
        self.zero = zero  # parallel.zero's stage 1-2 or stage 3 runtime, None without ZeRO
        self.optimizer = optimizer
        self.ctx = ctx
        self.schedule = schedule
        self.plan = plan  # the layout and tensor plan (print it): a Plan in every layout
        self.lr_scheduler = lr_scheduler
        self.grad_sync = grad_sync  # engine/grad_sync.py: one per configuration
        self.autocast_dtype = autocast_dtype
        self.clip_grad_norm = ctx.config.clip_grad_norm
        self._attention = attention_for(getattr(ctx.config, "attention", None), ctx.device)
        self.max_nonfinite_steps = getattr(ctx.config, "max_nonfinite_steps", 3)
        multi = ctx.world_size(ParallelMode.GLOBAL) > 1
        self.nonfinite = NonFiniteGuard(
            ctx.device,
            ctx.group(ParallelMode.GLOBAL) if multi else None,
            self.max_nonfinite_steps,
            overflow_limit=ctx.config.fp16.max_skipped_steps if ctx.config.fp16 else 0,
        )
        self.accumulation = GradientAccumulation(ctx.config.gradient_accumulation)
        self._user_criterion = criterion
        self.criterion = _SplitCriterion(criterion, self) if criterion is not None else None
        self.last_grad_norm: Tensor | None = None  # before clipping, when clipping is on
        self.last_step_skipped = False  # the last window overflowed (fp16) or was not finite
        self._bn_buffers = _batchnorm_buffers(model)
        self._memory = MemoryMeter(model, optimizer, grad_sync, zero, ctx.device)
        self.steps = StepFunctions(
            forward=self.forward_split,
            loss=self.compute_loss if criterion is not None else None,
            backward=self._scaled_backward,
            grad_sync=self.overlap_grad_sync,
            split=self.split_batch,
            device=ctx.device,
            check_inputs=self._check_stage_inputs,
        )

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
        return tree_map(lambda t: split_batch(t, self.ctx) if isinstance(t, Tensor) else t, obj)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Forward on this rank's part of the batch (inputs split per tensor mode, autocast on).
        Under a pipeline a rank holds one stage, not the model: ``execute_schedule`` then."""
        if self.ctx.config.pipeline_size > 1:
            raise RuntimeError(
                f"engine(...) runs the whole model, but under parallel.pipeline = "
                f"{self.ctx.config.pipeline_size} this rank holds one stage of it: call "
                "engine.execute_schedule(data_iter) instead (one batch per call: forward, loss "
                "and backward of its micro-batches on every stage; then engine.step()), with "
                "data_iter = iter(train_dataloader) made once per epoch"
            )
        self._sync_batchnorm()
        args, kwargs = self.split_batch(args), self.split_batch(kwargs)
        with self._forward_context():
            return self.model(*args, **kwargs)

    def forward_split(self, data: Any, chunk: int | None = None, batch: Any = None) -> Any:
        """Forward on already-split ``data``: a tensor, a tuple of arguments or a dict of kwargs
        (under a pipeline, a later chunk's ``data`` is the activation received and ``batch``
        its micro-batch)."""
        if chunk is None or chunk == 0:
            self._sync_batchnorm()
        extra = {} if chunk is None else {"chunk": chunk}
        if batch is not None:
            extra["batch"] = batch
        with self._forward_context():
            if isinstance(data, tuple | list):
                return self.model(*data, **extra)
            if isinstance(data, dict):
                return self.model(**data, **extra)
            return self.model(data, **extra)

    def _check_stage_inputs(self, data: Any) -> None:
        check = getattr(self.model, "check_stage_inputs", None)  # a stage running its own forward
        if check is not None:
            check(data)

    @contextlib.contextmanager
    def _forward_context(self) -> Iterator[None]:
        """Autocast (amp modes), the configured SDPA kernels and the tensor mode's forward
        context (sequence: ``F.scaled_dot_product_attention`` as ring attention) around a
        forward."""
        with (
            autocast(self.ctx.device, self.autocast_dtype),
            sdpa_context(self._attention),
            spec_of(self.ctx).forward_mode(self.ctx),
        ):
            yield

    def compute_loss(self, output: Any, *labels: Any, **kwargs: Any) -> Tensor:
        """The user's criterion on already-split labels (under autocast when amp is on)."""
        if self._user_criterion is None:
            raise ValueError(
                "this engine has no criterion: pass criterion= to gridtrain.initialize"
            )
        if self.ctx.tensor_geometry.splits_sequence:  # token labels sum their loss over it
            labels = tree_map(_mark_token_labels, labels)
        with autocast(self.ctx.device, self.autocast_dtype):
            return self._user_criterion(output, *labels, **kwargs)

    @torch.no_grad()
    def _sync_batchnorm(self) -> None:
        """BatchNorm running statistics follow the first replica, as torch DDP broadcasts them."""
        if not self._bn_buffers or not self.model.training:
            return
        mode = default_dp_mode(self.ctx)
        if self.ctx.world_size(mode) == 1:
            return
        for buf in self._bn_buffers:
            comm.broadcast_(buf, self.ctx.ranks(mode)[0], self.ctx.group(mode))

    # ---- backward ------------------------------------------------------------------------
    def backward(self, loss: Tensor) -> None:
        """Backward of one micro-step's loss (scaled for accumulation and fp16).

        Each call is one micro-step; on the window's last one the data-parallel
        all-reduce overlaps this backward.
        """
        self.accumulation.begin_micro_step()
        with self.overlap_grad_sync():
            self._scaled_backward(loss)

    def _scaled_backward(self, loss: Tensor) -> None:
        """Back-propagate ``loss`` divided by the accumulation size, times the fp16 scale."""
        if getattr(self.optimizer, "scaler", None) is None:  # a loss scaler checks for itself
            self.nonfinite.observe_loss(loss)
        loss = self.accumulation.scale(loss)
        if isinstance(self.optimizer, AmpOptimizer):
            self.optimizer.backward(loss)  # multiplies by the loss scale
        else:
            loss.backward()

    @contextlib.contextmanager
    def overlap_grad_sync(self) -> Iterator[None]:
        """Wrap each backward in it: the accumulation window's last one syncs its gradients
        as they are made (the overlapped all-reduce, ZeRO's reduce-scatter, FSDP2, Gemini's
        host stream); earlier ones accumulate locally. Schedules wrap their final backward."""
        with self.grad_sync.around_backward(self.accumulation.in_last_micro_step):
            yield

    @property
    def gradient_handlers(self) -> list[GradientHandler]:
        """The gradient handlers in this engine's sync (configured, or for tied weights)."""
        parts = self.grad_sync.parts if isinstance(self.grad_sync, GradSyncs) else [self.grad_sync]
        return [p for p in parts if isinstance(p, GradientHandler)]

    # ---- optimizer -----------------------------------------------------------------------
    def zero_grad(self) -> None:
        """Clear gradients, at the start of an accumulation window only."""
        if not self.accumulation.at_window_start:
            return
        self.optimizer.zero_grad(set_to_none=True)
        self.model.zero_grad(set_to_none=True)

    def _params(self) -> list[Tensor]:
        if self._amp() is not None:
            return self.optimizer.grad_params()
        return [p for g in self.optimizer.param_groups for p in g["params"]]

    def step(self) -> bool:
        """At the end of an accumulation window: sync, unscale, clip, step, update scale and LR.

        Returns True when the optimizer stepped; False inside a window, when fp16
        gradients overflowed, or when the loss or gradient norm was not finite (fp32 and
        bf16: every rank skips; ``max_nonfinite_steps`` such steps in a row raise). With a
        fused optimizer on CUDA the non-finite skip happens on the device and is known
        one step later (``gridtrain.engine.nonfinite``): this step returns True, and the
        next one (or ``settle()``) takes it off ``global_step`` and counts it.
        """
        if not self.accumulation.window_complete:
            return False
        self.accumulation.reset()
        self.grad_sync.finish()
        check = self._check_window()
        outcome = self.nonfinite.before_step(check, self.zero_grad_all)
        if outcome.stepped:
            with found_inf(check.device_skip, check.flag):
                self.optimizer.step()
            self.grad_sync.after_step()
            outcome = self.nonfinite.after_step(check, self.zero_grad_all)
        self._after_outcome(outcome)
        self._memory.step_ended()
        return outcome.stepped

    # ---- memory ----------------------------------------------------------------------------
    def memory(self) -> MemoryReport:
        """This rank's bytes by category (parameters, gradients, optimizer_state, masters,
        activations), on the device and in host memory: now, and at the peak of the last
        step run inside ``track_memory()``; what ``gridtrain estimate`` predicts, category by
        category. Categories: ``gridtrain.parallel.zero.memory_rules``; sample points:
        ``gridtrain.engine.memory``. ``print(engine.memory())`` shows a table."""
        return self._memory.report()

    def track_memory(self) -> contextlib.AbstractContextManager[None]:
        """Steps run inside record their peaks for ``memory()``, activations included (each
        sample walks every tensor: slower steps; use it to measure)."""
        return self._memory.track()

    @property
    def global_step(self) -> int:
        """Optimizer steps taken; skipped windows are not counted (one skipped on the device
        on CUDA from the next step, or ``settle()``, on)."""
        return self.nonfinite.steps_taken

    @global_step.setter
    def global_step(self, value: int) -> None:
        self.nonfinite.steps_taken = value

    def _amp(self) -> AmpOptimizer | None:
        return self.optimizer if isinstance(self.optimizer, AmpOptimizer) else None

    def _check_window(self) -> WindowCheck:
        """Unscale (fp16) and clip the window's gradients; its overflow and non-finite flags."""
        amp, check = self._amp(), WindowCheck()
        if self._scaler_skips_on_device(amp):  # fused optimizer: GradScaler skips in-kernel
            check.overflow_flag = amp.unscale_flag()
        elif amp is not None:
            check.overflow = amp.unscale_and_check()
        if self.clip_grad_norm > 0 and not check.overflow:
            self.last_grad_norm = clip_grad_norm(self._params(), self.clip_grad_norm, self.ctx)
        self.settle()  # the previous window's device flags (CUDA: read a step late)
        if getattr(amp, "scaler", None) is None:  # no loss scaler looks out for inf/NaN
            norm = self.last_grad_norm if self.clip_grad_norm > 0 else None
            check.flag = self.nonfinite.window_flag(norm)
            check.device_skip = self._fused_target(self.optimizer)
        return check

    def _after_outcome(self, outcome: Outcome) -> None:
        """The loss scale and the LR scheduler follow the window's outcome."""
        amp = self._amp()
        if amp is not None:
            amp.update_scale(outcome.overflow)
        if outcome.overflow:
            logger.info("fp16 gradients overflowed: step skipped on every rank")
        elif not outcome.nonfinite and self.lr_scheduler is not None:
            self.lr_scheduler.step()
        self.last_step_skipped = not outcome.stepped

    def settle(self) -> None:
        """Read the device-side skip flags still pending (on CUDA, the last step's) and
        count their outcome now. ``step()`` does it a step late; the Trainer calls it at
        each epoch's end and before saving its counters."""
        self.nonfinite.settle()

    def _fused_target(self, optimizer) -> torch.optim.Optimizer | None:
        """The fused torch optimizer under ``optimizer`` that can skip on a device flag
        (``fused_skip_target``); none where the gradient sync rules it out (ZeRO 3)."""
        if not self.grad_sync.allows_device_skip:
            return None
        return fused_skip_target(optimizer, self.ctx.device)

    def _scaler_skips_on_device(self, amp) -> bool:
        """torch's GradScaler over a fused optimizer: the overflow skip needs no host sync."""
        from gridtrain.amp.torch_amp import TorchAmpOptimizer

        return isinstance(amp, TorchAmpOptimizer) and self._fused_target(amp.optim) is not None

    @property
    def nonfinite_in_a_row(self) -> int:
        """Optimizer windows in a row whose loss or gradient norm was not finite."""
        return self.nonfinite.in_a_row

    def zero_grad_all(self) -> None:
        """Drop every gradient now (a skipped window must not leak into the next one)."""
        self.optimizer.zero_grad(set_to_none=True)
        self.model.zero_grad(set_to_none=True)

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
        try:
            return self.schedule.run(
                self.steps, data_iter, forward_only, return_loss, return_output_label
            )
        except BaseException:
            if not forward_only:  # a failed batch is no micro-step
                self.accumulation.micro_step -= 1
            raise

    def __repr__(self) -> str:
        return (
            f"Engine(model={type(self.model).__name__}, optimizer={type(self.optimizer).__name__}, "
            f"schedule={type(self.schedule).__name__}, accumulation={self.accumulation.size}, "
            f"clip_grad_norm={self.clip_grad_norm}, ctx={self.ctx!r})"
        )


def _mark_token_labels(t: Any) -> Any:
    return mark_sequence_sharded(t) if isinstance(t, Tensor) and t.dim() >= 2 else t


def _batchnorm_buffers(model: nn.Module) -> list[Tensor]:
    return [
        b
        for m in model.modules()
        if isinstance(m, nn.modules.batchnorm._NormBase)
        for b in m.buffers(recurse=False)
        if b is not None
    ]
