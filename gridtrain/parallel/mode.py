"""The named process groups of the rank grid."""

from enum import Enum


class ParallelMode(str, Enum):
    """Every process group gridtrain builds, by the axis (or axes) of the grid it spans.

    See ``ParallelContext`` for how each group is cut from the one rank grid
    ``global_rank = ((d * P) + p) * T + t``.
    """

    GLOBAL = "global"
    DATA = "data"
    PIPELINE = "pipeline"
    TENSOR = "tensor"
    MODEL = "model"  # pipeline x tensor: everything that holds one model replica

    # sequence parallelism: the tensor axis carries sequence shards
    SEQUENCE = "sequence"
    SEQUENCE_DP = "sequence_dp"  # data x sequence: all ranks of one pipeline stage

    PARALLEL_1D = "1d"

    # 2d (Optimus / SUMMA): tensor rank t = row * q + col
    PARALLEL_2D_ROW = "2d_row"  # same row, col varies
    PARALLEL_2D_COL = "2d_col"  # same col, row varies

    # 2.5d (Tesseract): tensor rank t = dep * q * q + row * q + col
    PARALLEL_2P5D_ROW = "2p5d_row"  # same (dep, row), col varies
    PARALLEL_2P5D_COL = "2p5d_col"  # same (dep, col), row varies
    PARALLEL_2P5D_DEP = "2p5d_dep"  # same (row, col), dep varies
    PARALLEL_2P5D_XZ = "2p5d_xz"  # same row, (dep, col) vary

    # 3d (Bian et al.): tensor rank t = k * d * d + j * d + i
    PARALLEL_3D_INPUT = "3d_input"  # same (j, k), i varies
    PARALLEL_3D_WEIGHT = "3d_weight"  # same (i, k), j varies
    PARALLEL_3D_OUTPUT = "3d_output"  # same (i, j), k varies
    PARALLEL_3D_INPUT_X_WEIGHT = "3d_input_x_weight"  # same k, (i, j) vary
    PARALLEL_3D_OUTPUT_X_WEIGHT = "3d_output_x_weight"  # same i, (j, k) vary
    PARALLEL_3D_INPUT_X_OUTPUT = "3d_input_x_output"  # same j, (i, k) vary

    # mixture of experts: the data axis is cut into expert groups
    EXPERT = "expert"  # consecutive data ranks that hold different experts
    EXPERT_DATA = "expert_data"  # data ranks that hold the same experts
