"""The schedule without pipeline parallelism: one forward, one loss, one backward."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor

from gridtrain.engine.schedules.base import StepFunctions, check_flags, load_batch


class NonPipelineSchedule:
    """The whole model lives on this rank: the batch goes through it in one pass."""

    def run(
        self,
        steps: StepFunctions,
        data_iter: Iterator,
        forward_only: bool = False,
        return_loss: bool = True,
        return_output_label: bool = True,
    ) -> tuple[Any, Any, Tensor | None]:
        check_flags(forward_only, return_loss)
        data, label = load_batch(data_iter, steps.device)
        data, label = steps.split(data), steps.split(label)
        with torch.no_grad() if forward_only else contextlib.nullcontext():
            output = steps.forward(data, None)
            loss = None
            if return_loss:
                if steps.loss is None:
                    raise ValueError("this engine has no criterion: pass criterion= to initialize")
                loss = steps.loss(output, label)
        if not forward_only:
            with steps.grad_sync():
                steps.backward(loss)
        loss = loss.detach() if loss is not None else None
        return (output, label, loss) if return_output_label else (None, None, loss)
