"""What 1d's layers send, for ``gridtrain estimate`` (``estimate/collectives.py`` calls these
through ``GEOMETRY``; ``c`` is its builder): read off ``linear.py``, ``embedding.py`` and
``loss.py``. Torch-free, as the rest of the geometry half."""

from __future__ import annotations

from typing import Any

from gridtrain.parallel.mode import ParallelMode as PM
from gridtrain.parallel.tensor.style import ROWWISE_SPLIT_INPUT, WHOLE, of


def layer(c: Any, name: str, e: Any) -> None:
    g, m = PM.PARALLEL_1D, c.m
    if e.layer == "ColumnLinear":
        k, n = c.dims(e)
        c.ar(g, m * k, c.input_dtype(name), f"{name}: input gradient (backward)")
        if e.options.get("gather_output") or of(e.style).logits == WHOLE:
            c.ag(g, m * n / c.geo.size, "e", f"{name}: output gather")
    elif e.layer == "RowLinear":
        k, n = c.dims(e)
        c.ar(g, m * n, "e", f"{name}: output (forward)", fwd=1.0)
        if e.style == ROWWISE_SPLIT_INPUT.name:
            c.ag(g, m * k / c.geo.size, "e", f"{name}: input gradient gather", fwd=0.0)
    elif e.layer == "VocabParallelEmbedding1D":
        c.ar(g, m * c.dims(e)[1], "w", f"{name}: partial rows (forward)", fwd=1.0)
    elif e.layer == "Embedding1D":
        c.ag(g, m * c.dims(e)[1] / c.geo.size, "w", f"{name}: output gather")


def loss(c: Any) -> None:
    c.ar(PM.PARALLEL_1D, c.m, "f", "vocab-parallel loss: logit max")
    c.ar(PM.PARALLEL_1D, 3 * c.m, "f", "vocab-parallel loss: sums")
