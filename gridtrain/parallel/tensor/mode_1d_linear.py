"""1D (Megatron-LM) column- and row-parallel Linear, and the rule that pairs them in ``gt.nn``.

Column-parallel ``Y_i = X A_i`` keeps output features ``[out/n]`` on rank i
(Megatron's *f* on the input: identity forward, all-reduce of the input
gradient backward). Row-parallel ``Y = sum_i X_i B_i`` holds input features
``[in/n]`` and all-reduces the partial products (Megatron's *g*). A column layer
followed by a row layer is one all-reduce forward and one backward: an MLP or
an attention block.

**The alternation rule.** ``gt.nn.Linear`` under 1d builds a column-parallel
layer (output kept sharded) unless the previous ``gt.nn.Linear`` built on this
context left its output sharded, in which case it builds a row-parallel layer
taking that sharded input. So Linears constructed in pairs, in forward order,
need no annotation. Exceptions:

* several Linears reading the *same* input (separate q, k, v projections):
  build them inside ``with gt.nn.shared_input():``; they all get the split the
  first would get, and the alternation advances once, when the block ends;
* explicit keywords override: ``split="column" | "row"``, ``gather_output=``
  (implies column), ``parallel_input=`` (implies row);
* ``reset_alternation(ctx)`` starts a new model with a column layer.

A layer fed the wrong width (the pairing went out of step) raises an error that
says so, before any collective: column layers want ``in_features`` inputs,
row layers ``in_features / n`` (or ``in_features`` with ``parallel_input=False``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gridtrain.parallel import comm
from gridtrain.parallel.context import ParallelContext, get_context
from gridtrain.parallel.mode import ParallelMode
from gridtrain.parallel.sharding import set_shard_spec

PM1D = ParallelMode.PARALLEL_1D


class CtxRef:
    """Holds a layer's context; ``copy.deepcopy`` of a model keeps the same context
    (process groups cannot be copied)."""

    def __init__(self, ctx: ParallelContext):
        self.ctx = ctx

    def __deepcopy__(self, memo) -> CtxRef:
        return self


def tp(ctx: ParallelContext | None) -> tuple[ParallelContext, int, int]:
    """(context, 1d group size, this rank's index in it); ``ctx=None`` uses the current one."""
    ctx = ctx or get_context()
    return ctx, ctx.world_size(PM1D), ctx.local_rank(PM1D)


def divide(value: int, n: int, name: str) -> int:
    if value % n:
        raise ValueError(f"{name}={value} is not divisible by the 1d tensor-parallel size {n}")
    return value // n


def shard_param(
    full: Tensor, dim: int | None, n: int, rank: int, device: torch.device | None
) -> nn.Parameter:
    """This rank's chunk of the dense tensor ``full`` along ``dim`` (None: replicated), tagged
    with its shard spec so full state dicts rebuild the dense tensor."""
    part = full if dim is None else full.chunk(n, dim=dim)[rank]
    if not part.is_meta:  # under gt.lazy_init the shard stays meta until materialised
        part = part.to(device)
    p = nn.Parameter(part.clone(memory_format=torch.contiguous_format))
    if dim is not None:
        set_shard_spec(p, (dim, PM1D))
    return p


def default_device(device: torch.device | None, ctx: ParallelContext) -> torch.device | None:
    """``device``, else the context's device, except under ``gt.lazy_init`` (meta)."""
    if device is not None:
        return device
    return None if torch.empty(0).is_meta else ctx.device  # a `with torch.device("meta")` is on


class ShardedFromDense(nn.Module):
    """Base of the 1d layers: each parameter is this rank's cut of a dense draw.

    A subclass sets ``self._splits`` (parameter name -> split dim, None = replicated),
    implements ``_dense_init()`` (the dense twin's tensors, drawn in its order) and calls
    ``_install``. ``reset_parameters`` redraws and re-cuts, so a model built under
    ``gt.lazy_init`` materialises the same weights as the dense model.
    """

    _splits: dict[str, int | None]

    def _dense_init(self) -> dict[str, Tensor]:
        raise NotImplementedError

    def _install(self, ctx: ParallelContext, device: torch.device | None) -> None:
        self._ctx = CtxRef(ctx)
        _, n, rank = tp(ctx)
        device = default_device(device, ctx)
        for name, full in self._dense_init().items():
            setattr(self, name, shard_param(full, self._splits[name], n, rank, device))

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """The dense layer's init (same draws from the default generator), this rank's cut."""
        _, n, rank = tp(self._ctx.ctx)
        for name, full in self._dense_init().items():
            dim = self._splits[name]
            getattr(self, name).copy_(full if dim is None else full.chunk(n, dim=dim)[rank])


def dense_linear_init(
    in_features: int, out_features: int, bias: bool, dtype: torch.dtype | None
) -> tuple[Tensor, Tensor | None]:
    """nn.Linear's init drawn on the CPU in nn.Linear's order, so with the same seed the
    dense weights equal those of ``nn.Linear`` whatever the layout."""
    weight = torch.empty(out_features, in_features, dtype=dtype)
    nn.init.kaiming_uniform_(weight, a=math.sqrt(5))
    if not bias:
        return weight, None
    bound = 1 / math.sqrt(in_features) if in_features > 0 else 0
    return weight, torch.empty(out_features, dtype=dtype).uniform_(-bound, bound)


def check_width(layer: nn.Module, x: Tensor, want: int, what: str) -> None:
    if x.shape[-1] != want:
        raise ValueError(
            f"{type(layer).__name__}(in_features={layer.in_features}, "
            f"out_features={layer.out_features}) wants {what} of width {want}, got input of "
            f"shape {tuple(x.shape)}. Under 1d consecutive gt.nn.Linear layers alternate "
            "column/row; Linears that read the same input belong in `with gt.nn.shared_input():`, "
            "or pass split='column'/'row' explicitly"
        )


class Linear1DCol(ShardedFromDense):
    """Column-parallel Linear: weight ``[out/n, in]``, bias ``[out/n]``; input replicated.

    ``gather_output=False`` (default) leaves the output sharded ``[..., out/n]`` for a
    following row-parallel layer; ``True`` all-gathers it to ``[..., out]``.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        device: torch.device | None = None,
        dtype: torch.dtype | None = None,
        *,
        gather_output: bool = False,
        ctx: ParallelContext | None = None,
    ):
        super().__init__()
        ctx, n, _ = tp(ctx)
        divide(out_features, n, "out_features")
        self.in_features, self.out_features = in_features, out_features
        self.gather_output = gather_output
        self._has_bias, self._dtype = bias, dtype
        self._splits = {"weight": 0, "bias": 0}
        self._install(ctx, device)
        if not bias:
            self.register_parameter("bias", None)

    def _dense_init(self) -> dict[str, Tensor]:
        w, b = dense_linear_init(self.in_features, self.out_features, self._has_bias, self._dtype)
        return {"weight": w} if b is None else {"weight": w, "bias": b}

    def forward(self, x: Tensor) -> Tensor:
        check_width(self, x, self.in_features, "a replicated input")
        group = self._ctx.ctx.group(PM1D)
        y = F.linear(comm.copy_to_group(x, group), self.weight, self.bias)
        return comm.gather_from_group(y, -1, group) if self.gather_output else y

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features} "
            f"(local {self.weight.shape[0]}), bias={self.bias is not None}, "
            f"gather_output={self.gather_output}"
        )


class Linear1DRow(ShardedFromDense):
    """Row-parallel Linear: weight ``[out, in/n]``, bias ``[out]`` replicated; output replicated.

    ``parallel_input=True`` (default) takes a sharded input ``[..., in/n]`` (a column
    layer's output); ``False`` takes the replicated ``[..., in]`` and keeps its own slice.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        device: torch.device | None = None,
        dtype: torch.dtype | None = None,
        *,
        parallel_input: bool = True,
        ctx: ParallelContext | None = None,
    ):
        super().__init__()
        ctx, n, _ = tp(ctx)
        self.local_in = divide(in_features, n, "in_features")
        self.in_features, self.out_features = in_features, out_features
        self.parallel_input = parallel_input
        self._has_bias, self._dtype = bias, dtype
        self._splits = {"weight": 1, "bias": None}
        self._install(ctx, device)
        if not bias:
            self.register_parameter("bias", None)

    _dense_init = Linear1DCol._dense_init

    def forward(self, x: Tensor) -> Tensor:
        group = self._ctx.ctx.group(PM1D)
        if self.parallel_input:
            check_width(self, x, self.local_in, "a sharded input (in_features / n)")
        else:
            check_width(self, x, self.in_features, "a replicated input")
            x = comm.split_to_group(x, -1, group)
        y = comm.reduce_from_group(F.linear(x, self.weight), group)
        return y if self.bias is None else y + self.bias  # bias once, after the sum

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features} (local {self.local_in}), "
            f"out_features={self.out_features}, bias={self.bias is not None}, "
            f"parallel_input={self.parallel_input}"
        )


