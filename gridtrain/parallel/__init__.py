"""Process-group topology, collectives and the parallel layer implementations.

The names below load on first use (PEP 562): the config reads the tensor modes' torch-free
geometry from ``gridtrain.parallel.tensor``, which must not pull in the context and torch.
"""

from gridtrain.parallel.tensor.lazy import exports

_WHERE = {"ParallelContext": "context", "get_context": "context", "ParallelMode": "mode"}
__all__ = sorted(_WHERE)
__getattr__ = exports(__name__, _WHERE)
