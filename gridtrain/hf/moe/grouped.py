"""A Hugging Face experts module's local experts as the grouped dispatch runs them.

The dispatch (``parallel.moe.dispatch``) hands rows sorted by local expert with a count per
expert. Two ways to run them, the same math:

* ``torch._grouped_mm`` (CUDA, Hopper, bf16): the module's fused tensors as they are, one
  grouped GEMM for the up (or gate-up) projection and one for the down projection, the
  module's own ``_apply_gate`` / ``act_fn`` between them, per-expert biases added as
  ``one_hot(expert) @ bias`` in ``addmm``'s epilogue (``parallel.moe.Experts`` does the
  same). This is what ``transformers``' own ``grouped_mm`` experts compute, without its
  sort, its advanced-index gathers (whose backward is a sort-based accumulate) and its
  host-side count of active experts; with every expert local no step waits for the host.
* elsewhere (the CPU, float32): the module's own forward, each row a top-1 choice of
  weight 1, as the model computes it with whatever ``experts_implementation`` it has.

Modules the grouped path does not implement (no ``use_experts_implementation`` attributes,
a post-expert norm) always take the model's own forward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gridtrain.parallel.moe.experts import (
    compute_dtype,
    grouped_linear,
    grouped_mm_supported,
    scale_grad,
)

# what transformers' ``use_experts_implementation`` sets on an experts module
LAYOUT_ATTRS = ("has_gate", "has_bias", "is_transposed")


def grouped_mm_ready(module: nn.Module, x: Tensor) -> bool:
    """Whether ``module``'s experts run by ``torch._grouped_mm`` for rows like ``x``."""
    if not all(hasattr(module, a) for a in LAYOUT_ATTRS):
        return False
    if getattr(module, "has_post_expert_norm", False):
        return False
    return grouped_mm_supported(x.device, compute_dtype(x))


def _as_kn(weight: Tensor, module: nn.Module) -> Tensor:
    """``[experts, in, out]`` (what ``_grouped_mm`` multiplies by) from the module's layout."""
    return weight if module.is_transposed else weight.transpose(-2, -1)


def _grouped_linear(x, weight, bias, offs, onehot, module, dtype):
    bias = None if bias is None else bias.to(dtype)
    return grouped_linear(x, _as_kn(weight, module).to(dtype), offs, bias, onehot)


def grouped_experts(module: nn.Module, x: Tensor, counts: Tensor) -> Tensor:
    """Rows ``x`` [rows, hidden] sorted by local expert, ``counts[e]`` of them for expert e,
    through ``module``'s fused experts by grouped GEMMs -> [rows, hidden]."""
    dtype = compute_dtype(x)
    offs = torch.cumsum(counts, 0, dtype=torch.int32)  # end row of each expert
    onehot = None
    if module.has_bias:
        local = torch.arange(counts.shape[0], device=x.device)
        expert = torch.repeat_interleave(local, counts, output_size=x.shape[0])
        onehot = F.one_hot(expert, counts.shape[0]).to(dtype)
    up, up_bias = (
        (module.gate_up_proj, getattr(module, "gate_up_proj_bias", None))
        if module.has_gate
        else (module.up_proj, getattr(module, "up_proj_bias", None))
    )
    down_bias = getattr(module, "down_proj_bias", None)
    # _grouped_mm is on no autocast list: cast as autocast would for a matmul
    with torch.autocast(x.device.type, enabled=False):
        h = _grouped_linear(x.to(dtype), up, up_bias, offs, onehot, module, dtype)
        h = module._apply_gate(h) if module.has_gate else module.act_fn(h)
        return _grouped_linear(h, module.down_proj, down_bias, offs, onehot, module, dtype)


class LocalExperts:
    """The dispatch's view of this rank's experts of one module (``GroupedExperts``).

    ``eager``: the module's own forward (the class the dispatching one derives from).
    Gradient scale: the rows carry ``ep`` on the way in and ``1/ep`` on the way out (see
    ``experts.py``), which leaves input gradients as they are."""

    def __init__(self, module: nn.Module, eager, local: int, ep: int):
        self.module, self.eager, self.ep = module, eager, float(ep)
        self.num_local_experts = local

    def uses_grouped_mm(self, x: Tensor) -> bool:
        return grouped_mm_ready(self.module, x)

    def forward_grouped(self, x: Tensor, counts: Tensor, max_count: int | None) -> Tensor:
        x = scale_grad(x, self.ep)
        if x.shape[0] > 0 and self.uses_grouped_mm(x):
            y = grouped_experts(self.module, x, counts)
        else:
            y = self._own_forward(x, counts)
        return scale_grad(y, 1.0 / self.ep)

    def _own_forward(self, x: Tensor, counts: Tensor) -> Tensor:
        local = torch.arange(self.num_local_experts, device=x.device)
        expert = torch.repeat_interleave(local, counts, output_size=x.shape[0])
        if x.shape[0] == 0:  # no rows: one zero row keeps weights and rows in the graph
            return self._run(x.sum(0, keepdim=True), expert.new_zeros(1))[:0]
        return self._run(x, expert)

    def _run(self, x: Tensor, expert: Tensor) -> Tensor:
        weight = torch.ones(x.shape[0], 1, dtype=x.dtype, device=x.device)
        return self.eager(x, expert.unsqueeze(1), weight)
