"""What the cube's layers send, for ``gridtrain estimate`` (``estimate/collectives.py`` calls
these through ``GEOMETRY``; ``c`` is its builder): read off ``cube.py``, ``layers.py`` and
``loss.py``. Torch-free, as the rest of the geometry half."""

from __future__ import annotations

from typing import Any

from gridtrain.parallel.mode import ParallelMode as PM

# the group a parameter split over one axis is gathered over with the input axis
PAIR = {PM.PARALLEL_3D_WEIGHT: PM.PARALLEL_3D_INPUT_X_WEIGHT,
        PM.PARALLEL_3D_OUTPUT: PM.PARALLEL_3D_INPUT_X_OUTPUT}  # fmt: skip


def layer(c: Any, name: str, e: Any) -> None:
    d, t = c.geo.side, c.t
    hidden, row = (
        (PM.PARALLEL_3D_WEIGHT, PM.PARALLEL_3D_OUTPUT)
        if e.options.get("orientation", 0) == 0 or e.layer.startswith(("Vocab", "Embed", "Class"))
        else (PM.PARALLEL_3D_OUTPUT, PM.PARALLEL_3D_WEIGHT)
    )
    inp = PM.PARALLEL_3D_INPUT
    if e.layer in ("Linear", "VocabParallelClassifier"):
        k, n = c.dims(e)
        x, w, y = t * k / d, k * n / d**3, t * n / d
        xd = c.input_dtype(name)
        for group, local, dt, what in ((row, x, xd, "input"), (inp, w, "w", "weight")):
            c.ag(group, local, dt, f"{name}: {what} gather")
            c.rs(group, local, dt, f"{name}: {what} gradient")
        c.rs(hidden, y, "e", f"{name}: output reduce-scatter", fwd=1.0)
        c.ag(hidden, y, "e", f"{name}: output gradient", fwd=0.0)
        if "bias" in e.shards:
            pair = PAIR[hidden]
            c.ag(pair, n / d**3, "w", f"{name}.bias: gather")
            c.rs(pair, n / d**3, "w", f"{name}.bias: gradient")
    elif e.layer == "Norm":
        h = c.dims(e)[0]
        stats = 2 if c.spec.norm == "layer" else 1
        c.ar(hidden, t, "f", f"{name}: statistics (forward and backward)", 2 * stats, 0.5)
        for pname in e.shards:
            c.ag(PAIR[row], h / d**3, "w", f"{name}.{pname}: gather")
            c.rs(PAIR[row], h / d**3, "w", f"{name}.{pname}: gradient")
    elif e.layer == "VocabParallelEmbedding":
        v, dim = c.dims(e)
        c.add(row, "all_gather", (d - 1) * t, "i", f"{name}: token ids", fwd=1.0)
        c.ag(inp, v * dim / d**3, "w", f"{name}: weight gather")
        c.rs(inp, v * dim / d**3, "w", f"{name}: weight gradient")
        c.rs(row, t * dim / d, "w", f"{name}: partial rows", fwd=1.0)
        c.ag(row, t * dim / d, "e", f"{name}: gradient (backward)", fwd=0.0)
    elif e.layer == "Embedding":
        v, dim = c.dims(e)
        c.ag(PAIR[row], v * dim / d**3, "w", f"{name}: weight gather")
        c.rs(PAIR[row], v * dim / d**3, "w", f"{name}: weight gradient")


def loss(c: Any) -> None:
    t = c.t
    c.add(PM.PARALLEL_3D_OUTPUT, "all_gather", (c.geo.side - 1) * t, "i", "labels")
    c.ar(PM.PARALLEL_3D_OUTPUT, t, "f", "vocab-parallel loss: logit max")
    c.ar(PM.PARALLEL_3D_OUTPUT, 3 * t, "f", "vocab-parallel loss: sums")
    c.ar(PM.PARALLEL_3D_INPUT_X_WEIGHT, 1, "f", "loss and token count over rows", 2)
