"""Where to cut: each layer's cost, and the contiguous parts that balance it.

A layer costs its **parameters** (what a stage must hold: weights, gradients and
optimizer state grow with them) and its **compute**, estimated as the parameters it
multiplies with: an embedding table is looked up, not multiplied, so a stage holding
only the embedding would sit idle while the next one runs its blocks. A weight tied
between layers (an LM head and its embedding) is counted on each layer that holds it,
and once in a part that holds both.

``partition`` cuts the layers into contiguous non-empty parts by one of ``METHODS``:

* ``"balanced"`` (the default): minimises the largest part's cost, a part costing the
  larger of its share of the parameters and its share of the compute;
* ``"parameters"``: minimises the largest part's parameter count;
* ``"uniform"``: equal layer counts (earlier parts take the remainder).

Both balancing methods are an exact dynamic programme over the cut points (layer
counts are small; a plain search would miss the optimum with a heavy embedding and head).
Where a part may not begin at some layers (``starts``: a model run by its own forward cannot
be cut before a unit given token ids, such as GPT-2's position embedding), every method
keeps to the allowed cut points (``"uniform"`` then balances layer counts by the same
programme).
"""

from __future__ import annotations

import bisect
import itertools
import math
import re
from collections.abc import Callable

from torch import Tensor, nn

from gridtrain.parallel.tensor.plan import PlanError

METHODS = ("balanced", "parameters", "uniform")
# an embedding's table is looked up: by class, since tensor-parallel embeddings replace
# nn.Embedding under other classes (VocabParallelEmbedding1D, a grid's Embedding...)
_LOOKUP = re.compile(r"(?<!Patch)Embedding(1D|2D|2p5D|3D)?$")


class LayerCosts:
    """Per layer: the parameters it holds (id -> dense count) and its estimated compute."""

    def __init__(self, params: list[dict[int, int]], compute: list[int]):
        self.params, self.compute = params, compute
        self._prefix = list(itertools.accumulate((sum(p.values()) for p in params), initial=0))
        self._compute = list(itertools.accumulate(compute, initial=0))
        where: dict[int, list[int]] = {}
        for i, layer in enumerate(params):
            for pid in layer:
                where.setdefault(pid, []).append(i)
        # weights held by several layers: (their layers, count), counted once per span
        self._shared = [(idx, params[idx[0]][pid]) for pid, idx in where.items() if len(idx) > 1]
        self.total_params = self._prefix[-1] - sum((len(i) - 1) * n for i, n in self._shared)

    def span_params(self, start: int, end: int) -> int:
        """Parameters held by layers ``[start, end)``, a weight they share once."""
        total = self._prefix[end] - self._prefix[start]
        for layers, n in self._shared:
            inside = bisect.bisect_left(layers, end) - bisect.bisect_left(layers, start)
            total -= max(inside - 1, 0) * n
        return total

    def span_compute(self, start: int, end: int) -> int:
        """Estimated compute of layers ``[start, end)``."""
        return self._compute[end] - self._compute[start]


def layer_costs(
    layers: list[nn.Module], numel: Callable[[Tensor], int] = Tensor.numel
) -> LayerCosts:
    """The costs of ``layers``; ``numel`` counts a parameter (the dense count of a shard)."""
    params, compute = [], []
    for layer in layers:
        held: dict[int, int] = {}
        flops = 0
        for module in layer.modules():
            lookup = isinstance(module, nn.Embedding) or bool(_LOOKUP.search(type(module).__name__))
            for p in module.parameters(recurse=False):
                n = numel(p)
                if id(p) not in held:
                    held[id(p)] = n
                    flops += 0 if lookup else n
        params.append(held)
        compute.append(flops)
    return LayerCosts(params, compute)


def partition(
    weights: list[int] | LayerCosts,
    parts: int,
    method: str = "balanced",
    starts: list[bool] | None = None,
) -> list[tuple[int, int]]:
    """Cut the layers into ``parts`` contiguous non-empty ``[start, end)`` ranges.

    ``weights``: the layers' costs (``layer_costs``), or plain parameter counts (then
    compute is taken as proportional to them). ``starts[i]``: whether a part may begin at
    layer ``i`` (None: anywhere).
    """
    costs = weights if isinstance(weights, LayerCosts) else _plain(weights)
    n = len(costs.compute)
    if method not in METHODS:
        raise ValueError(f"parallel.pipeline.partition must be one of {METHODS}, got {method!r}")
    allowed = [True] * n if starts is None else [True, *starts[1:]]
    if parts < 1 or sum(allowed) < parts:
        where = "" if starts is None else f" ({sum(allowed)} places where a part may begin)"
        raise PlanError(
            f"cannot cut {n} layers{where} into {parts} pipeline parts (pipeline size x "
            f"num_chunks); each part needs at least one layer"
        )
    if method == "uniform" and all(allowed):
        base, extra = divmod(n, parts)
        sizes = [base + (i < extra) for i in range(parts)]
    elif method == "uniform":
        sizes = _balanced_sizes(lambda a, b: (b - a) / n, n, parts, allowed)
    else:
        sizes = _balanced_sizes(_span_cost(costs, method), n, parts, allowed)
    bounds, start = [], 0
    for size in sizes:
        bounds.append((start, start + size))
        start += size
    return bounds


def _plain(weights: list[int]) -> LayerCosts:
    return LayerCosts([{-1 - i: w} for i, w in enumerate(weights)], list(weights))


def _span_cost(costs: LayerCosts, method: str) -> Callable[[int, int], float]:
    total_p = costs.total_params or 1
    total_c = costs.span_compute(0, len(costs.compute)) or 1
    cache: dict[tuple[int, int], float] = {}

    def cost(start: int, end: int) -> float:
        key = (start, end)
        if key not in cache:
            share = costs.span_params(start, end) / total_p
            if method == "balanced":
                share = max(share, costs.span_compute(start, end) / total_c)
            cache[key] = share
        return cache[key]

    return cost


def _balanced_sizes(
    cost: Callable[[int, int], float], n: int, parts: int, allowed: list[bool]
) -> list[int]:
    # best[k][i]: the smallest largest-part cost putting the first i layers in k parts
    best = [[math.inf] * (n + 1) for _ in range(parts + 1)]
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0.0
    for k in range(1, parts + 1):
        for i in range(k, n - (parts - k) + 1):
            for j in range(k - 1, i):
                if not allowed[j]:
                    continue
                c = max(best[k - 1][j], cost(j, i))
                if c < best[k][i] - 1e-12:  # ties keep the earliest cut: the same on every rank
                    best[k][i], cut[k][i] = c, j
    sizes, i = [], n
    for k in range(parts, 0, -1):
        j = cut[k][i]
        sizes.append(i - j)
        i = j
    return sizes[::-1]
