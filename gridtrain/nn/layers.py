"""``gt.nn`` layers: plain modules; a hint (``gt_style``) says how the planner should cut them."""

from __future__ import annotations

from torch import Tensor, nn

from gridtrain.parallel.context import ParallelContext, has_context
from gridtrain.parallel.tensor import none, style
from gridtrain.parallel.tensor.registry import spec_of


class Linear(nn.Linear):
    """``nn.Linear``; optional hints for 1d: ``split="column"|"row"`` (or any plan style such
    as ``"colwise"``), ``gather_output=`` (column), ``parallel_input=`` (row), ``packed=k``
    (the output packs k equal blocks, e.g. fused q/k/v laid out ``[q | k | v]``)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        device=None,
        dtype=None,
        *,
        split: str | None = None,
        gather_output: bool | None = None,
        parallel_input: bool | None = None,
        packed: int | None = None,
    ):
        super().__init__(in_features, out_features, bias, device, dtype)
        hint = _linear_style(split, gather_output, parallel_input, packed)
        if hint is not None:
            self.gt_style = hint
        if packed:
            self.gt_packed = packed


def _linear_style(split, gather_output, parallel_input, packed) -> str | None:
    if packed:
        packed_style = style.PACKED_COLWISE.name
        if split not in (None, "column", packed_style) or gather_output:
            raise ValueError("gt.nn.Linear: packed=k is a column split (no gather_output)")
        return packed_style
    if split is None:
        if gather_output is not None and parallel_input is not None:
            raise ValueError(
                "gt.nn.Linear: gather_output (column-parallel) and parallel_input "
                "(row-parallel) exclude each other; pass split='column' or split='row'"
            )
        if gather_output is not None:
            split = "column"
        elif parallel_input is not None:
            split = "row"
        else:
            return None
    if split in ("column", "row"):
        if split == "column" and parallel_input is not None:
            raise ValueError("gt.nn.Linear: parallel_input applies to split='row' only")
        if split == "row" and gather_output is not None:
            raise ValueError("gt.nn.Linear: gather_output applies to split='column' only")
        flag = bool(gather_output) if split == "column" else parallel_input is not False
        return style.from_hint(split, flag)
    allowed = style.styles_for(style.LINEAR)
    if split not in allowed:
        raise ValueError(
            f"gt.nn.Linear: split must be 'column', 'row' or a Linear style "
            f"({', '.join(allowed)}), got {split!r}"
        )
    return split


class Embedding(nn.Embedding):
    """``nn.Embedding``; under 1d its embedding dim is split (``embedding_colwise``)."""

    gt_style = style.EMBEDDING_COLWISE.name


class VocabParallelEmbedding(nn.Embedding):
    """``nn.Embedding`` whose vocabulary is split (``embedding_rowwise``)."""

    gt_style = style.EMBEDDING_ROWWISE.name


class LayerNorm(nn.LayerNorm):
    """``nn.LayerNorm`` (replicated under 1d, split over the grid under 2d/2.5d/3d)."""


class RMSNorm(nn.RMSNorm):
    """``nn.RMSNorm``, sharded like ``LayerNorm``."""


class Dropout(nn.Dropout):
    """``nn.Dropout``; draws each mask from the random stream its activations' layout needs."""


class Classifier(none.Classifier):
    """A head whose logits every rank sees whole (``gather_output``); ``weight=`` ties it."""

    gt_style = style.GATHER_OUTPUT.name


class VocabParallelClassifier(none.Classifier):
    """A head whose logits stay split over the classes (``vocab_parallel``); pair with
    ``gt.nn.CrossEntropyLoss``, which never gathers them."""

    gt_style = style.VOCAB_PARALLEL.name


class PatchEmbedding(none.PatchEmbedding):
    """ViT stem: conv patches, class token, position embeddings (split like the hidden dim)."""


class CrossEntropyLoss(nn.Module):
    """``nn.CrossEntropyLoss``'s arguments; right for logits of any layout.

    Under a tensor mode it is that mode's loss (gathered or vocab-sharded logits,
    batch or sequence split): every rank reports the mean over its data-parallel
    rank's batch, as the dense loss would. ``vocab_parallel`` forces the path for
    vocab-sharded logits made without a marker. Class dim last, or at 1.
    """

    def __init__(
        self,
        weight: Tensor | None = None,
        ignore_index: int = -100,
        reduction: str = "mean",
        label_smoothing: float = 0.0,
        *,
        vocab_parallel: bool | None = None,
        ctx: ParallelContext | None = None,
    ):
        super().__init__()
        self.register_buffer("weight", weight)
        self.ignore_index, self.reduction = ignore_index, reduction
        self.label_smoothing, self.vocab_parallel = label_smoothing, vocab_parallel
        self.ctx = ctx
        self._impls: dict = {}
        self._impl()  # checks the arguments now

    def _impl(self) -> nn.Module:
        ctx = self.ctx
        if ctx is None and has_context():
            from gridtrain.parallel.context import get_context

            ctx = get_context()
        key = id(ctx)
        if key not in self._impls:
            cls = spec_of(ctx).loss
            self._impls[key] = cls(
                self.weight, self.ignore_index, self.reduction, self.label_smoothing,
                vocab_parallel=self.vocab_parallel, ctx=ctx,
            )  # fmt: skip
        impl = self._impls[key]
        impl.weight = self.weight  # follows .to(device)
        return impl

    def forward(self, logits: Tensor, labels: Tensor) -> Tensor:
        return self._impl()(logits, labels)  # deferred (chunked-loss) logits included
