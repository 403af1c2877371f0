"""1F1B (PipeDream-Flush; Narayanan et al. 2021) over pipeline stages.

``engine.execute_schedule(data_iter)`` takes one batch (this data-parallel
rank's), splits it the way the tensor mode needs, cuts it into
``num_microbatches`` micro-batches and runs them through the stages: warm-up
forwards, then one forward / one backward, then cool-down backwards. The last
stage applies the criterion to each micro-batch and back-propagates
``loss / num_microbatches``; the loss returned on every stage is the mean over
the micro-batches (broadcast from the last stage). The loop follows Megatron-LM's
``forward_backward_pipelining_without_interleaving``.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from gridtrain.engine.schedules.base import StepFunctions, check_flags, load_batch
from gridtrain.parallel import comm
from gridtrain.parallel.context import ParallelContext
from gridtrain.parallel.mode import ParallelMode
from gridtrain.parallel.pipeline.p2p import Payload, PipelineP2P, as_tuple, input_grads


def _micro(x: Any, m: int, what: str) -> list[Any]:
    """``m`` micro-batches of ``x`` (a tensor, a tuple/list or dict of tensors, or None)
    along dim 0; a dict (Hugging Face's ``input_ids``, ``attention_mask``...) stays a dict."""
    if x is None:
        return [None] * m
    if isinstance(x, dict):
        parts = {k: _micro(v, m, f"{what}[{k!r}]") for k, v in x.items()}
        return [{k: p[i] for k, p in parts.items()} for i in range(m)]
    if isinstance(x, tuple | list):
        parts = [_micro(t, m, what) for t in x]
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


def _cat(parts: list[Any]) -> Any:
    if not parts or parts[0] is None:
        return None
    if isinstance(parts[0], Mapping):  # a dict or a Hugging Face ModelOutput
        return type(parts[0])(**{k: _cat([p[k] for p in parts]) for k in parts[0]})
    if isinstance(parts[0], tuple):
        return tuple(_cat([p[i] for p in parts]) for i in range(len(parts[0])))
    return torch.cat([p.detach() for p in parts], dim=0)


class PipelineSchedule:
    """1F1B: warm-up forwards, then one forward / one backward, then cool-down backwards.

    Each stage keeps at most ``pipeline_size - stage`` micro-batches' activations.
    """

    def __init__(
        self,
        ctx: ParallelContext,
        num_microbatches: int,
        tensor_shape: tuple[int, ...] | None = None,
        dtype: torch.dtype = torch.float32,
        timing: bool = False,
    ):
        if num_microbatches < 1:
            raise ValueError(f"num_microbatches must be >= 1, got {num_microbatches}")
        self.ctx = ctx
        self.num_microbatches = num_microbatches
        self.num_stages = ctx.world_size(ParallelMode.PIPELINE)
        self.stage = ctx.local_rank(ParallelMode.PIPELINE)
        self.p2p = PipelineP2P(ctx, tensor_shape, dtype)
        self.timing = timing
        self.compute_s = 0.0  # seconds of forward/backward compute in the last step (timing=True)

    # ---- one step ------------------------------------------------------------------------
    def run(
        self,
        steps: StepFunctions,
        data_iter: Any,
        forward_only: bool = False,
        return_loss: bool = True,
        return_output_label: bool = True,
    ) -> tuple[Any, Any, Tensor | None]:
        m = self.num_microbatches
        check_flags(forward_only, return_loss)
        data, label = load_batch(data_iter, self.ctx.device)
        # split per tensor mode first (2d/2.5d/3d keep a slice of the batch), then micro-batch
        self._inputs = _micro(steps.split(data), m, "inputs")
        self._labels = _micro(steps.split(label), m, "labels")
        steps.check_inputs(self._inputs[0])
        self._steps = steps
        self._forward_only = forward_only
        self._need_loss = return_loss or not forward_only
        self._losses: list[Tensor] = []
        self._outputs: list[Any] = []
        self._keep_outputs = return_output_label
        self._fwd_count: dict[int, int] = {}
        self.compute_s = 0.0
        if self._need_loss and steps.loss is None:
            raise ValueError(
                "pipeline training needs a criterion: gt.initialize(..., criterion=...)"
            )
        self.p2p.new_step()  # activation shapes go once per step and stream, not per message
        with torch.no_grad() if forward_only else contextlib.nullcontext():
            self._run(forward_only)
        loss = self._reduce_loss() if return_loss else None
        if return_output_label and self._is_last():
            return _cat(self._outputs), _cat(self._labels), loss
        return None, None, loss

    def _run(self, forward_only: bool) -> None:
        m, p, stage = self.num_microbatches, self.num_stages, self.stage
        warmup = m if forward_only else min(p - stage - 1, m)
        remaining = m - warmup
        first, last = stage == 0, stage == p - 1
        inputs: list[Payload] = []
        outputs: list[Payload] = []
        comm = functools.partial(
            self.p2p.communicate, send_key=self._send_key(0), recv_key=self._recv_key(0)
        )
        for _ in range(warmup):
            x = None if first else comm(recv_prev=True)[0]
            y = self._forward(x, chunk=0)
            if not last:
                comm(send_next=y)
            if not forward_only:
                inputs.append(x)
                outputs.append(y)
        x = None if first or not remaining else comm(recv_prev=True)[0]
        for i in range(remaining):
            is_last_iter = i == remaining - 1
            y = self._forward(x, chunk=0)
            inputs.append(x)
            outputs.append(y)
            grad_y = None
            if not last:
                grad_y = comm(send_next=y, recv_next_like=outputs[0])[1]
            x_b, y_b = inputs.pop(0), outputs.pop(0)
            grad_x = self._backward(x_b, y_b, grad_y, final=is_last_iter and warmup == 0)
            if first:
                x = None
            elif is_last_iter:
                comm(send_prev=grad_x)
            else:
                x = comm(send_prev=grad_x, recv_prev=True)[0]
        if not forward_only:
            for i in range(warmup):
                x_b, y_b = inputs.pop(0), outputs.pop(0)
                grad_y = None if last else comm(recv_next_like=y_b)[1]
                grad_x = self._backward(x_b, y_b, grad_y, final=i == warmup - 1)
                if not first:
                    comm(send_prev=grad_x)

    # ---- helpers shared with the interleaved schedule ------------------------------------
    def _is_first(self, chunk: int = 0) -> bool:
        return self.stage == 0 and chunk == 0

    def _is_last(self, chunk: int | None = None) -> bool:
        chunks = self._num_chunks()
        chunk = chunks - 1 if chunk is None else chunk
        return self.stage == self.num_stages - 1 and chunk == chunks - 1

    def _num_chunks(self) -> int:
        return 1

    def _send_key(self, chunk: int) -> int:
        """The activation stream ``chunk`` sends on: the virtual stage that receives it."""
        return chunk * self.num_stages + self.stage + 1

    def _recv_key(self, chunk: int) -> int:
        """The activation stream ``chunk`` receives on: its own virtual stage."""
        return chunk * self.num_stages + self.stage

    @contextlib.contextmanager
    def _timed(self):
        if not self.timing:
            yield
            return
        sync = torch.cuda.synchronize if self.ctx.device.type == "cuda" else (lambda: None)
        sync()
        start = time.perf_counter()
        try:
            yield
        finally:
            sync()
            self.compute_s += time.perf_counter() - start

    def _forward(self, x: Payload, chunk: int) -> Payload:
        """One micro-batch through one chunk; the last chunk returns the scaled loss."""
        steps = self._steps
        index = self._fwd_count.get(chunk, 0)
        self._fwd_count[chunk] = index + 1
        first = self._is_first(chunk)
        data = self._inputs[index] if first else as_tuple(x)
        with self._timed():
            out = steps.forward(data, chunk, None if first else self._inputs[index])
            if not self._is_last(chunk):
                return out
            if self._keep_outputs:
                self._outputs.append(out.detach() if isinstance(out, Tensor) else out)
            if not self._need_loss:
                return None
            loss = steps.loss(out, self._labels[index])
        self._losses.append(loss.detach().to(torch.promote_types(loss.dtype, torch.float32)))
        return loss / self.num_microbatches

    def _backward(self, x: Payload, y: Payload, grad_y: Payload, final: bool = False) -> Payload:
        """Back-propagate one micro-batch through one chunk; returns the gradient for ``x``."""
        steps = self._steps
        sync = steps.grad_sync() if final else contextlib.nullcontext()
        with self._timed(), sync:
            if grad_y is None:  # y is this micro-batch's loss
                steps.backward(y)
            else:
                pairs = [
                    (t, g)
                    for t, g in zip(as_tuple(y), grad_y, strict=False)
                    if g is not None and t.requires_grad
                ]
                if pairs:
                    outs, grads = zip(*pairs, strict=True)
                    torch.autograd.backward(outs, grads)
        return input_grads(x)

    def _reduce_loss(self) -> Tensor:
        """The mean micro-batch loss of the last stage, on every stage of the pipeline."""
        # broadcast in float64: exact for every model dtype, and the same on every stage
        loss = torch.zeros((), dtype=torch.float64, device=self.ctx.device)
        if self._is_last() and self._losses:
            loss = torch.stack(self._losses).double().mean()
        last_rank = self.ctx.ranks(ParallelMode.PIPELINE)[-1]
        return comm.broadcast_(loss, last_rank, self.ctx.group(ParallelMode.PIPELINE))
