"""Interleaved 1F1B (Narayanan et al. 2021): each stage holds several model chunks.

Chunk ``c`` of stage ``s`` is virtual stage ``c * P + s``; micro-batches run in
groups of ``P`` per chunk, which cuts the bubble by ``num_chunks`` at the cost
of ``num_chunks`` times more point-to-point messages. The loop follows
Megatron-LM's ``forward_backward_pipelining_with_interleaving``.
"""

from __future__ import annotations

import torch

from gridtrain.config.pipeline import warmup_forwards
from gridtrain.engine.schedules.one_f_one_b import PipelineSchedule
from gridtrain.engine.schedules.pipeline_step import PipelineStep
from gridtrain.parallel.context import ParallelContext
from gridtrain.parallel.pipeline.p2p import Payload


class InterleavedPipelineSchedule(PipelineSchedule):
    """Interleaved 1F1B: each stage holds ``num_chunks`` model chunks (virtual stages).

    Chunk ``c`` of stage ``s`` is virtual stage ``c * P + s``; micro-batches run in
    groups of ``P`` per chunk, which cuts the bubble by ``num_chunks`` at the cost
    of ``num_chunks`` times more point-to-point messages. Needs
    ``num_microbatches % pipeline_size == 0``.
    """

    name = "interleaved"  # parallel.pipeline.schedule

    def __init__(
        self,
        ctx: ParallelContext,
        num_microbatches: int,
        num_chunks: int,
        tensor_shape: tuple[int, ...] | None = None,
        dtype: torch.dtype = torch.float32,
        timing: bool = False,
    ):
        self.num_chunks = num_chunks  # read by the micro-batch check in __init__
        super().__init__(ctx, num_microbatches, tensor_shape, dtype, timing)

    @classmethod
    def from_config(cls, ctx: ParallelContext) -> InterleavedPipelineSchedule:
        cfg = ctx.config
        pipeline = cfg.parallel.pipeline
        return cls(ctx, cfg.num_microbatches, pipeline.num_chunks, pipeline.tensor_shape)

    def _num_chunks(self) -> int:
        return self.num_chunks

    def _chunk_id(self, k: int, forward: bool) -> int:
        p, v = self.num_stages, self.num_chunks
        chunk = (k % (p * v)) // p
        return chunk if forward else v - chunk - 1

    def _run(self, step: PipelineStep) -> None:
        run = _InterleavedRun(self, step)
        run.warmup()
        run.steady()
        if not step.forward_only:
            run.cooldown()


