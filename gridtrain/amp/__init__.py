"""Mixed precision: torch autocast, naive fp16 with master weights, bf16."""

from gridtrain.amp.types import AMP_TYPE

__all__ = ["AMP_TYPE"]
