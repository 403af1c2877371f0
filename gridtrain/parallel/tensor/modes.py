"""The tensor modes by their config names (``parallel.tensor.mode``): name -> ``ModeGeometry``.

A mode is one package under ``parallel/tensor/``: a torch-free ``geometry.py`` (its
``ModeGeometry``, ``tensor/geometry.py``) and the runtime half its geometry names (layers,
loss, forward context: a ``TensorMode``, found by ``registry.py``). Adding a mode is its
package and one ``register_mode`` line below; the config accepts its name from then on.

This module imports no torch: the config, ``Layout`` and ``gridtrain estimate`` read it.
"""

from __future__ import annotations

from gridtrain.parallel.tensor.geometry import ModeGeometry
from gridtrain.parallel.tensor.mode_1d.geometry import GEOMETRY as MODE_1D
from gridtrain.parallel.tensor.mode_2d.geometry import GEOMETRY_2D, GEOMETRY_2P5D
from gridtrain.parallel.tensor.mode_3d.geometry import GEOMETRY as MODE_3D
from gridtrain.parallel.tensor.none.geometry import GEOMETRY as NO_MODE
from gridtrain.parallel.tensor.sequence.geometry import GEOMETRY as SEQUENCE
from gridtrain.registry import Registry

GEOMETRIES: Registry = Registry("tensor mode")  # name -> ModeGeometry


def register_mode(geometry: ModeGeometry) -> ModeGeometry:
    """Make ``geometry.name`` a ``parallel.tensor.mode`` (its runtime half is imported by
    ``geometry.runtime`` on first use). A process registers a mode before it loads a config
    naming it; every rank of a run registers it."""
    return GEOMETRIES.add(geometry.name, geometry)


def unregister_mode(name: str) -> None:
    """Forget a mode ``register_mode`` added (a test's or a plugin's, for a while)."""
    GEOMETRIES.remove(name)


BUILT_IN = (NO_MODE, MODE_1D, GEOMETRY_2D, GEOMETRY_2P5D, MODE_3D, SEQUENCE)
for _geometry in BUILT_IN:
    GEOMETRIES.add(_geometry.name, _geometry, built_in=True)


def mode_names() -> tuple[str, ...]:
    """The registered mode names (no tensor mode, None, left out)."""
    return tuple(name for name in GEOMETRIES if name is not None)


def geometry_of(name: str | None) -> ModeGeometry:
    """The geometry of the tensor mode ``name`` (None: no tensor mode)."""
    if name not in GEOMETRIES:
        allowed = ", ".join(repr(m) for m in GEOMETRIES)
        raise ValueError(f"parallel.tensor.mode must be one of {allowed}; got {name!r}")
    return GEOMETRIES[name]


def names_where(test) -> str:
    """The names of the modes whose geometry passes ``test``, quoted, for messages
    (``'a'``, ``'a' or 'b'``, ``'a', 'b' or 'c'``)."""
    names = [repr(n) for n, g in GEOMETRIES.items() if n is not None and test(g)]
    return " or ".join(names) if len(names) < 3 else ", ".join(names[:-1]) + " or " + names[-1]
