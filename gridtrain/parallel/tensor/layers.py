"""Mode-agnostic layers: ``gt.nn.Linear(...)`` builds the configured tensor mode's Linear.

Each mode module (``dense``, ``mode_1d``, ``mode_2d``, ``mode_2p5d``, ``mode_3d``,
``sequence``) exports the same names with the same constructor arguments; this
file only picks the module from the current context's tensor mode.
"""

from __future__ import annotations

import contextlib
import importlib
from types import ModuleType
from typing import Any

from gridtrain.parallel.context import ParallelContext, get_context, has_context

MODE_MODULES = {
    None: "gridtrain.parallel.tensor.dense",
    "1d": "gridtrain.parallel.tensor.mode_1d",
    "2d": "gridtrain.parallel.tensor.mode_2d",
    "2.5d": "gridtrain.parallel.tensor.mode_2p5d",
    "3d": "gridtrain.parallel.tensor.mode_3d",
    "sequence": "gridtrain.parallel.tensor.sequence",
}


def mode_module(ctx: ParallelContext | None = None) -> ModuleType:
    """The implementation module of ``ctx``'s tensor mode (dense when no context exists)."""
    if ctx is None and not has_context():
        return importlib.import_module(MODE_MODULES[None])
    ctx = ctx or get_context()
    return importlib.import_module(MODE_MODULES[ctx.tensor_mode])


def resolve(name: str, ctx: ParallelContext | None = None) -> Any:
    """The configured mode's implementation of layer (or function) ``name``."""
    module = mode_module(ctx)
    try:
        return getattr(module, name)
    except AttributeError:
        mode = (ctx or get_context()).tensor_mode if has_context() else None
        raise NotImplementedError(
            f"gt.nn.{name} is not available under tensor mode {mode!r}"
        ) from None


class _ModeLayer:
    """Constructing a subclass builds the configured mode's class of the same name."""

    def __new__(cls, *args: Any, **kwargs: Any):
        return resolve(cls.__name__)(*args, **kwargs)


class Linear(_ModeLayer):
    """``Linear(in_features, out_features, bias=True)``; under 1d, consecutive ones alternate
    column- and row-parallel so an MLP or attention block needs no annotations."""


class Embedding(_ModeLayer):
    """``Embedding(num_embeddings, embedding_dim, padding_idx=None)``: hidden dim sharded."""


class VocabParallelEmbedding(_ModeLayer):
    """``VocabParallelEmbedding(num_embeddings, embedding_dim, padding_idx=None)``: vocab sharded."""


class LayerNorm(_ModeLayer):
    """``LayerNorm(normalized_shape, eps=1e-5)``."""


class Classifier(_ModeLayer):
    """``Classifier(in_features, num_classes, weight=None, bias=True)``: gathered logits."""


class VocabParallelClassifier(_ModeLayer):
    """``VocabParallelClassifier(in_features, num_classes, weight=None, bias=True)``:
    logits stay sharded over the vocabulary; pair with ``CrossEntropyLoss``."""


class PatchEmbedding(_ModeLayer):
    """``PatchEmbedding(img_size, patch_size, in_chans, embed_size)``: ViT stem with class token."""


class Dropout(_ModeLayer):
    """``Dropout(p)``: draws from the RNG state the mode's activation layout needs."""


class CrossEntropyLoss(_ModeLayer):
    """``CrossEntropyLoss()``: mean over the data-parallel rank's batch, whatever the mode."""


def accuracy(logits, labels, ctx: ParallelContext | None = None):
    """(correct, total) over this data-parallel rank's batch, reduced as the mode needs."""
    return resolve("accuracy", ctx)(logits, labels, ctx)


def split_batch(x, ctx: ParallelContext):
    """This rank's part of a batch tensor under ``ctx``'s tensor mode (the engine calls this)."""
    return resolve("split_batch", ctx)(x, ctx)


def shared_input(ctx: ParallelContext | None = None) -> contextlib.AbstractContextManager:
    """``with gt.nn.shared_input():`` Linears built inside read the same input (separate q, k,
    v projections); under 1d they get the same split (see ``mode_1d_linear``). A no-op where
    the mode needs no such hint."""
    fn = getattr(mode_module(ctx), "shared_input", None)
    return fn(ctx) if fn is not None else contextlib.nullcontext()


def position_ids(seq_len: int, device=None, ctx: ParallelContext | None = None):
    """Global positions of this rank's ``seq_len`` tokens, for position embeddings:
    ``arange(seq_len)``, offset by the rank's shard where the mode splits the sequence."""
    fn = getattr(mode_module(ctx), "position_ids", None)
    if fn is not None:
        return fn(seq_len, device, ctx)
    import torch

    return torch.arange(seq_len, device=device)


def attention(q, k, v, causal=False, key_padding_mask=None, dropout_p=0.0, scale=None, ctx=None):
    """Softmax attention of ``[B, H, s, D]`` q, k, v; ``key_padding_mask`` ``[B, s]``, True = pad.

    Ring self-attention under 'sequence' (``parallel.tensor.ring_attention`` picks the
    variant); ``scaled_dot_product_attention`` on the local heads in every other mode.
    """
    from gridtrain.parallel.tensor.sequence import ring_attention

    return ring_attention(q, k, v, causal, key_padding_mask, dropout_p, scale, ctx=ctx)
