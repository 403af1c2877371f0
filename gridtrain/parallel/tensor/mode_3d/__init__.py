"""3D tensor parallelism on a d x d x d cube (Bian et al. 2021).

``MODE`` is the mode's spec (``tensor/spec.py``): the blocked modes' planning
(``tensor/blocked.py``) with the cube's layers, orientations (``orientations.py``),
batch split (``cube.py``) and loss (``loss.py``)."""

from gridtrain.parallel.tensor import blocked
from gridtrain.parallel.tensor.mode_3d import layers, mha
from gridtrain.parallel.tensor.mode_3d.cube import (
    Cube,
    cube_groups,
    cube_side,
    split_batch,
    swap_orientation,
)
from gridtrain.parallel.tensor.mode_3d.layers import (
    Classifier,
    Embedding,
    Linear,
    Norm,
    PatchEmbedding,
    VocabParallelClassifier,
    VocabParallelEmbedding,
)
from gridtrain.parallel.tensor.mode_3d.loss import CrossEntropyLoss, accuracy
from gridtrain.parallel.tensor.mode_3d.mha import MultiheadAttention
from gridtrain.parallel.tensor.mode_3d.orientations import orientation_options


def _head_split(size: int, depth: int) -> tuple[int, str]:
    d = cube_side(size)
    return d, f"the cube's hidden axis (d = {d})"


MODE = blocked.blocked_mode(
    "3d",
    split_batch,
    CrossEntropyLoss,
    accuracy,
    layers=blocked.layer_table(layers, mha),
    groups=cube_groups,
    head_split=_head_split,
    entry_options=orientation_options,
)

__all__ = [
    "MODE",
    "Classifier",
    "CrossEntropyLoss",
    "Cube",
    "Embedding",
    "Linear",
    "MultiheadAttention",
    "Norm",
    "PatchEmbedding",
    "VocabParallelClassifier",
    "VocabParallelEmbedding",
    "accuracy",
    "split_batch",
    "swap_orientation",
]
