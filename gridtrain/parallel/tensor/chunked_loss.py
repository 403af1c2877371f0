"""The LM head and its cross entropy in token chunks: the ``[tokens, vocab]`` logits are never
held whole (config ``chunked_loss = dict(chunk_tokens=...)``).

With the option on, the model's head (the Linear whose output is the model's output, in
any tensor mode) returns ``DeferredLogits``: its input and itself, not the
logits. ``gt.nn.CrossEntropyLoss`` recognises them and computes, chunk by chunk along the
token dims, ``head(hidden_chunk)`` and the chunk's summed loss, one chunk's logits at a
time. By default each chunk's gradients (for the hidden chunk and the head's weights) are
taken right there, in the forward, and the backward only scales them by the incoming
gradient (Liger's fused linear cross entropy does the same): no head matmul is run twice.
``recompute=True`` instead keeps nothing but the hidden states and recomputes each chunk's
logits in the backward (activation checkpointing: one extra head matmul, no stored
gradients). Because the head is the mode's own layer and the loss the mode's own loss, it
is right in every tensor mode (vocab-split logits included) with the unfused path's
values. Anything else done with deferred logits (``argmax``, slicing, a user loss)
materialises them first, so nothing breaks; it only loses the memory saving.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor, nn
from torch.autograd.function import once_differentiable
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

    def __init__(
        self,
        layer: nn.Module,
        compute,
        vocab: int,
        vocab_sharded: bool,
        chunk: int,
        recompute: bool = False,
    ):
        self.layer, self.compute, self.vocab = layer, compute, vocab
        self.vocab_sharded, self.chunk_tokens, self.recompute = vocab_sharded, chunk, recompute
        self._leaves: tuple[tuple[int, ...], list[Tensor] | None] | None = None

    def __call__(self, hidden: Tensor):
        if not (self.layer.training and torch.is_grad_enabled()):
            return self.compute(hidden)
        return DeferredLogits(hidden, self, self.vocab, self.chunk_tokens)

    @classmethod
    def enable(
        cls,
        layer: nn.Module,
        vocab: int,
        vocab_sharded: bool,
        chunk_tokens: int,
        recompute: bool = False,
    ) -> None:
        layer.forward = cls(layer, layer.forward, vocab, vocab_sharded, chunk_tokens, recompute)

    def leaves(self, summed: nn.Module, h: Tensor, y: Tensor) -> list[Tensor] | None:
        """The tensors requiring grad that one chunk's loss reaches besides its hidden states
        (the head's weights, a tied embedding's included), found once by walking a chunk's
        graph; None where one is not a plain tensor (a DTensor, FSDP's unsharded weights),
        whose gradients must flow through the normal backward (``recompute``)."""
        key = tuple((id(p), p.requires_grad) for p in self.layer.parameters())  # + freezing
        if self._leaves is None or self._leaves[0] != key:
            with torch.enable_grad():
                probe = h.detach().requires_grad_()
                found = _graph_leaves(summed(self.compute(probe), y).grad_fn)
            found = [t for t in found if t is not probe]
            plain = all(type(t) in (Tensor, nn.Parameter) for t in found)
            self._leaves = (key, found if plain else None)
        return self._leaves[1]


def _graph_leaves(root) -> list[Tensor]:
    """The leaf tensors whose gradients the autograd graph under ``root`` accumulates."""
    leaves, seen, stack = {}, set(), [root]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if hasattr(node, "variable"):  # AccumulateGrad
            leaves[id(node.variable)] = node.variable
        stack.extend(fn for fn, _ in node.next_functions)
    return list(leaves.values())


def chunked_cross_entropy(loss: nn.Module, logits: DeferredLogits, labels: Tensor) -> Tensor:
    """``loss(logits, labels)`` (a ``GridCrossEntropyLoss``) without whole logits: per chunk of
    tokens the head and the summed loss, with their gradients taken in the forward (or under
    checkpointing: ``recompute``, fp16), then the loss's own mean."""
    hidden = logits.hidden
    if tuple(hidden.shape[:-1]) != tuple(labels.shape):
        return loss(logits.materialize(), labels)
    # chunk along the last token dim: batch splits (2d/3d) live on dim 0 and stay whole
    dim = hidden.dim() - 2
    per_row = math.prod(hidden.shape[:dim]) if dim > 0 else 1
    n = max(1, math.ceil(hidden.shape[dim] * per_row / logits.chunk_tokens))
    summed = loss.with_reduction("sum")
    head = logits.head
    pieces = list(zip(hidden.chunk(n, dim), labels.chunk(n, dim), strict=True))
    leaves = None
    if not (head.recompute or _fp16(hidden)) and torch.is_grad_enabled():
        leaves = head.leaves(summed, *pieces[0])
    if leaves is not None:
        total = _LossWithGradients.apply(summed, head, labels, n, dim, hidden, *leaves)
    else:
        total = None
        for h, y in pieces:
            part = checkpoint(_chunk_loss, summed, head, h, y, use_reentrant=False)
            total = part if total is None else total + part
    if loss.reduction == "sum":
        return total
    return total / loss.count(labels, logits.head.vocab_sharded)


def _fp16(hidden: Tensor) -> bool:
    """Whether the head runs in fp16, where a chunk's weight gradient (a sum over its tokens,
    taken before the loss scale and 1/count arrive) can overflow: those runs recompute."""
    device = hidden.device.type
    autocast = torch.is_autocast_enabled(device) and torch.get_autocast_dtype(device)
    return torch.float16 in (autocast, hidden.dtype)


def _chunk_loss(summed: nn.Module, head: ChunkedHead, h: Tensor, y: Tensor) -> Tensor:
    return summed(head.compute(h), y)


class _LossWithGradients(torch.autograd.Function):
    """The summed loss over all chunks; each chunk's gradients are taken in the forward
    (for a unit upstream gradient) and the backward scales them by the real one.

    Gradients are of the *summed* loss (1/count and any loss scale arrive with the upstream
    gradient), so a chunk's weight gradient is a sum over its tokens: fine in fp32 and bf16,
    but it could overflow fp16, whose runs take the recompute path (``_fp16``). Weight
    gradients add over chunks in fp32 (or the weight's dtype if wider).
    """

    @staticmethod
    def forward(ctx, summed, head, labels, n, dim, hidden, *leaves):
        total, grad_hidden = None, torch.empty_like(hidden)  # filled chunk by chunk
        sums = [
            torch.zeros_like(t, dtype=torch.promote_types(t.dtype, torch.float32)) for t in leaves
        ]
        pieces = zip(
            hidden.chunk(n, dim), labels.chunk(n, dim), grad_hidden.chunk(n, dim), strict=True
        )
        with torch.enable_grad():
            for h, y, out in pieces:
                h = h.detach().requires_grad_()
                part = summed(head.compute(h), y)
                grads = torch.autograd.grad(part, (h, *leaves), allow_unused=True)
                out.copy_(grads[0])
                for acc, g in zip(sums, grads[1:], strict=True):
                    if g is not None:
                        acc.add_(g)
                part = part.detach()
                total = part if total is None else total + part
                del grads  # before the next chunk's: one weight-sized gradient at a time
        ctx.save_for_backward(grad_hidden, *sums)
        ctx.dtypes = [t.dtype for t in leaves]
        return total

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_total):
        grad_hidden, *sums = ctx.saved_tensors
        grads = [
            _scaled(acc, grad_total, dtype) for acc, dtype in zip(sums, ctx.dtypes, strict=True)
        ]
        return None, None, None, None, None, _scaled(grad_hidden, grad_total), *grads


def _scaled(grad: Tensor, scale: Tensor, dtype: torch.dtype | None = None) -> Tensor:
    """``grad * scale`` in at least fp32 (the scale is 1/count times the loss scale, applied
    as the unfused loss applies it), cast to ``dtype``. An exact zero stays zero, as an
    ignored token's gradient does in the unfused loss, even where the scale is inf (a batch
    with every label ignored: count 0)."""
    wide = torch.promote_types(grad.dtype, torch.float32)
    out = grad.to(wide) * scale
    return torch.where(grad == 0, 0.0, out).to(dtype or grad.dtype)
