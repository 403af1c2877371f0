"""'toy1d''s runtime half: 1d's layers, loss and planning on the toy's geometry."""

import dataclasses

from gridtrain.parallel.tensor.mode_1d import MODE as ONE_D
from helpers.toy_mode.geometry import GEOMETRY

MODE = dataclasses.replace(ONE_D, geometry=GEOMETRY)
