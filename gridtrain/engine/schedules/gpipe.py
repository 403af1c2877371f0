"""GPipe (Huang et al. 2019): every micro-batch's forward, then every micro-batch's backward.

The same bubble as 1F1B, but each stage keeps all ``num_microbatches`` micro-batches'
activations until the backwards start (1F1B keeps at most ``pipeline_size - stage``). It is
the simplest pipeline order, useful to compare against and with models whose backward must
not interleave with forwards.
"""

from __future__ import annotations

import functools

from gridtrain.engine.schedules.one_f_one_b import PipelineSchedule
from gridtrain.engine.schedules.pipeline_step import PipelineStep
from gridtrain.parallel.pipeline.p2p import Payload


class GPipeSchedule(PipelineSchedule):
    """All forwards, then all backwards in the same (first-in, first-out) order."""

    name = "gpipe"  # parallel.pipeline.schedule

    def _run(self, step: PipelineStep) -> None:
        first, last = self.stage == 0, self.stage == self.num_stages - 1
        comm = functools.partial(
            self.p2p.communicate, send_key=self._send_key(0), recv_key=self._recv_key(0)
        )
        inputs: list[Payload] = []
        outputs: list[Payload] = []
        for _ in range(self.num_microbatches):
            x = None if first else comm(recv_prev=True)[0]
            y = self._forward(step, x, chunk=0)
            if not last:
                comm(send_next=y)
            if not step.forward_only:
                inputs.append(x)
                outputs.append(y)
        for i, (x, y) in enumerate(zip(inputs, outputs, strict=True)):
            grad_y = None if last else comm(recv_next_like=y)[1]
            grad_x = self._backward(step, x, y, grad_y, final=i == len(inputs) - 1)
            if not first:
                comm(send_prev=grad_x)
