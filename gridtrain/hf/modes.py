"""What ``gridtrain.hf`` asks of a tensor mode, answered by its geometry (``ModeGeometry``,
registered in ``parallel/tensor/modes.py``), never by its name: a mode registered later is
asked the same questions."""

from __future__ import annotations

from gridtrain.parallel.tensor.geometry import ModeGeometry
from gridtrain.parallel.tensor.modes import GEOMETRIES, names_where


def takes_styles(geometry: ModeGeometry) -> bool:
    """The mode splits weights by the plan's column / row styles, on activations neither
    blocked over the hidden dim nor cut by position (1d)."""
    return geometry.name is not None and not geometry.blocked and not geometry.splits_sequence


def sequence_modes() -> str:
    """The names of the modes that cut the sequence, quoted, for messages."""
    return names_where(lambda g: g.splits_sequence)


def whole_hidden_modes() -> str:
    """The names of the tensor modes that keep each rank's hidden states whole, unquoted, for
    messages."""
    names = [str(n) for n, g in GEOMETRIES.items() if n is not None and not g.blocked]
    return " or ".join(names) if len(names) < 3 else ", ".join(names[:-1]) + " or " + names[-1]
