"""The layouts the tests run, in one catalogue: name -> (world size, config).

A test file names the layouts its point needs (``pick``) and keeps only its own columns
(expected shares, a model, a tolerance) next to them; a layout spelled once here reads the
same in every file, and a new mode or axis is added to the matrix in one place.

Names say the axes, largest first where it matters: ``dp2`` (data), ``1d2`` / ``2d4`` /
``2.5d8`` / ``3d8`` / ``sequence2`` (tensor mode and its ranks), ``pp2`` (pipeline stages;
``-interleaved``: two chunks per stage), ``ep2`` (expert parallel); a compound is joined with
``-``, and the world size is the product, data filling what is left. Pipeline layouts give no
``num_microbatches``: a test adds its own (``layout("pp2", num_microbatches=2)``).
"""

from __future__ import annotations

import copy
from typing import Any


def tp(size: int, mode: str, **kw: Any) -> dict:
    """The config of ``size`` tensor ranks in ``mode``."""
    return dict(parallel=dict(tensor=dict(size=size, mode=mode, **kw)))


def _pp(size: int, *, tensor: dict | None = None, **kw: Any) -> dict:
    pipeline = dict(size=size, **kw) if kw else size
    parallel = dict(pipeline=pipeline)
    if tensor is not None:
        parallel["tensor"] = tensor
    return dict(parallel=parallel)


def _ep(size: int, **extra: Any) -> dict:
    return dict(moe=dict(expert_parallel_size=size), **extra)


CATALOGUE: dict[str, tuple[int, dict]] = {
    "one process": (1, {}),
    "dp2": (2, {}),
    "dp4": (4, {}),
    # tensor parallel, one mode each
    "1d2": (2, tp(2, "1d")),
    "1d4": (4, tp(4, "1d")),
    "dp2-1d2": (4, tp(2, "1d")),
    "dp2-2d4": (8, tp(4, "2d")),
    "dp2-2.5d4": (8, tp(4, "2.5d", depth=1)),
    "dp2-sequence2": (4, tp(2, "sequence")),
    "2d4": (4, tp(4, "2d")),
    "2.5d4": (4, tp(4, "2.5d", depth=1)),  # a 2 x 2 grid, depth 1
    "2.5d8": (8, tp(8, "2.5d", depth=2)),  # a 2 x 2 grid, replicated over depth 2
    "3d8": (8, tp(8, "3d")),
    "sequence2": (2, tp(2, "sequence")),
    # pipeline, alone and with data or tensor ranks
    "pp2": (2, _pp(2)),
    "pp4": (4, _pp(4)),
    "pp2-interleaved": (2, _pp(2, num_chunks=2)),
    "pp4-interleaved": (4, _pp(4, num_chunks=2)),
    "dp2-pp2": (4, _pp(2)),
    "dp2-pp2-interleaved": (4, _pp(2, num_chunks=2)),
    "1d2-pp2": (4, _pp(2, tensor=dict(size=2, mode="1d"))),
    "sequence2-pp2": (4, _pp(2, tensor=dict(size=2, mode="sequence"))),
    "dp2-1d2-pp2": (8, _pp(2, tensor=dict(size=2, mode="1d"))),
    "dp2-sequence2-pp2": (8, _pp(2, tensor=dict(size=2, mode="sequence"))),
    # experts: EXPERT ranks, data filling the rest (EXPERT_DATA = world / ep)
    "ep1": (1, _ep(1)),
    "ep2-dp2": (2, _ep(2)),
    "ep2-dp4": (4, _ep(2)),
    "ep4-dp4": (4, _ep(4)),
    "ep2-dp4-1d2": (4, _ep(2, parallel=dict(tensor=dict(size=2, mode="1d")))),
}


def layout(name: str, **extra: Any) -> tuple[int, dict]:
    """(world size, config) of ``name``, its config a fresh copy with ``extra``'s top-level
    keys added (a key the layout already sets is a ``KeyError``: say it in the catalogue)."""
    if name not in CATALOGUE:
        raise KeyError(f"no layout {name!r} in the catalogue; known: {sorted(CATALOGUE)}")
    world, config = CATALOGUE[name]
    config = copy.deepcopy(config)
    clash = set(config) & set(extra)
    if clash:
        raise KeyError(f"layout {name!r} already sets {sorted(clash)}")
    return world, {**config, **copy.deepcopy(extra)}


def pick(*names: str, **extra: Any) -> dict[str, tuple[int, dict]]:
    """{name: (world size, config)} of ``names``, in order, each with ``extra`` added."""
    return {name: layout(name, **extra) for name in names}


def tensor_of(name: str) -> dict:
    """The ``parallel.tensor`` section of a tensor-parallel layout (for tests that build a
    layer's group themselves)."""
    return layout(name)[1]["parallel"]["tensor"]
