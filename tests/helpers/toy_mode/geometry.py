"""'toy1d''s geometry: 1d's groups, head split and cost formulas, under its own name."""

import dataclasses

from gridtrain.parallel.tensor.mode_1d.geometry import GEOMETRY as ONE_D

GEOMETRY = dataclasses.replace(ONE_D, name="toy1d", runtime="helpers.toy_mode.runtime:MODE")
