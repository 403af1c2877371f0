"""1D (Megatron-LM, Shoeybi et al. 2019) column- and row-parallel Linear, made from a dense one.

Column-parallel ``Y_i = X A_i`` keeps output features ``[out/n]`` on rank i
(Megatron's *f* on the input: identity forward, all-reduce of the input
gradient backward). Row-parallel ``Y = sum_i X_i B_i`` holds input features
``[in/n]`` and all-reduces the partial products (Megatron's *g*). A column layer
followed by a row layer is one all-reduce forward and one backward: an MLP or
an attention block. Both accept ``nn.Linear`` (weight ``[out, in]``) and Hugging
Face's ``Conv1D`` (weight ``[in, out]``), keeping the dense layout of the weight.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

from gridtrain.parallel import comm
from gridtrain.parallel.mode import ParallelMode
from gridtrain.parallel.tensor.base import ShardedModule, check_divisible, linear_dims
from gridtrain.parallel.tensor.vocab import mark_vocab_sharded

PM1D = ParallelMode.PARALLEL_1D


def linear(x: Tensor, weight: Tensor, bias: Tensor | None, transposed: bool) -> Tensor:
    """``x W^T + b`` for a weight stored ``[out, in]``, or ``[in, out]`` when ``transposed``."""
    return F.linear(x, weight.t() if transposed else weight, bias)


class _Linear1D(ShardedModule):
    def _setup(self, dense: nn.Module) -> tuple[int, int]:
        self.in_features, self.out_features, self.transposed = linear_dims(dense)
        self.n = self.ctx.world_size(PM1D)
        return self.in_features, self.out_features

    @property
    def group(self):
        return self.ctx.group(PM1D)

    def _check_width(self, x: Tensor, want: int, what: str) -> None:
        if x.shape[-1] != want:
            raise ValueError(
                f"{type(self).__name__}(in_features={self.in_features}, out_features="
                f"{self.out_features}) wants {what} of width {want}, got input of shape "
                f"{tuple(x.shape)}: the plan's column/row pairing does not match the data flow "
                "(print(engine.plan); set parallel.tensor.plan to fix it)"
            )


class ColumnLinear(_Linear1D):
    """Column-parallel Linear: weight ``[out/n, in]``, bias ``[out/n]``; input replicated.

    Output sharded ``[..., out/n]`` for a following row-parallel layer, unless
    ``gather_output`` (all-gathered, replicated) or ``vocab_parallel`` (kept sharded and
    marked as vocab-sharded logits for ``gt.nn.CrossEntropyLoss``). ``packed=k``: the
    output packs ``k`` equal blocks (fused q/k/v); each rank keeps its chunk of each.
    """

    def __init__(
        self,
        dense: nn.Module,
        ctx=None,
        *,
        gather_output: bool = False,
        vocab_parallel: bool = False,
        packed: int = 1,
    ):
        super().__init__(dense, ctx)
        _, out_f = self._setup(dense)
        name = type(self).__name__
        check_divisible(name, "out_features", out_f, self.n * packed, "1d size x packed blocks")
        if packed > 1 and (gather_output or vocab_parallel):
            raise ValueError(f"{name}: a packed output cannot be gathered or vocab-sharded")
        self.gather_output, self.vocab_parallel, self.packed = gather_output, vocab_parallel, packed
        self.shard("weight", [(1 if self.transposed else 0, PM1D, packed)])
        self.shard("bias", [(0, PM1D, packed)])

    def forward(self, x: Tensor) -> Tensor:
        self._check_width(x, self.in_features, "a replicated input")
        y = linear(comm.copy_to_group(x, self.group), self.weight, self.bias, self.transposed)
        if self.gather_output:
            return comm.gather_from_group(y, -1, self.group)
        return mark_vocab_sharded(y) if self.vocab_parallel else y

    def extra_repr(self) -> str:
        out = (
            "gathered"
            if self.gather_output
            else "vocab-sharded"
            if self.vocab_parallel
            else "sharded"
        )
        packed = f", packed={self.packed}" if self.packed > 1 else ""
        return f"in={self.in_features}, out={self.out_features}, output {out}{packed}"


class RowLinear(_Linear1D):
    """Row-parallel Linear: weight ``[out, in/n]``, bias ``[out]`` replicated; output replicated.

    ``parallel_input=True`` takes a sharded input ``[..., in/n]`` (a column layer's
    output); ``False`` takes the replicated ``[..., in]`` and keeps its own slice.
    """

    def __init__(self, dense: nn.Module, ctx=None, *, parallel_input: bool = True):
        super().__init__(dense, ctx)
        in_f, _ = self._setup(dense)
        check_divisible(type(self).__name__, "in_features", in_f, self.n, "1d size")
        self.local_in = in_f // self.n
        self.parallel_input = parallel_input
        self.shard("weight", [(0 if self.transposed else 1, PM1D)])
        self.shard("bias")

    def forward(self, x: Tensor) -> Tensor:
        if self.parallel_input:
            self._check_width(x, self.local_in, "a sharded input (in_features / n)")
        else:
            self._check_width(x, self.in_features, "a replicated input")
            x = comm.split_to_group(x, -1, self.group)
        y = comm.reduce_from_group(linear(x, self.weight, None, self.transposed), self.group)
        return y if self.bias is None else y + self.bias  # bias once, after the sum

    def extra_repr(self) -> str:
        source = "sharded" if self.parallel_input else "replicated, split here"
        return f"in={self.in_features}, out={self.out_features}, input {source}"
