"""FFN experts, stacked: this rank holds ``num_experts / expert_parallel_size`` of them.

Each weight is one ``[num_local_experts, ...]`` tensor tagged as a shard of the
dense ``[num_experts, ...]`` tensor along dim 0 over EXPERT, so full state dicts
and checkpoints move between expert-parallel sizes; its gradient is averaged
over EXPERT_DATA (the ranks holding the same experts).

Two ways in: ``forward`` takes capacity slots ``[local experts, slots, hidden]``
(the capacity dispatch), ``forward_grouped`` takes rows sorted by expert with a
count per expert (the grouped dispatch) and runs them through
``torch._grouped_mm`` (one kernel for all experts, on GPUs that have it) or a
batched matmul over the rows padded to the busiest expert.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gridtrain.parallel.context import ParallelContext
from gridtrain.parallel.mode import ParallelMode
from gridtrain.parallel.tags import set_dp_mode, set_shard_spec


def expert_parallel_size(ctx: ParallelContext | None) -> int:
    """Ranks one layer's experts are spread over (1 with no context)."""
    return ctx.world_size(ParallelMode.EXPERT) if ctx is not None else 1


def check_num_experts(num_experts: int, ep: int) -> int:
    """Experts per rank; a clear error when ``ep`` does not divide ``num_experts``."""
    if not isinstance(num_experts, int) or num_experts < 1:
        raise ValueError(f"num_experts must be an int >= 1, got {num_experts!r}")
    if num_experts % ep:
        raise ValueError(
            f"num_experts {num_experts} is not divisible by moe.expert_parallel_size {ep}: "
            f"each rank of an expert group must hold the same number of experts"
        )
    return num_experts // ep


MATMULS = ("auto", "grouped_mm", "bmm")
_GROUPED_MM_OK: dict[tuple, bool] = {}


def grouped_mm_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``torch._grouped_mm`` has a native kernel here: CUDA, compute capability >= 9.0
    (Hopper's CUTLASS grouped GEMM), bf16. Probed once per device (forward and backward on a
    tiny input), so a torch build or GPU without it falls back instead of failing."""
    if device.type != "cuda" or dtype != torch.bfloat16 or not hasattr(torch, "_grouped_mm"):
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    key = (index, dtype)
    if key not in _GROUPED_MM_OK:
        ok = torch.cuda.get_device_capability(index) >= (9, 0)
        if ok:
            try:
                a = torch.randn(32, 16, device=device, dtype=dtype, requires_grad=True)
                b = torch.randn(2, 16, 16, device=device, dtype=dtype, requires_grad=True)
                offs = torch.tensor([16, 32], device=device, dtype=torch.int32)
                out = torch._grouped_mm(a, b, offs=offs)
                out.backward(torch.ones_like(out))
            except (RuntimeError, NotImplementedError):
                ok = False
        _GROUPED_MM_OK[key] = ok
    return _GROUPED_MM_OK[key]  # probed by an earlier call too


def compute_dtype(x: Tensor) -> torch.dtype:
    """The dtype a matmul on ``x`` runs in: the autocast dtype when autocast is on, else x's."""
    kind = x.device.type
    if torch.is_autocast_enabled(kind):
        return torch.get_autocast_dtype(kind)
    return x.dtype


