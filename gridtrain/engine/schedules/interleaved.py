"""Interleaved 1F1B (Narayanan et al. 2021): each stage holds several model chunks.

Chunk ``c`` of stage ``s`` is virtual stage ``c * P + s``; micro-batches run in
groups of ``P`` per chunk, which cuts the bubble by ``num_chunks`` at the cost
of ``num_chunks`` times more point-to-point messages. The loop follows
Megatron-LM's ``forward_backward_pipelining_with_interleaving``.
"""

from __future__ import annotations

import torch

from gridtrain.engine.schedules.one_f_one_b import PipelineSchedule
from gridtrain.parallel.context import ParallelContext
from gridtrain.parallel.mode import ParallelMode
from gridtrain.parallel.pipeline.p2p import Payload


class InterleavedPipelineSchedule(PipelineSchedule):
    """Interleaved 1F1B: each stage holds ``num_chunks`` model chunks (virtual stages).

    Chunk ``c`` of stage ``s`` is virtual stage ``c * P + s``; micro-batches run in
    groups of ``P`` per chunk, which cuts the bubble by ``num_chunks`` at the cost
    of ``num_chunks`` times more point-to-point messages. Needs
    ``num_microbatches % pipeline_size == 0``.
    """

    def __init__(
        self,
        ctx: ParallelContext,
        num_microbatches: int,
        num_chunks: int,
        tensor_shape: tuple[int, ...] | None = None,
        dtype: torch.dtype = torch.float32,
        timing: bool = False,
    ):
        p = ctx.world_size(ParallelMode.PIPELINE)
        check_interleaved(num_microbatches, p, num_chunks)
        super().__init__(ctx, num_microbatches, tensor_shape, dtype, timing)
        self.num_chunks = num_chunks

    def _num_chunks(self) -> int:
        return self.num_chunks

    def _chunk_id(self, k: int, forward: bool) -> int:
        p, v = self.num_stages, self.num_chunks
        chunk = (k % (p * v)) // p
        return chunk if forward else v - chunk - 1

    def _run(self, forward_only: bool) -> None:
        p, v, stage = self.num_stages, self.num_chunks, self.stage
        total = self.num_microbatches * v
        first_rank, last_rank = stage == 0, stage == p - 1
        all_warmup = False
        if forward_only:
            warmup = total
        elif self.num_microbatches == p:
            warmup, all_warmup = total, True
        else:
            warmup = min((p - stage - 1) * 2 + (v - 1) * p, total)
        remaining = total - warmup
        inputs: list[list[Payload]] = [[] for _ in range(v)]
        outputs: list[list[Payload]] = [[] for _ in range(v)]
        grads: list[list[Payload]] = [[] for _ in range(v)]

        def like(chunk: int) -> Payload:  # the output whose gradient arrives next for chunk
            return outputs[chunk][len(grads[chunk])]

        def forward(k: int) -> Payload:
            chunk = self._chunk_id(k, forward=True)
            if self._is_first(chunk) and len(inputs[chunk]) == len(outputs[chunk]):
                inputs[chunk].append(None)
            y = self._forward(inputs[chunk][-1], chunk)
            outputs[chunk].append(y)
            return y

        def backward(k: int, final: bool) -> Payload:
            chunk = self._chunk_id(k, forward=False)
            if self._is_last(chunk) and not grads[chunk]:
                grads[chunk].append(None)
            x, y, g = inputs[chunk].pop(0), outputs[chunk].pop(0), grads[chunk].pop(0)
            return self._backward(x, y, g, final=final)

        def comm(fwd_chunk: int = 0, next_fwd: int = 0, **kw) -> tuple[Payload, Payload]:
            # the activation streams: out of fwd_chunk, into next_fwd (shapes once a step)
            return self.p2p.communicate(
                send_key=self._send_key(fwd_chunk), recv_key=self._recv_key(next_fwd), **kw
            )

        inputs[0].append(None if first_rank else comm(recv_prev=True)[0])
        for k in range(warmup):
            y = forward(k)
            chunk = self._chunk_id(k, forward=True)
            next_chunk = self._chunk_id(k + 1, forward=True)
            recv_prev = not (first_rank and next_chunk == 0) and k != total - 1
            if self._is_last(chunk):
                y = None
            if k == warmup - 1 and not forward_only and not all_warmup:
                recv_next = not last_rank
                x, g = comm(
                    chunk,
                    next_chunk,
                    send_next=y,
                    recv_prev=recv_prev,
                    recv_next_like=like(v - 1) if recv_next else None,
                )
                if recv_next:
                    grads[v - 1].append(g)
            else:
                x = comm(chunk, next_chunk, send_next=y, recv_prev=recv_prev)[0]
            if recv_prev:
                inputs[next_chunk].append(x)

        for k in range(remaining):
            fk, bk = k + warmup, k
            y = forward(fk)
            grad_x = backward(bk, final=False)
            chunk = self._chunk_id(fk, forward=True)
            if self._is_last(chunk):
                y = None
            if self._is_first(self._chunk_id(bk, forward=False)):
                grad_x = None
            recv_prev = True
            if first_rank:  # the first stage is P - 1 micro-batches ahead of the last
                next_fwd = self._chunk_id(fk - (p - 1), forward=True)
                recv_prev = next_fwd != v - 1
                next_fwd += 1
            else:
                next_fwd = self._chunk_id(fk + 1, forward=True)
            recv_next = True
            if last_rank:
                next_bwd = self._chunk_id(bk - (p - 1), forward=False)
                recv_next = next_bwd != 0
                next_bwd -= 1
            else:
                next_bwd = self._chunk_id(bk + 1, forward=False)
            if k == remaining - 1:
                recv_prev = False
            x, g = comm(
                chunk,
                next_fwd,
                send_next=y,
                send_prev=grad_x,
                recv_prev=recv_prev,
                recv_next_like=like(next_bwd) if recv_next else None,
            )
            if recv_prev:
                inputs[next_fwd].append(x)
            if recv_next:
                grads[next_bwd].append(g)

        if forward_only:
            return
        if all_warmup:
            grads[v - 1].append(None if last_rank else comm(recv_next_like=like(v - 1))[1])
        for k in range(remaining, total):
            grad_x = backward(k, final=k == total - 1)
            if self._is_first(self._chunk_id(k, forward=False)):
                grad_x = None
            next_bwd = self._chunk_id(k + 1, forward=False)
            recv_next = not (last_rank and next_bwd == v - 1) and k != total - 1
            g = comm(send_prev=grad_x, recv_next_like=like(next_bwd) if recv_next else None)[1]
            grads[next_bwd].append(g)


def check_interleaved(num_microbatches: int, pipeline_size: int, num_chunks: int) -> None:
    """The interleaved schedule's constraint, checked before any communication."""
    if num_microbatches % pipeline_size:
        raise ValueError(
            f"the interleaved schedule (parallel.pipeline.num_chunks={num_chunks}) needs "
            f"num_microbatches divisible by the pipeline size: num_microbatches "
            f"{num_microbatches} % pipeline {pipeline_size} != 0"
        )
