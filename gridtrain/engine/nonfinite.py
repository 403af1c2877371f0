"""The non-finite guard: a NaN/inf loss or gradient norm skips the optimizer step on every rank.

Without a loss scaler nothing else looks out for inf/NaN (fp32, bf16). The flag is
one device scalar per accumulation window (any micro-step's loss, the clipped norm),
maxed over every rank. Asking the host "was it bad?" before stepping is a
device-to-host sync each step, which leaves the GPU idle while the next step's
kernels are launched. Optimizers that take torch's ``found_inf`` argument (the
fused Adam/AdamW/SGD, as GradScaler drives them) skip on the device instead; on
CUDA the host then reads the flag one step later, from a pinned copy, when it is
long done, so the counting (``global_step``, ``max_nonfinite_steps``) lags by a step
and an LR scheduler still advances on a skipped step, as under torch's GradScaler.

Under fp16 the loss scaler skips overflowing steps itself; the guard counts them in a row
(``OverflowRun``), warns as the run grows and stops training at ``fp16.max_skipped_steps``.

The guard also concludes each window: ``before_step``/``after_step`` return the step's
``Outcome`` (taken, overflowed, not finite) as far as it is known, fp16 overflows
included, and ``global_step`` is the windows concluded less those known skipped.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Callable, Iterator
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor

from gridtrain.parallel import comm

logger = logging.getLogger("gridtrain")


class NonFiniteLossError(RuntimeError):
    """Training stopped: the loss or gradient norm was not finite ``max_nonfinite_steps`` times."""


@dataclasses.dataclass
class WindowCheck:
    """What the engine learnt about a window's gradients before its optimizer step."""

    overflow: bool = False  # fp16 overflow read on the host: the step is skipped
    overflow_flag: Tensor | None = None  # GradScaler's flag, left on the device for a fused step
    flag: Tensor | None = None  # the non-finite flag (no loss scaler), maxed over every rank
    device_skip: torch.optim.Optimizer | None = None  # the fused optimizer skipping on ``flag``


class Outcome(NamedTuple):
    """A window's outcome as known now (deferred device flags: not yet, so taken)."""

    overflow: bool = False
    nonfinite: bool = False

    @property
    def stepped(self) -> bool:
        return not (self.overflow or self.nonfinite)


class NonFiniteGuard:
    """Decides (or lets the device decide) each window's skip and counts the windows.

    ``steps_taken`` is the engine's ``global_step``: windows concluded less those known
    skipped. A window skipped on the device counts as taken until its flag is read (at
    once, or a step later on CUDA), as the step's return value says.
    """

    def __init__(
        self,
        device: torch.device,
        group,
        limit: int,
        defer: bool | None = None,
        overflow_limit: int = 0,
    ):
        self.device = device
        self.group = group  # the GLOBAL group, None on one process
        self.limit = limit
        self.overflows = OverflowRun(overflow_limit)  # fp16: skips for overflow in a row
        defer = device.type == "cuda" if defer is None else defer
        self.late = LateFlag(defer)  # the non-finite flag of a device-skipped step
        self.overflow = LateFlag(defer)  # fp16: the loss scaler's overflow flag, the same way
        self.in_a_row = 0
        self.windows = 0  # optimizer windows concluded, skipped or not
        self.skipped = 0  # of them, those known to have skipped their step
        self.speaks = group is None or dist.get_rank(group) == 0  # every rank skips; one says so
        self._flag: Tensor | None = None  # any non-finite loss in this window (on device)

    @property
    def steps_taken(self) -> int:
        return self.windows - self.skipped

    @steps_taken.setter
    def steps_taken(self, value: int) -> None:  # a resumed run's count
        self.windows = value + self.skipped

    def observe_loss(self, loss: Tensor) -> None:
        """Note one micro-step's loss (no sync)."""
        bad = ~torch.isfinite(loss.detach()).all()
        self._flag = bad if self._flag is None else self._flag | bad

    def window_flag(self, grad_norm: Tensor | None) -> Tensor:
        """This window's flag as a float device scalar, maxed over every rank; resets the window."""
        bad = torch.zeros((), dtype=torch.float32, device=self.device)
        if self._flag is not None:
            bad = self._flag.float().to(bad.device)
        self._flag = None
        if grad_norm is not None:
            bad = torch.maximum(bad, (~torch.isfinite(grad_norm)).float())
        if self.group is not None:
            comm.all_reduce_(bad, self.group, op=dist.ReduceOp.MAX)
        return bad

    def before_step(self, check: WindowCheck, drop_grads: Callable[[], None]) -> Outcome:
        """The outcome known before the optimizer steps: an overflow read on the host, or a
        non-finite window read at once (no fused optimizer to skip on the device). A window
        skipped here is concluded here."""
        nonfinite = False
        if check.flag is not None and check.device_skip is None:
            nonfinite = bool(check.flag.item())
            self.record(nonfinite, self.windows, drop_grads)
        outcome = Outcome(check.overflow, nonfinite)
        if not outcome.stepped:
            self._conclude(outcome)
        return outcome

    def after_step(self, check: WindowCheck, drop_grads: Callable[[], None]) -> Outcome:
        """After the optimizer stepped, skipping or not on a device flag: the flags read now,
        or queued for :meth:`settle` (deferred: taken until then). Concludes the window."""
        nonfinite = overflow = False
        if check.device_skip is not None:
            late = self.late.push(check.flag)
            if late is not None:
                nonfinite = late
                self.record(late, self.windows, drop_grads)
        known = True
        if check.overflow_flag is not None:
            late = self.overflow.push(check.overflow_flag)
            known = late is not None
            overflow = bool(late)
        outcome = Outcome(overflow, nonfinite)
        self._conclude(outcome, overflow_known=known)
        return outcome

    def settle(self) -> None:
        """Read the flags the last window queued (waits for them) and count its skip."""
        overflow = self.overflow.pop()
        if overflow is not None:
            self.overflows.count(overflow, self.windows - 1, self.speaks)
        if overflow:
            self.skipped += 1
            logger.info("fp16 gradients overflowed: step skipped on every rank")
        late = self.late.pop()
        if late is not None:
            self.skipped += late
            self.record(late, self.windows - 1, None)

    def _conclude(self, outcome: Outcome, overflow_known: bool = True) -> None:
        self.windows += 1
        self.skipped += not outcome.stepped
        if overflow_known:  # else settle() counts it, when the device flag is read
            self.overflows.count(outcome.overflow, self.windows - 1, self.speaks)

    def record(self, bad: bool, window: int, drop_grads: Callable[[], None] | None) -> None:
        """Count a non-finite check's result; ``max_nonfinite_steps`` bad ones in a row raise.

        ``window``: the window's own number (skipped windows included), named in the warning.
        """
        if not bad:
            self.in_a_row = 0
            return
        self.in_a_row += 1
        if drop_grads is not None:
            drop_grads()
        if self.speaks:
            logger.warning(
                "non-finite loss or gradient norm: step %d skipped on every rank (%d in a row)",
                window,
                self.in_a_row,
            )
        if self.limit and self.in_a_row >= self.limit:
            raise NonFiniteLossError(
                f"the loss or gradient norm was not finite in {self.in_a_row} steps "
                f"in a row (max_nonfinite_steps = {self.limit}); lower the learning rate, clip "
                "gradients or check the data"
            )

    @property
    def defer(self) -> bool:
        """Read device flags a step late (CUDA) instead of at once."""
        return self.late.defer

    @defer.setter
    def defer(self, value: bool) -> None:
        self.late.defer = self.overflow.defer = value


