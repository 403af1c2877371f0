"""Schedules: how one batch becomes forward and backward passes (the non-pipeline one here)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor


def to_device(obj: Any, device: torch.device) -> Any:
    """Move every tensor inside tuples, lists and dicts to ``device``."""
    if isinstance(obj, Tensor):
        return obj.to(device, non_blocking=True)
    if isinstance(obj, tuple | list):
        return type(obj)(to_device(o, device) for o in obj)
    if isinstance(obj, dict):
        return {k: to_device(v, device) for k, v in obj.items()}
    return obj


class Schedule:
    """Runs forward (and backward) over one batch drawn from ``data_iter``."""

    def forward_backward_step(
        self,
        engine,
        data_iter: Iterator,
        forward_only: bool = False,
        return_loss: bool = True,
        return_output_label: bool = True,
    ) -> tuple[Any, Any, Tensor | None]:
        """Returns (output, label, loss); output and label are None unless asked for."""
        raise NotImplementedError

    @staticmethod
    def load_batch(data_iter: Iterator, device: torch.device) -> tuple[Any, Any]:
        """Next ``(data, label)`` pair (a bare tensor is data without label), moved to ``device``."""
        batch = next(data_iter)
        if isinstance(batch, tuple | list) and len(batch) == 2:
            data, label = batch
        elif isinstance(batch, Tensor | dict):
            data, label = batch, None
        else:
            raise TypeError(
                "a batch must be a (data, label) pair, a tensor or a dict, "
                f"got {type(batch).__name__}"
                + (f" of length {len(batch)}" if isinstance(batch, tuple | list) else "")
            )
        return to_device(data, device), to_device(label, device)


class NonPipelineSchedule(Schedule):
    """One forward, one loss, one backward: the whole model lives on this rank's stage."""

    def forward_backward_step(
        self,
        engine,
        data_iter: Iterator,
        forward_only: bool = False,
        return_loss: bool = True,
        return_output_label: bool = True,
    ) -> tuple[Any, Any, Tensor | None]:
        if not forward_only and not return_loss:
            raise ValueError(
                "execute_schedule: return_loss must be True when forward_only is False"
            )
        data, label = self.load_batch(data_iter, engine.ctx.device)
        data, label = engine.split_batch(data), engine.split_batch(label)
        grad_mode = torch.no_grad() if forward_only else contextlib.nullcontext()
        with grad_mode:
            output = engine.forward_split(data)
            loss = engine.compute_loss(output, label) if return_loss else None
        if not forward_only:
            with engine.overlap_grad_sync():
                engine.backward(loss)
        if loss is not None:
            loss = loss.detach()
        if return_output_label:
            return output, label, loss
        return None, None, loss
