"""What the SUMMA grid's layers send (2d and 2.5d), for ``gridtrain estimate``
(``estimate/collectives.py`` calls these through the mode's geometry; ``c`` is its builder,
``axes`` the grid's (row, column, depth) groups): read off ``grid.py``, ``layers.py``,
``vocab.py`` and ``loss.py``. Torch-free, as the rest of the geometry half."""

from __future__ import annotations

from typing import Any


def layer(c: Any, name: str, e: Any, axes: tuple) -> None:
    row, col, dep = axes
    q, t = c.geo.side, c.t
    if e.layer == "Linear":
        k, n = c.dims(e)
        x, w = t * k / q, k * n / q**2
        xd = c.input_dtype(name)
        c.add(row, "broadcast", 2 * q * x, xd, f"{name}: input panels (SUMMA)", fwd=0.5)
        c.add(row, "reduce", q * x, "e", f"{name}: input-gradient partials")
        c.add(col, "broadcast", 2 * q * w, "w", f"{name}: weight panels (SUMMA)", fwd=0.5)
        c.add(col, "reduce", q * w, "e", f"{name}: weight-gradient partials")
        if dep is not None:
            c.ar(dep, w, "w", f"{name}: weight gradient over depth")
        if "bias" in e.shards:
            _split_param(c, name, n, "bias", col, dep)
    elif e.layer == "Norm":
        h = c.dims(e)[0]
        stats = 2 if c.spec.norm == "layer" else 1
        c.ar(row, t, "f", f"{name}: statistics (forward and backward)", 2 * stats, 0.5)
        for pname in e.shards:
            _split_param(c, name, h, pname, col, dep)
    elif e.layer == "VocabParallelEmbedding":
        v, dim = c.dims(e)
        c.add(col, "all_gather", (q - 1) * t, "i", f"{name}: token ids", fwd=1.0)
        c.rs(col, t * dim / q, "w", f"{name}: partial rows", fwd=1.0)
        c.ag(col, t * dim / q, "e", f"{name}: gradient (backward)", fwd=0.0)
        if dep is not None:
            c.ar(dep, v * dim / q**2, "w", f"{name}: weight gradient over depth")
    elif e.layer == "Embedding":
        v, dim = c.dims(e)
        c.ag(col, v * dim / q**2, "w", f"{name}: weight gather")
        c.rs(col, v * dim / q**2, "w", f"{name}: weight gradient")
        if dep is not None:
            c.ar(dep, v * dim / q**2, "w", f"{name}: weight gradient over depth")
    elif e.layer == "VocabParallelClassifier":
        k, v = c.dims(e)
        w, logits = k * v / q**2, t * v / q
        c.add(col, "broadcast", 2 * q * w, "w", f"{name}: weight panels (SUMMA)", fwd=0.5)
        c.add(col, "reduce", q * w, "e", f"{name}: weight-gradient partials")
        c.add(row, "reduce", q * logits, "e", f"{name}: logit partials", fwd=1.0)
        c.add(row, "broadcast", 2 * q * logits, "e", f"{name}: logit-gradient panels")
        if dep is not None:
            c.ar(dep, w, "w", f"{name}: weight gradient over depth")


def _split_param(c: Any, name, size, pname, col, dep) -> None:
    """A parameter split over both grid axes, all-gathered down the column when used."""
    q = c.geo.side
    c.ag(col, size / q**2, "w", f"{name}.{pname}: gather")
    c.rs(col, size / q**2, "w", f"{name}.{pname}: gradient")
    if dep is not None:
        c.ar(dep, size / q**2, "w", f"{name}.{pname}: gradient over depth")


def loss(c: Any, axes: tuple) -> None:
    row, col, dep = axes
    c.ar(row, c.t, "f", "vocab-parallel loss: logit max")
    c.ar(row, 3 * c.t, "f", "vocab-parallel loss: sums")
    for group in (col, dep):
        if group is not None:
            c.ar(group, 1, "f", "loss and token count over batch blocks", 2)
