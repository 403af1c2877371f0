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
from typing import Any

import torch
from torch import Tensor

from gridtrain.config.pipeline import check_microbatches, warmup_forwards
from gridtrain.engine.schedules.base import StepFunctions, check_flags, load_batch
from gridtrain.engine.schedules.pipeline_step import PipelineStep, concat, micro_batches
from gridtrain.parallel import comm
from gridtrain.parallel.context import ParallelContext
from gridtrain.parallel.mode import ParallelMode
from gridtrain.parallel.pipeline.p2p import Payload, PipelineP2P, as_tuple, input_grads


class PipelineSchedule:
    """1F1B: warm-up forwards, then one forward / one backward, then cool-down backwards.

    Each stage keeps at most ``pipeline_size - stage`` micro-batches' activations. The
    schedule holds only its settings: what one step needs lives in a ``PipelineStep`` made
    per ``run``. ``compute_s``: the last step's forward/backward seconds, measured when
    ``timing`` (for benchmarks; never read back).
    """

    name = "1f1b"  # parallel.pipeline.schedule

    def __init__(
        self,
        ctx: ParallelContext,
        num_microbatches: int,
        tensor_shape: tuple[int, ...] | None = None,
        dtype: torch.dtype = torch.float32,
        timing: bool = False,
    ):
        self.ctx = ctx
        self.num_microbatches = num_microbatches
        self.num_stages = ctx.world_size(ParallelMode.PIPELINE)
        self.stage = ctx.local_rank(ParallelMode.PIPELINE)
        check_microbatches(self.name, num_microbatches, self.num_stages, self._num_chunks())
        self.p2p = PipelineP2P(ctx, tensor_shape, dtype)
        self.timing = timing
        self.compute_s = 0.0

    @classmethod
    def from_config(cls, ctx: ParallelContext) -> PipelineSchedule:
        """The schedule as ``ctx.config`` sets it (``num_microbatches``, ``parallel.pipeline``)."""
        return cls(ctx, ctx.config.num_microbatches, ctx.config.parallel.pipeline.tensor_shape)

    # ---- one step ------------------------------------------------------------------------
    def run(
        self,
        steps: StepFunctions,
        data_iter: Any,
        forward_only: bool = False,
        return_loss: bool = True,
        return_output_label: bool = True,
    ) -> tuple[Any, Any, Tensor | None]:
        check_flags(forward_only, return_loss)
        step = self._new_step(steps, data_iter, forward_only, return_loss, return_output_label)
        self.p2p.new_step()  # activation shapes go once per step and stream, not per message
        try:
            with torch.no_grad() if forward_only else contextlib.nullcontext():
                self._run(step)
        finally:
            self.compute_s = step.compute_s
        loss = self._reduce_loss(step) if return_loss else None
        if return_output_label and self._is_last():
            return concat(step.outputs), concat(step.labels), loss
        return None, None, loss

    def _new_step(self, steps, data_iter, forward_only, return_loss, keep) -> PipelineStep:
        """This call's state: the batch split per tensor mode first (2d/2.5d/3d keep a slice
        of it), then cut into micro-batches."""
        m = self.num_microbatches
        data, label = load_batch(data_iter, self.ctx.device)
        inputs = micro_batches(steps.split(data), m, "inputs")
        labels = micro_batches(steps.split(label), m, "labels")
        steps.check_inputs(inputs[0])
        need_loss = return_loss or not forward_only
        if need_loss and steps.loss is None:
            raise ValueError(
                "pipeline training needs a criterion: gt.initialize(..., criterion=...)"
            )
        return PipelineStep(
            steps, inputs, labels, forward_only, need_loss, keep, timing=self.timing
        )

    def _run(self, step: PipelineStep) -> None:
        m, p, stage = self.num_microbatches, self.num_stages, self.stage
        forward_only = step.forward_only
        warmup = m if forward_only else warmup_forwards(self.name, m, p, 1, stage)
        remaining = m - warmup
        first, last = stage == 0, stage == p - 1
        inputs: list[Payload] = []
        outputs: list[Payload] = []
        comm = functools.partial(
            self.p2p.communicate, send_key=self._send_key(0), recv_key=self._recv_key(0)
        )
        for _ in range(warmup):
            x = None if first else comm(recv_prev=True)[0]
            y = self._forward(step, x, chunk=0)
            if not last:
                comm(send_next=y)
            if not forward_only:
                inputs.append(x)
                outputs.append(y)
        x = None if first or not remaining else comm(recv_prev=True)[0]
        for i in range(remaining):
            is_last_iter = i == remaining - 1
            y = self._forward(step, x, chunk=0)
            inputs.append(x)
            outputs.append(y)
            grad_y = None
            if not last:
                grad_y = comm(send_next=y, recv_next_like=outputs[0])[1]
            x_b, y_b = inputs.pop(0), outputs.pop(0)
            grad_x = self._backward(step, x_b, y_b, grad_y, final=is_last_iter and warmup == 0)
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
                grad_x = self._backward(step, x_b, y_b, grad_y, final=i == warmup - 1)
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

    def _forward(self, step: PipelineStep, x: Payload, chunk: int) -> Payload:
        """One micro-batch through one chunk; the last chunk returns the scaled loss."""
        steps = step.steps
        index = step.next_index(chunk)
        first = self._is_first(chunk)
        data = step.inputs[index] if first else as_tuple(x)
        with step.timed(self.ctx.device):
            out = steps.forward(data, chunk, None if first else step.inputs[index])
            if not self._is_last(chunk):
                return out
            if step.keep_outputs:
                step.outputs.append(out.detach() if isinstance(out, Tensor) else out)
            if not step.need_loss:
                return None
            loss = steps.loss(out, step.labels[index])
        step.losses.append(loss.detach().to(torch.promote_types(loss.dtype, torch.float32)))
        return loss / self.num_microbatches

    def _backward(
        self, step: PipelineStep, x: Payload, y: Payload, grad_y: Payload, final: bool = False
    ) -> Payload:
        """Back-propagate one micro-batch through one chunk; returns the gradient for ``x``."""
        steps = step.steps
        sync = steps.grad_sync() if final else contextlib.nullcontext()
        with step.timed(self.ctx.device), sync:
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

    def _reduce_loss(self, step: PipelineStep) -> Tensor:
        """The mean micro-batch loss of the last stage, on every stage of the pipeline."""
        # broadcast in float64: exact for every model dtype, and the same on every stage
        loss = torch.zeros((), dtype=torch.float64, device=self.ctx.device)
        if self._is_last() and step.losses:
            loss = torch.stack(step.losses).double().mean()
        last_rank = self.ctx.ranks(ParallelMode.PIPELINE)[-1]
        return comm.broadcast_(loss, last_rank, self.ctx.group(ParallelMode.PIPELINE))
