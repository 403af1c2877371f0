"""A module kept whole on every rank while its input arrives split over the tensor group: Hugging
Face's ``replicated_with_grad_allreduce`` style (Qwen3's per-head ``q_norm`` / ``k_norm`` after
a column-parallel ``q_proj``: each rank normalises its own heads with the same weight).

The module's own forward runs on this rank's part, each parameter passed through Megatron's
*f* (``comm.copy_to_group``: identity forward, gradient all-reduced backward): a rank's
gradient covers only its part of the activations, and the parts' sum is the dense gradient.
That holds only where the ranks' parts do not overlap: under 1d where the input comes from
column-parallel layers (``mode_1d/styles.py`` keeps a whole input's module ``replicate``),
and under 2d, 2.5d and 3d, whose activations are always blocked over the whole group.
"""

from __future__ import annotations

from torch import nn

from gridtrain.parallel import comm
from gridtrain.parallel.mode import ParallelMode
from gridtrain.parallel.tensor.base import ShardedModule
from gridtrain.parallel.tensor.style import GRAD_SUMMED

STYLE = GRAD_SUMMED.name


class GradSummed(ShardedModule):
    """``dense`` (parameters and buffers its own, no submodules with parameters) replicated,
    its gradients summed over ``mode``'s group (module docstring)."""

    def __init__(self, dense: nn.Module, ctx=None, *, mode: ParallelMode = ParallelMode.TENSOR):
        super().__init__(dense, ctx)
        if any(True for _ in dense.children()):
            raise ValueError(
                f"{STYLE} applies to a module without submodules (a norm), got "
                f"{type(dense).__name__} with {[n for n, _ in dense.named_children()]}"
            )
        self.mode = mode
        for name, _ in dense.named_parameters(recurse=False):
            self.shard(name)  # replicated
        self.keep_buffers()

    def forward(self, *args, **kwargs):
        group = self.ctx.group(self.mode)
        params = {
            name: comm.copy_to_group(p, group) if p.requires_grad else p
            for name, p in self.named_parameters(recurse=False)
        }
        return self.run_dense(params, *args, **kwargs)

    def extra_repr(self) -> str:
        return f"{type(self.dense).__name__}, gradients summed over {self.mode.name}"
