"""What one call of a pipeline schedule holds: its micro-batches, the last stage's outputs and
losses, and the compute time. Made per call and dropped after it, so a schedule object keeps
nothing from one step to the next (two engines, or a step that raised, leave nothing behind)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from gridtrain.engine.schedules.base import StepFunctions


def micro_batches(x: Any, m: int, what: str) -> list[Any]:
    """``m`` micro-batches of ``x`` (a tensor, a tuple/list or dict of tensors, or None)
    along dim 0; a dict (Hugging Face's ``input_ids``, ``attention_mask``...) stays a dict."""
    if x is None:
        return [None] * m
    if isinstance(x, dict):
        parts = {k: micro_batches(v, m, f"{what}[{k!r}]") for k, v in x.items()}
        return [{k: p[i] for k, p in parts.items()} for i in range(m)]
    if isinstance(x, tuple | list):
        parts = [micro_batches(t, m, what) for t in x]
        return [tuple(p[i] for p in parts) for i in range(m)]
    if not isinstance(x, Tensor):
        raise TypeError(
            f"pipeline {what} must be tensors (or tuples of them), got {type(x).__name__}"
        )
    if x.shape[0] % m:
        raise ValueError(
            f"batch size {x.shape[0]} (this rank's {what}) is not divisible by num_microbatches {m}"
        )
    return list(x.chunk(m, dim=0))


def concat(parts: list[Any]) -> Any:
    """The micro-batches' outputs (or labels) joined back into one batch."""
    if not parts or parts[0] is None:
        return None
    if isinstance(parts[0], Mapping):  # a dict or a Hugging Face ModelOutput
        return type(parts[0])(**{k: concat([p[k] for p in parts]) for k in parts[0]})
    if isinstance(parts[0], tuple):
        return tuple(concat([p[i] for p in parts]) for i in range(len(parts[0])))
    return torch.cat([p.detach() for p in parts], dim=0)


@dataclass
class PipelineStep:
    """One step's state: ``inputs``/``labels`` (this rank's micro-batches), what the step was
    asked for, the last stage's ``outputs`` and ``losses``, forwards run per chunk, and the
    seconds of forward/backward compute (measured when ``timing``)."""

    steps: StepFunctions
    inputs: list[Any]
    labels: list[Any]
    forward_only: bool
    need_loss: bool
    keep_outputs: bool
    timing: bool = False
    losses: list[Tensor] = field(default_factory=list)
    outputs: list[Any] = field(default_factory=list)
    fwd_count: dict[int, int] = field(default_factory=dict)
    compute_s: float = 0.0

    def next_index(self, chunk: int) -> int:
        """The micro-batch that ``chunk`` runs next (each chunk runs them in order)."""
        index = self.fwd_count.get(chunk, 0)
        self.fwd_count[chunk] = index + 1
        return index

    @contextlib.contextmanager
    def timed(self, device: torch.device):
        """Adds the block's seconds to ``compute_s`` (synchronising CUDA) when ``timing``."""
        if not self.timing:
            yield
            return
        sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        sync()
        start = time.perf_counter()
        try:
            yield
        finally:
            sync()
            self.compute_s += time.perf_counter() - start
