"""Layer parity: one sharded layer against its dense twin (whole models: ``runs.py``).

*Layouts.* ``cut(t, layout, ctx)`` is this rank's piece of a full tensor laid
out as a tensor mode keeps its activations, so a test can feed a sharded layer
exactly what the previous layer would and compare what comes out with the same
cut of the dense result:

* ``rep``: the whole tensor (replicated);
* ``rows``: the tensor mode's batch split (``split_batch``), last dim whole;
* ``act`` / ``act1``: the mode's activation layout (rows, then the hidden block of
  this rank; ``act1`` is 3d's orientation 1);
* ``shard``: 1d's sharded features (last dim cut over PARALLEL_1D);
* ``vocab``: the mode's vocab-sharded logits.

*Layers.* ``layer_parity`` runs one dense layer and its sharded twin on the same
input and cotangent: output, input gradient and every shard's weight gradient.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

import gridtrain as gt
from gridtrain.parallel.sharding import shard_tensor
from gridtrain.parallel.tags import get_shard_spec
from gridtrain.parallel.tensor.mode_2d import SummaGrid
from gridtrain.parallel.tensor.mode_3d.cube import INPUT, OUTPUT, WEIGHT
from gridtrain.parallel.tensor.registry import split_batch

PM = gt.ParallelMode


def _chunk(t: Tensor, dim: int, mode, ctx) -> Tensor:
    return t.chunk(ctx.world_size(mode), dim=dim)[ctx.local_rank(mode)]


def cut(t: Tensor, layout: str, ctx) -> Tensor:
    """This rank's piece of the full tensor ``t`` in ``layout`` (module docstring).

    ``"<layout>:k"``: the last dim packs k equal blocks (fused q/k/v), each cut that way.
    """
    if ":" in layout:
        layout, k = layout.split(":")
        blocks = t.unflatten(-1, (int(k), t.shape[-1] // int(k)))
        return cut(blocks, layout, ctx).flatten(-2)
    mode = ctx.tensor_mode
    if layout == "rep" or mode is None:
        return t
    if mode == "sequence":
        return split_batch(t, ctx)
    if mode == "1d":
        return _chunk(t, -1, PM.PARALLEL_1D, ctx) if layout in ("shard", "vocab") else t
    if layout == "shard":
        raise ValueError("'shard' is 1d's layout")
    if mode in ("2d", "2.5d"):
        g = SummaGrid.of(ctx)
        rows = split_batch(t, ctx)
        return rows if layout == "rows" else rows.chunk(g.q, dim=-1)[g.j]
    # 3d
    if layout in ("rows", "act"):
        rows = split_batch(t, ctx)
        return rows if layout == "rows" else _chunk(rows, -1, WEIGHT, ctx)
    rows = _chunk(_chunk(t, 0, INPUT, ctx), 0, WEIGHT, ctx)  # rows (i, WEIGHT block)
    return _chunk(rows, -1, OUTPUT, ctx)  # act1 and vocab: last dim over OUTPUT


def max_err(a: Tensor, b: Tensor) -> float:
    """Max abs difference, relative to the reference's magnitude where that exceeds 1."""
    assert a.shape == b.shape, (tuple(a.shape), tuple(b.shape))
    a, b = a.detach().double(), b.detach().double()
    return ((a - b).abs().max() / b.abs().max().clamp(min=1.0)).item()


def randn(seed: int, *shape: int, dtype=torch.float32) -> Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def layer_parity(
    ctx,
    make_dense: Callable[[], nn.Module],
    build: Callable[[nn.Module, Any], nn.Module],
    x: Tensor,
    x_layout: str,
    y_layout: str,
    seed: int = 0,
) -> dict[str, float]:
    """Errors of the sharded twin of ``make_dense()`` (output, input grad, every shard's grad).

    Parameters get a random offset first so zero-initialised ones (biases) are exercised;
    the same seed on every rank makes the dense layer identical everywhere.
    """
    torch.manual_seed(seed)
    ref = make_dense()
    with torch.no_grad():
        for i, p in enumerate(ref.parameters()):
            p.add_(0.1 * randn(seed + i, *p.shape, dtype=p.dtype))
    layer = build(_copy(ref), ctx)
    xd = x.clone().requires_grad_(x.is_floating_point())
    yd = ref(xd)
    w = randn(seed + 99, *yd.shape, dtype=yd.dtype)
    (yd * w).sum().backward()
    xl = cut(x, x_layout, ctx).clone().requires_grad_(x.is_floating_point())
    y = layer(xl)
    (y.as_subclass(Tensor) * cut(w, y_layout, ctx)).sum().backward()
    errs = {"output": max_err(y.as_subclass(Tensor), cut(yd, y_layout, ctx))}
    if x.is_floating_point():
        errs["input grad"] = max_err(xl.grad, cut(xd.grad, x_layout, ctx))
    dense_params = dict(ref.named_parameters())
    for name, p in layer.named_parameters():
        want = shard_tensor(dense_params[name].grad, get_shard_spec(p), ctx)
        errs[f"{name} grad"] = max_err(p.grad, want)
    return errs


def _copy(module: nn.Module) -> nn.Module:
    import copy

    return copy.deepcopy(module)
