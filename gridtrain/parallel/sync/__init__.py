"""One gradient-sync interface (``GradSync``) and the pieces its implementations share.

``base``: the interface and a chain of syncs; ``buckets``: the one bucket builder and the
all-reduce bucket; ``data_parallel``: the overlapped data-parallel all-reduce; ``each_backward``: ZeRO 2's
reduce-scatter in every backward. ZeRO's
runtimes (``parallel.zero``) and the gradient handlers (``gridtrain.gradient_handlers``)
implement the same interface; ``gridtrain.engine.grad_sync`` picks one per configuration.
"""

from gridtrain.parallel.sync.base import GradSync, GradSyncs
from gridtrain.parallel.sync.buckets import (
    DEFAULT_BUCKET_MB,
    Bucket,
    all_reduce_buckets,
    build_buckets,
    group_buckets,
)
from gridtrain.parallel.sync.data_parallel import OverlappedDataParallel
from gridtrain.parallel.sync.each_backward import EachBackward

__all__ = [
    "DEFAULT_BUCKET_MB",
    "Bucket",
    "EachBackward",
    "GradSync",
    "GradSyncs",
    "OverlappedDataParallel",
    "all_reduce_buckets",
    "build_buckets",
    "group_buckets",
]