# ---- gt.nn.Linear: alternate column and row per context ---------------------------------
@dataclasses.dataclass
class _Alternation:
    next: str = "column"  # split of the next gt.nn.Linear
    shared: str | None = None  # inside shared_input(): the split every Linear gets
    shared_built: int = 0
    shared_sharded: bool = False


def _alternation(ctx: ParallelContext) -> _Alternation:
    state = getattr(ctx, "_gt_1d_alternation", None)
    if state is None:
        state = _Alternation()
        ctx._gt_1d_alternation = state
    return state


def in_sharded_region(ctx: ParallelContext) -> bool:
    """Whether a layer built now sits between a column layer and its row layer, i.e. sees
    sharded activations (used by Dropout to pick its RNG state)."""
    state = _alternation(ctx)
    if state.shared is not None:
        return state.shared_sharded
    return state.next == "row"


def reset_alternation(ctx: ParallelContext | None = None) -> None:
    """Make the next ``gt.nn.Linear`` on ``ctx`` column-parallel (e.g. before a second model)."""
    _alternation(ctx or get_context()).next = "column"


@contextlib.contextmanager
def shared_input(ctx: ParallelContext | None = None) -> Iterator[None]:
    """Linears built inside all read the same input (separate q, k, v projections): each gets
    the split the first one would get; the alternation advances once, at the end."""
    state = _alternation(ctx or get_context())
    if state.shared is not None:
        raise RuntimeError("gt.nn.shared_input() blocks do not nest")
    state.shared, state.shared_built, state.shared_sharded = state.next, 0, False
    try:
        yield
    finally:
        if state.shared_built:
            state.next = "row" if state.shared_sharded else "column"
        state.shared = None