def grouped_linear(
    x: Tensor, weight: Tensor, offs: Tensor, bias: Tensor | None = None, onehot=None
) -> Tensor:
    """Rows ``x`` [rows, in] sorted by expert (``offs``: each expert's end row, int32) through
    ``weight`` [experts, in, out] by one ``torch._grouped_mm``; ``bias`` [experts, out] added
    to each row as ``onehot @ bias`` (``onehot`` [rows, experts]: each row's expert) in
    ``addmm``'s epilogue: no ``[rows, out]`` gather and add, and the bias gradient is one small
    matmul (indexing's backward sorts thousands of repeats of a handful of indices, 5 ms per
    call at 16k tokens on an H200; ``segment_reduce`` syncs the host). Shared by
    ``Experts`` and the Hugging Face experts (``gridtrain.hf.moe.grouped``)."""
    y = torch._grouped_mm(x, weight, offs=offs)
    return y if bias is None else torch.addmm(y, onehot, bias)


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; gradient times ``scale`` backward."""

    @staticmethod
    def forward(ctx, x, scale):
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.scale, None


def scale_grad(x: Tensor, scale: float) -> Tensor:
    """``x`` whose gradient is multiplied by ``scale``."""
    return x if scale == 1.0 else _ScaleGrad.apply(x, scale)


class Experts(nn.Module):
    """``num_experts`` two-layer FFNs ``act(x W1 + b1) W2 + b2``, this rank's share stacked.

    Forward takes ``[num_local_experts, tokens, hidden]`` and returns the same shape;
    ``forward_grouped`` takes rows sorted by expert. ``matmul`` picks the grouped
    path's kernel: ``"grouped_mm"`` (``torch._grouped_mm``), ``"bmm"`` (rows padded to
    the busiest expert, one batched matmul) or ``"auto"`` (grouped_mm where
    ``grouped_mm_supported``, else bmm).
    Weights: ``w1 [E, hidden, ffn]``, ``b1 [E, ffn]``, ``w2 [E, ffn, hidden]``,
    ``b2 [E, hidden]`` in the dense model, drawn like ``nn.Linear`` per expert
    from the default generator (equal on every rank) and then cut, so any
    expert-parallel size starts from the same dense weights.

    Gradient scale: after the combine all-to-all's backward, an expert's gradient
    on one rank already sums the tokens of all ``ep`` ranks of its EXPERT group;
    averaging over EXPERT_DATA (``data / ep`` ranks) would then give ``ep`` times
    the data-parallel mean, so the weights pass through a ``1/ep`` gradient scale.
    """

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        ffn_size: int,
        activation: Callable[[Tensor], Tensor] = F.gelu,
        dtype: torch.dtype | None = None,
        device: torch.device | None = None,
        ctx: ParallelContext | None = None,
        matmul: str = "auto",
    ):
        super().__init__()
        if matmul not in MATMULS:
            raise ValueError(f"Experts matmul must be one of {MATMULS}, got {matmul!r}")
        self.matmul = matmul
        self.ep = expert_parallel_size(ctx)
        self.num_experts = num_experts
        self.num_local_experts = check_num_experts(num_experts, self.ep)
        self.activation = activation
        rank = ctx.local_rank(ParallelMode.EXPERT) if ctx is not None else 0
        device = device or (ctx.device if ctx is not None else None)
        b1_bound, b2_bound = 1 / math.sqrt(hidden_size), 1 / math.sqrt(ffn_size)
        dense = {
            "w1": torch.empty(num_experts, hidden_size, ffn_size, dtype=dtype).uniform_(
                -b1_bound, b1_bound
            ),
            "b1": torch.empty(num_experts, ffn_size, dtype=dtype).uniform_(-b1_bound, b1_bound),
            "w2": torch.empty(num_experts, ffn_size, hidden_size, dtype=dtype).uniform_(
                -b2_bound, b2_bound
            ),
            "b2": torch.empty(num_experts, hidden_size, dtype=dtype).uniform_(-b2_bound, b2_bound),
        }
        for name, full in dense.items():
            # a copy: a chunk along dim 0 is already contiguous, and kept as a view it would
            # hold the storage of every expert on a CPU rank (.to(device) copies only on GPUs)
            local = full.chunk(self.ep, dim=0)[rank].clone().to(device)
            param = nn.Parameter(local)
            set_shard_spec(param, (0, ParallelMode.EXPERT))
            set_dp_mode(param, ParallelMode.EXPERT_DATA)
            self.register_parameter(name, param)

    def forward(self, x: Tensor) -> Tensor:
        if x.dim() != 3 or x.shape[0] != self.num_local_experts:
            raise ValueError(
                f"Experts expects [num_local_experts={self.num_local_experts}, tokens, hidden], "
                f"got {tuple(x.shape)}"
            )
        s = 1.0 / self.ep
        w1, b1, w2, b2 = (scale_grad(p, s) for p in (self.w1, self.b1, self.w2, self.b2))
        h = self.activation(torch.baddbmm(b1.unsqueeze(1), x, w1))
        return torch.baddbmm(b2.unsqueeze(1), h, w2)

    def uses_grouped_mm(self, x: Tensor) -> bool:
        """Whether ``forward_grouped`` on rows like ``x`` runs ``torch._grouped_mm`` (which
        needs no host-side row counts) rather than the padded batched matmul."""
        return self.matmul == "grouped_mm" or (
            self.matmul == "auto" and grouped_mm_supported(x.device, compute_dtype(x))
        )

    def forward_grouped(self, x: Tensor, counts: Tensor, max_count: int | None) -> Tensor:
        """Rows ``x`` [rows, hidden] sorted by local expert, ``counts[e]`` rows for expert e
        (a tensor on x's device; ``max_count`` = its largest entry, needed only when
        ``uses_grouped_mm(x)`` is False) -> [rows, hidden]."""
        s = 1.0 / self.ep
        w1, b1, w2, b2 = (scale_grad(p, s) for p in (self.w1, self.b1, self.w2, self.b2))
        rows = x.shape[0]
        local = torch.arange(self.num_local_experts, device=x.device)
        expert = torch.repeat_interleave(local, counts, output_size=rows)  # each row's expert
        dtype = compute_dtype(x)
        if self.uses_grouped_mm(x):
            offs = torch.cumsum(counts, 0, dtype=torch.int32)  # end row of each expert
            # _grouped_mm is on no autocast list: cast as autocast would for a matmul
            with torch.autocast(x.device.type, enabled=False):
                x, w1, b1, w2, b2 = (t.to(dtype) for t in (x, w1, b1, w2, b2))
                onehot = F.one_hot(expert, self.num_local_experts).to(dtype)
                h = self.activation(grouped_linear(x, w1, offs, b1, onehot))
                return grouped_linear(h, w2, offs, b2, onehot)
        # rows padded to the busiest expert: the capacity path's batched matmul, no dropping
        start = torch.cumsum(counts, 0) - counts
        slot = torch.arange(rows, device=x.device) - start[expert]
        padded = x.new_zeros(self.num_local_experts, max_count, x.shape[1])
        padded = padded.index_put((expert, slot), x)
        h = self.activation(torch.baddbmm(b1.unsqueeze(1), padded, w1))
        return torch.baddbmm(b2.unsqueeze(1), h, w2)[expert, slot]

    def extra_repr(self) -> str:
        return (
            f"num_experts={self.num_experts}, local={self.num_local_experts}, "
            f"hidden={self.w1.shape[1]}, ffn={self.w1.shape[2]}"
        )
