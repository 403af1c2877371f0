"""``nn.MultiheadAttention`` under the tensor modes: the shared layer (``layer.py``), the
attention on a rank's heads (``attend.py``), the call's checks (``call.py``) and the rows and
masks a rank holds (``rows.py``); each mode package builds its layer from these."""

from gridtrain.parallel.tensor.mha.call import Limits
from gridtrain.parallel.tensor.mha.layer import ShardedMultiheadAttention, no_fast_path
from gridtrain.parallel.tensor.mha.rows import Rows

__all__ = ["Limits", "Rows", "ShardedMultiheadAttention", "no_fast_path"]
