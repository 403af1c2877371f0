"""The LM head and its cross entropy in token chunks: the ``[tokens, vocab]`` logits are never
held whole (config ``chunked_loss = dict(chunk_tokens=...)``).

With the option on, the model's head (the Linear whose output is the model's output, in
any tensor mode) returns ``DeferredLogits``: its input and itself, not the
logits. ``gt.nn.CrossEntropyLoss`` recognises them and computes, chunk by chunk along the
token dims, ``head(hidden_chunk)`` and the chunk's summed loss under activation
checkpointing: forward keeps one chunk's logits at a time, backward recomputes each
chunk's logits once (the measured cost: one extra head matmul). Because the head is the
mode's own layer and the loss the mode's own loss, it is right in every tensor mode
(vocab-split logits included) with the unfused path's values. Anything else done with
deferred logits (``argmax``, slicing, a user loss) materialises them first, so nothing
breaks; it only loses the memory saving.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint


class DeferredLogits:
    """A head's input and the head: logits on demand, ``[..., vocab]`` as the head would give.

    Supports ``shape``, ``reshape``/``view``/``flatten`` of the token dims, ``float``/``to``
    (no-ops until materialised); everything else materialises the logits.
    """

    def __init__(self, hidden: Tensor, head: ChunkedHead, vocab: int, chunk_tokens: int):
        self.hidden, self.head, self.vocab, self.chunk_tokens = hidden, head, vocab, chunk_tokens

    @property
    def shape(self) -> torch.Size:
        return torch.Size((*self.hidden.shape[:-1], self.vocab))

    def dim(self) -> int:
        return self.hidden.dim()

    def size(self, dim: int | None = None):
        return self.shape if dim is None else self.shape[dim]

    def reshape(self, *shape) -> DeferredLogits:
        shape = tuple(shape[0]) if len(shape) == 1 and isinstance(shape[0], tuple | list) else shape
        if shape[-1] not in (self.vocab, -1) or len(shape) < 1:
            return self.materialize().reshape(*shape)
        tokens = shape[:-1] if shape[-1] == self.vocab else shape
        hidden = self.hidden.reshape(*tokens, self.hidden.shape[-1])
        return DeferredLogits(hidden, self.head, self.vocab, self.chunk_tokens)

    view = reshape

    def flatten(self, start_dim: int = 0, end_dim: int = -1) -> DeferredLogits | Tensor:
        end = end_dim % self.dim()
        if end == self.dim() - 1:  # the class dim joins the tokens: logits needed
            return self.materialize().flatten(start_dim, end_dim)
        return DeferredLogits(
            self.hidden.flatten(start_dim, end_dim), self.head, self.vocab, self.chunk_tokens
        )

    def float(self) -> DeferredLogits:
        return self  # the loss computes in >= fp32 anyway

    def to(self, *args, **kwargs) -> DeferredLogits | Tensor:
        return self

    def materialize(self) -> Tensor:
        """The logits, whole (the saving is lost)."""
        return self.head.compute(self.hidden)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.materialize(), name)

    def __getitem__(self, index) -> Tensor:
        return self.materialize()[index]

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        def real(x):
            return x.materialize() if isinstance(x, DeferredLogits) else x

        args = tuple(real(a) for a in args)
        kwargs = {k: real(v) for k, v in (kwargs or {}).items()}
        return func(*args, **kwargs)


class ChunkedHead:
    """What a head layer computes, and whether its logits are vocab-split.

    ``enable`` swaps the layer's ``forward`` (an instance attribute: the module path, hence
    the state dict keys, stay) for one that returns ``DeferredLogits`` while training.
    """

    def __init__(self, layer: nn.Module, compute, vocab: int, vocab_sharded: bool, chunk: int):
        self.layer, self.compute, self.vocab = layer, compute, vocab
        self.vocab_sharded, self.chunk_tokens = vocab_sharded, chunk

    def __call__(self, hidden: Tensor):
        if not (self.layer.training and torch.is_grad_enabled()):
            return self.compute(hidden)
        return DeferredLogits(hidden, self, self.vocab, self.chunk_tokens)

    @classmethod
    def enable(cls, layer: nn.Module, vocab: int, vocab_sharded: bool, chunk_tokens: int) -> None:
        layer.forward = cls(layer, layer.forward, vocab, vocab_sharded, chunk_tokens)


def chunked_cross_entropy(loss: nn.Module, logits: DeferredLogits, labels: Tensor) -> Tensor:
    """``loss(logits, labels)`` (a ``GridCrossEntropyLoss``) without whole logits: per chunk of
    tokens the head and the summed loss under checkpointing, then the loss's own mean."""
    hidden = logits.hidden
    if tuple(hidden.shape[:-1]) != tuple(labels.shape):
        return loss(logits.materialize(), labels)
    # chunk along the last token dim: batch splits (2d/3d) live on dim 0 and stay whole
    dim = hidden.dim() - 2
    per_row = math.prod(hidden.shape[:dim]) if dim > 0 else 1
    n = max(1, math.ceil(hidden.shape[dim] * per_row / logits.chunk_tokens))
    summed = loss.with_reduction("sum")
    total = None
    for h, y in zip(hidden.chunk(n, dim), labels.chunk(n, dim), strict=True):
        part = checkpoint(_chunk_loss, summed, logits.head, h, y, use_reentrant=False)
        total = part if total is None else total + part
    if loss.reduction == "sum":
        return total
    return total / loss.count(labels, logits.head.vocab_sharded)


def _chunk_loss(summed: nn.Module, head: ChunkedHead, h: Tensor, y: Tensor) -> Tensor:
    return summed(head.compute(h), y)