class OverflowRun:
    """fp16: optimizer steps skipped in a row because the gradients overflowed. A few at the
    start are the loss scale finding its level; a long run means the loss or the gradients
    are inf/NaN whatever the scale, and training would only skip on (or, with a scale that
    reached 0, write NaN). Each skip from the ``QUIET``-th on is a warning; ``limit`` in a row
    (``fp16.max_skipped_steps``, 0 = never) raise :class:`NonFiniteLossError`."""

    QUIET = 4  # skips in a row that pass as calibration (logged at INFO by the engine)

    def __init__(self, limit: int):
        self.limit = limit
        self.in_a_row = 0

    def count(self, overflow: bool, window: int, speaks: bool) -> None:
        if not overflow:
            self.in_a_row = 0
            return
        self.in_a_row += 1
        if speaks and self.in_a_row >= self.QUIET:
            stop = f"; training stops at {self.limit}" if self.limit else ""
            logger.warning(
                "fp16 gradients overflowed: step %d skipped on every rank (%d in a row%s)",
                window,
                self.in_a_row,
                stop,
            )
        if self.limit and self.in_a_row >= self.limit:
            raise NonFiniteLossError(
                f"fp16: the gradients overflowed in {self.in_a_row} optimizer steps in a row "
                f"(fp16.max_skipped_steps = {self.limit}), so no loss scale makes them finite: "
                "the loss or the gradients are inf/NaN. Lower the learning rate, clip "
                "gradients or check the data"
            )


class LateFlag:
    """A device flag the host reads without stalling the device: at once where reading is
    free (CPU, or ``defer`` off), else a step later from a pinned copy (CUDA)."""

    def __init__(self, defer: bool):
        self.defer = defer
        self._pending: tuple[Tensor, object | None] | None = None  # host copy, its CUDA event

    def push(self, flag: Tensor) -> bool | None:
        """This flag's value now, or None when it is queued for :meth:`pop` (deferred)."""
        if not self.defer:
            return bool(flag.item())
        event = None
        if flag.is_cuda:  # a pinned copy the host can read without waiting for this step
            host = torch.empty((), dtype=flag.dtype, pin_memory=True)
            host.copy_(flag.reshape(()), non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        else:
            host = flag.reshape(()).clone()
        self._pending = (host, event)
        return None

    def pop(self) -> bool | None:
        """The queued flag (waits for it; it is a step old), or None if none is queued."""
        if self._pending is None:
            return None
        host, event = self._pending
        self._pending = None
        if event is not None:
            event.synchronize()
        return bool(host.item())


def fused_skip_target(optimizer, device: torch.device) -> torch.optim.Optimizer | None:
    """The torch optimizer under ``optimizer`` if it can skip a step on ``found_inf`` itself:
    a fused one whose parameters all live on ``device`` (an offloaded CPU optimizer would
    read a device flag that is still in flight) and already have state (fused SGD creates
    its momentum with ``empty_like`` on the first step even when it then skips)."""
    inner = getattr(optimizer, "optim", optimizer)
    if not isinstance(inner, torch.optim.Optimizer) or not getattr(
        inner, "_step_supports_amp_scaling", False
    ):
        return None
    for group in inner.param_groups:
        for p in group["params"]:
            if p.device != device or not inner.state.get(p):
                return None
    return inner


@contextlib.contextmanager
def found_inf(optimizer: torch.optim.Optimizer | None, flag: Tensor | None) -> Iterator[None]:
    """Hand ``flag`` to a fused optimizer's next step (it leaves the parameters and its
    step counts unchanged where the flag is non-zero); nothing without an optimizer."""
    if optimizer is None:
        yield
        return
    optimizer.found_inf = flag
    try:
        yield
    finally:
        del optimizer.found_inf
