"""What every schedule shares: the step functions it is given, batch loading and micro-batches.

A schedule turns one batch into forward and backward passes. It is given
``StepFunctions`` (built by the engine) and never sees the engine itself, so a
schedule is a plain loop over these calls that can be read on its own.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor


@dataclass(frozen=True)
class StepFunctions:
    """The operations a schedule may run, each already configured by the engine.

    * ``forward(data, chunk, batch=None)``: the model on this rank's (already split) data: a
      tensor, a tuple of positional arguments or a dict of keyword arguments; ``chunk`` picks
      a pipeline chunk (None: the whole local model). A pipeline chunk other than the
      model's first is given the activation received as ``data`` and its micro-batch as
      ``batch`` (a stage that runs the model's own forward reads masks and positions from
      it). Runs under the configured autocast.
    * ``loss(output, label)``: the criterion on already-split labels (the label exactly as
      the batch gave it: a tensor, or a tuple/dict of them), under autocast.
    * ``backward(loss)``: back-propagates one micro-batch's loss, scaled for gradient
      accumulation and the fp16 loss scale.
    * ``grad_sync()``: a context manager to wrap the last backward of an accumulation
      window in (the data-parallel all-reduce then overlaps it).
    * ``split(batch)``: this rank's part of a batch under the tensor mode.
    * ``check_inputs(data)``: refuses, before any transfer, a batch the pipeline stages cannot
      run (every stage checks the same batch, so none is left waiting).
    """

    forward: Callable[[Any, int | None], Any]
    loss: Callable[[Any, Any], Tensor] | None
    backward: Callable[[Tensor], None]
    grad_sync: Callable[[], contextlib.AbstractContextManager]
    split: Callable[[Any], Any]
    device: torch.device
    check_inputs: Callable[[Any], None] = lambda data: None


class Schedule(Protocol):
    """Runs forward (and backward) over one batch drawn from ``data_iter``."""

    def run(
        self,
        steps: StepFunctions,
        data_iter: Iterator,
        forward_only: bool = False,
        return_loss: bool = True,
        return_output_label: bool = True,
    ) -> tuple[Any, Any, Tensor | None]:
        """Returns (output, label, loss); output and label are None unless asked for."""


def to_device(obj: Any, device: torch.device) -> Any:
    """Move every tensor inside tuples, lists and dicts to ``device``."""
    if isinstance(obj, Tensor):
        return obj.to(device, non_blocking=True)
    if isinstance(obj, tuple | list):
        return type(obj)(to_device(o, device) for o in obj)
    if isinstance(obj, dict):
        return {k: to_device(v, device) for k, v in obj.items()}
    return obj


def load_batch(data_iter: Iterator, device: torch.device) -> tuple[Any, Any]:
    """Next ``(data, label)`` pair (a bare tensor or a dict is data without label), on ``device``.

    A dict holding ``labels`` (the Hugging Face convention) gives them as the label.
    """
    batch = next(data_iter)
    if isinstance(batch, tuple | list) and len(batch) == 2:
        data, label = batch
    elif isinstance(batch, dict):
        data = {k: v for k, v in batch.items() if k != "labels"}
        label = batch.get("labels")
    elif isinstance(batch, Tensor):
        data, label = batch, None
    else:
        raise TypeError(
            "a batch must be a (data, label) pair, a tensor or a dict, "
            f"got {type(batch).__name__}"
            + (f" of length {len(batch)}" if isinstance(batch, tuple | list) else "")
        )
    return to_device(data, device), to_device(label, device)


def check_flags(forward_only: bool, return_loss: bool) -> None:
    if not forward_only and not return_loss:
        raise ValueError("execute_schedule: return_loss must be True when forward_only is False")
