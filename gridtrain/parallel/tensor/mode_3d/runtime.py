"""3d's runtime half: ``MODE``, the mode's spec (``tensor/spec.py``) on its geometry
(``geometry.py``): the blocked modes' planning (``tensor/blocked.py``) with the cube's
layers, orientations (``orientations.py``), batch split (``cube.py``) and loss (``loss.py``)."""

from gridtrain.parallel.tensor import blocked
from gridtrain.parallel.tensor.mode_3d import layers, mha
from gridtrain.parallel.tensor.mode_3d.cube import split_batch
from gridtrain.parallel.tensor.mode_3d.geometry import GEOMETRY
from gridtrain.parallel.tensor.mode_3d.loss import CrossEntropyLoss, accuracy
from gridtrain.parallel.tensor.mode_3d.orientations import orientation_options

MODE = blocked.blocked_mode(
    GEOMETRY,
    split_batch,
    CrossEntropyLoss,
    accuracy,
    layers=blocked.layer_table(layers, mha),
    entry_options=orientation_options,
)