class _InterleavedRun:
    """One step of the interleaved schedule: per-chunk queues of inputs, outputs and output
    gradients, and the three phases (warm-up forwards, 1F1B, cool-down backwards)."""

    def __init__(self, schedule: InterleavedPipelineSchedule, step: PipelineStep):
        self.s, self.step = schedule, step
        forward_only = step.forward_only
        p, v, stage = schedule.num_stages, schedule.num_chunks, schedule.stage
        self.p, self.v = p, v
        self.total = schedule.num_microbatches * v
        self.first_rank, self.last_rank = stage == 0, stage == p - 1
        self.forward_only = forward_only
        m = schedule.num_microbatches
        self.all_warmup = not forward_only and m == p  # one round: every forward first
        if forward_only:
            self.warmups = self.total
        else:
            self.warmups = warmup_forwards(schedule.name, m, p, v, stage)
        self.remaining = self.total - self.warmups
        self.inputs: list[list[Payload]] = [[] for _ in range(v)]
        self.outputs: list[list[Payload]] = [[] for _ in range(v)]
        self.grads: list[list[Payload]] = [[] for _ in range(v)]

    def like(self, chunk: int) -> Payload:
        """The output whose gradient arrives next for ``chunk`` (its shape is received)."""
        return self.outputs[chunk][len(self.grads[chunk])]

    def chunk_of(self, k: int, forward: bool) -> int:
        return self.s._chunk_id(k, forward)

    def forward(self, k: int) -> Payload:
        chunk = self.chunk_of(k, forward=True)
        if self.s._is_first(chunk) and len(self.inputs[chunk]) == len(self.outputs[chunk]):
            self.inputs[chunk].append(None)
        y = self.s._forward(self.step, self.inputs[chunk][-1], chunk)
        self.outputs[chunk].append(y)
        return None if self.s._is_last(chunk) else y

    def backward(self, k: int, final: bool) -> Payload:
        chunk = self.chunk_of(k, forward=False)
        if self.s._is_last(chunk) and not self.grads[chunk]:
            self.grads[chunk].append(None)
        x, y = self.inputs[chunk].pop(0), self.outputs[chunk].pop(0)
        grad_x = self.s._backward(self.step, x, y, self.grads[chunk].pop(0), final=final)
        return None if self.s._is_first(chunk) else grad_x

    def comm(self, fwd_chunk: int = 0, next_fwd: int = 0, **kw) -> tuple[Payload, Payload]:
        """The activation streams: out of ``fwd_chunk``, into ``next_fwd`` (shapes once a step)."""
        return self.s.p2p.communicate(
            send_key=self.s._send_key(fwd_chunk), recv_key=self.s._recv_key(next_fwd), **kw
        )

    def warmup(self) -> None:
        v, total = self.v, self.total
        self.inputs[0].append(None if self.first_rank else self.comm(recv_prev=True)[0])
        for k in range(self.warmups):
            y = self.forward(k)
            chunk, next_chunk = self.chunk_of(k, True), self.chunk_of(k + 1, True)
            recv_prev = not (self.first_rank and next_chunk == 0) and k != total - 1
            last_warmup = k == self.warmups - 1 and not self.forward_only
            if last_warmup and not self.all_warmup:
                recv_next = not self.last_rank
                like = self.like(v - 1) if recv_next else None
                x, g = self.comm(
                    chunk, next_chunk, send_next=y, recv_prev=recv_prev, recv_next_like=like
                )
                if recv_next:
                    self.grads[v - 1].append(g)
            else:
                x = self.comm(chunk, next_chunk, send_next=y, recv_prev=recv_prev)[0]
            if recv_prev:
                self.inputs[next_chunk].append(x)

    def _next_chunks(self, fk: int, bk: int) -> tuple[int, bool, int, bool]:
        """(next forward chunk, receive it?, next backward chunk, receive it?) after 1F1B step."""
        p, v = self.p, self.v
        recv_prev = recv_next = True
        if self.first_rank:  # the first stage is P - 1 micro-batches ahead of the last
            next_fwd = self.chunk_of(fk - (p - 1), True)
            recv_prev = next_fwd != v - 1
            next_fwd += 1
        else:
            next_fwd = self.chunk_of(fk + 1, True)
        if self.last_rank:
            next_bwd = self.chunk_of(bk - (p - 1), False)
            recv_next = next_bwd != 0
            next_bwd -= 1
        else:
            next_bwd = self.chunk_of(bk + 1, False)
        return next_fwd, recv_prev, next_bwd, recv_next

    def steady(self) -> None:
        for k in range(self.remaining):
            fk, bk = k + self.warmups, k
            y = self.forward(fk)
            grad_x = self.backward(bk, final=False)
            next_fwd, recv_prev, next_bwd, recv_next = self._next_chunks(fk, bk)
            recv_prev = recv_prev and k != self.remaining - 1
            x, g = self.comm(
                self.chunk_of(fk, True),
                next_fwd,
                send_next=y,
                send_prev=grad_x,
                recv_prev=recv_prev,
                recv_next_like=self.like(next_bwd) if recv_next else None,
            )
            if recv_prev:
                self.inputs[next_fwd].append(x)
            if recv_next:
                self.grads[next_bwd].append(g)

    def cooldown(self) -> None:
        v, total = self.v, self.total
        if self.all_warmup:
            g = None if self.last_rank else self.comm(recv_next_like=self.like(v - 1))[1]
            self.grads[v - 1].append(g)
        for k in range(self.remaining, total):
            grad_x = self.backward(k, final=k == total - 1)
            next_bwd = self.chunk_of(k + 1, False)
            recv_next = not (self.last_rank and next_bwd == v - 1) and k != total - 1
            like = self.like(next_bwd) if recv_next else None
            g = self.comm(send_prev=grad_x, recv_next_like=like)[1]
            self.grads[next_bwd].append(g)
