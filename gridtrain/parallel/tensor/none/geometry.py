"""No tensor mode's geometry: the base ``ModeGeometry`` as it is (every layer whole)."""

from gridtrain.parallel.tensor.geometry import ModeGeometry

GEOMETRY = ModeGeometry()