def Linear(  # noqa: N802 - the canonical layer name every mode module exports
    in_features: int,
    out_features: int,
    bias: bool = True,
    device: torch.device | None = None,
    dtype: torch.dtype | None = None,
    *,
    split: str | None = None,
    gather_output: bool | None = None,
    parallel_input: bool | None = None,
    ctx: ParallelContext | None = None,
) -> Linear1DCol | Linear1DRow:
    """``nn.Linear``'s arguments; builds a column- or row-parallel layer by the alternation
    rule (module docstring), unless ``split``, ``gather_output`` or ``parallel_input`` say."""
    ctx = ctx or get_context()
    state = _alternation(ctx)
    if split is None:
        if gather_output is not None and parallel_input is not None:
            raise ValueError(
                "gather_output (column-parallel) and parallel_input (row-parallel) exclude "
                "each other; pass split='column' or split='row'"
            )
        if gather_output is not None:
            split = "column"
        elif parallel_input is not None:
            split = "row"
        else:
            split = state.shared or state.next
    if split == "column" and parallel_input is None:
        layer = Linear1DCol(
            in_features, out_features, bias, device, dtype,
            gather_output=bool(gather_output), ctx=ctx,
        )  # fmt: skip
        sharded_out = not layer.gather_output
    elif split == "row" and gather_output is None:
        parallel = True if parallel_input is None else parallel_input
        layer = Linear1DRow(
            in_features, out_features, bias, device, dtype, parallel_input=parallel, ctx=ctx
        )
        sharded_out = False
    else:
        raise ValueError(
            f"split must be 'column' (optionally with gather_output) or 'row' (optionally "
            f"with parallel_input), got split={split!r}, gather_output={gather_output}, "
            f"parallel_input={parallel_input}"
        )
    if state.shared is None:
        state.next = "row" if sharded_out else "column"
    else:
        state.shared_built += 1
        state.shared_sharded |= sharded_out
    return layer
