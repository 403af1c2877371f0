"""NVIDIA apex O-levels, when apex is installed."""

from __future__ import annotations

from torch import Tensor, nn
from torch.optim import Optimizer

from gridtrain.amp.optimizer import AmpOptimizer


def apex_initialize(
    model: nn.Module, optim: Optimizer, opt_level: str
) -> tuple[nn.Module, AmpOptimizer]:
    """``apex.amp.initialize``; an ImportError naming the alternatives when apex is missing."""
    try:
        from apex import amp
    except ImportError:
        raise ImportError(
            "fp16 mode 'apex' needs NVIDIA apex, which is not installed; use "
            "fp16=dict(mode=AMP_TYPE.TORCH) (autocast + GradScaler), AMP_TYPE.NAIVE "
            "(fp16 model, fp32 master weights) or AMP_TYPE.BF16"
        ) from None
    model, optim = amp.initialize(model, optim, opt_level=opt_level, verbosity=0)
    return model, ApexAmpOptimizer(optim, amp)


class ApexAmpOptimizer(AmpOptimizer):
    """apex scales the loss and skips overflowing steps inside its patched optimizer."""

    def __init__(self, optim: Optimizer, amp):
        super().__init__(optim)
        self._amp = amp

    def backward(self, loss: Tensor) -> None:
        with self._amp.scale_loss(loss, self.optim) as scaled:
            scaled.backward()

    def grad_params(self) -> list[Tensor]:
        return list(self._amp.master_params(self.optim))
