"""The plan styles, each defined once: what a name in ``parallel.tensor.plan`` does to a module.

A style is one ``Style`` object, as a torch ``ParallelStyle`` is: its name as a plan writes it,
the kinds of layer it applies to, what it does in words, and the facts the planner reads off
it (a Linear whose output features stay split for a row-parallel reader, one that reads them
so, a model output and how its logits come out, packed blocks, a module left as it is). What
a style makes of a layer under a tensor mode is the mode's: ``Style.layer`` asks the mode's
spec (``TensorMode``, from the mode registry) for the layer it keys by (kind, style), so a mode
is still one folder; a style registered from outside (``register_style``) may bring its own
layers per mode.

Everything that names styles reads them here: the config's validation
(``gridtrain.config.STYLES``), the planner's kind check, each mode's inference and layer table,
``gt.nn.Linear``'s hints and the Hugging Face adapter's reading of a model's ``_tp_plan``. This
module imports no torch: the config reads it.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from gridtrain.registry import Registry

# the kinds of layer the planner tells apart (``plan.kind_of``)
LINEAR, EMBEDDING, NORM, DROPOUT, PATCH, OPAQUE, ATTENTION = (
    "linear",
    "embedding",
    "norm",
    "dropout",
    "patch",
    "opaque",
    "attention",  # nn.MultiheadAttention: its packed in_proj and out_proj as one layer
)
KINDS = (LINEAR, EMBEDDING, NORM, DROPOUT, PATCH, OPAQUE, ATTENTION)
WHOLE, SPLIT = "whole", "split"  # a head's logits: gathered on every rank, or split over classes


@dataclass(frozen=True)
class Style:
    """One style (module docstring). ``column``: a Linear's output features split and left
    split for a row-parallel reader; ``row``: a Linear reading such a split input; ``logits``:
    a model output's style, ``WHOLE`` or ``SPLIT``; ``packed``: the output packs equal blocks,
    each split; ``keeps``: the module stays as it is (a dropout still draws from its mode's
    stream); ``hf_names``: other spellings in Hugging Face's ``tp_plan``; ``hint``:
    ``gt.nn.Linear``'s ``(split, flag)`` that means it (the flag is ``gather_output`` for a
    column split, ``parallel_input`` for a row split); ``layers``: its own layers, mode name ->
    kind -> (factory, options), for a style gridtrain's modes do not implement."""

    name: str
    does: str
    kinds: tuple[str, ...]
    column: bool = False
    row: bool = False
    logits: str | None = None
    packed: bool = False
    keeps: bool = False
    hf_names: tuple[str, ...] = ()
    hint: tuple[str, bool] | None = None
    layers: Mapping[str | None, Mapping[str, tuple[Any, dict]]] = field(
        default_factory=dict, compare=False, hash=False
    )

    def applies_to(self, kind: str) -> bool:
        """Whether a ``kind`` layer may take this style."""
        return kind in self.kinds

    def layer(self, kind: str, mode: Any) -> tuple[Any, dict] | None:
        """What this style makes of a ``kind`` layer under ``mode`` (a ``TensorMode``):
        (factory, fixed options), its own for the mode's name where it brings one, else the
        mode's layer for it; None where neither has one."""
        own = self.layers.get(mode.name, {}).get(kind)
        return own if own is not None else mode.layers.get((kind, self))


COLWISE = Style(
    "colwise",
    "Linear: output features split (output stays sharded); on an Embedding: the embedding "
    "dim split",
    (LINEAR, EMBEDDING, PATCH),
    column=True,
    hint=("column", False),
)
ROWWISE = Style(
    "rowwise",
    "Linear: input features split, partial products all-reduced (replicated output)",
    (LINEAR,),
    row=True,
    hint=("row", True),
)
COLWISE_GATHER_OUTPUT = Style(
    "colwise_gather_output",
    "Linear: output features split, then all-gathered (replicated output)",
    (LINEAR,),
    logits=WHOLE,
    hf_names=("colwise_rep",),
    hint=("column", True),
)
ROWWISE_SPLIT_INPUT = Style(
    "rowwise_split_input",
    "Linear: row-parallel on a replicated input (each rank cuts its slice)",
    (LINEAR,),
    hf_names=("rowwise_rep",),
    hint=("row", False),
)
PACKED_COLWISE = Style(
    "packed_colwise",
    "Linear/Conv1D whose output packs several equal blocks (fused q/k/v, gate/up): each block "
    "split column-wise, so every rank keeps whole heads of each",
    (LINEAR,),
    column=True,
    packed=True,
)
EMBEDDING_ROWWISE = Style(
    "embedding_rowwise", "Embedding: vocabulary split, partial rows all-reduced", (EMBEDDING,)
)
EMBEDDING_COLWISE = Style(
    "embedding_colwise", "Embedding: embedding dim split, output all-gathered", (EMBEDDING,)
)
VOCAB_PARALLEL = Style(
    "vocab_parallel",
    "output Linear (LM head, classifier): logits stay sharded over the classes; pair with "
    "gt.nn.CrossEntropyLoss",
    (LINEAR,),
    logits=SPLIT,
)
GATHER_OUTPUT = Style(
    "gather_output",
    "output Linear (LM head, classifier): full logits on every rank (2d/2.5d/3d: the mode's "
    "Classifier)",
    (LINEAR,),
    logits=WHOLE,
)
HEADS = Style(
    "heads",
    "nn.MultiheadAttention: the packed in_proj cut into each rank's q, k and v heads, out_proj "
    "row-parallel (sequence: ring attention over the split positions)",
    (ATTENTION,),
)
NORM_STYLE = Style("norm", "LayerNorm / RMSNorm over the last dim, in the mode's layout", (NORM,))
GRAD_SUMMED = Style(
    "replicated_with_grad_allreduce",
    "a norm on activations split over the tensor group (a per-head q_norm after a "
    "column-parallel q_proj): its weight whole on every rank, its gradient summed over the group",
    (NORM,),
)
AUTO = Style(
    "auto", "the mode's own layer (2d/2.5d/3d: every Linear is a SUMMA / cube Linear)", (LINEAR,)
)
REPLICATE = Style(
    "replicate", "leave the module as it is (every rank holds it whole)", KINDS, keeps=True
)

BUILT_IN = (
    COLWISE,
    ROWWISE,
    COLWISE_GATHER_OUTPUT,
    ROWWISE_SPLIT_INPUT,
    PACKED_COLWISE,
    EMBEDDING_ROWWISE,
    EMBEDDING_COLWISE,
    VOCAB_PARALLEL,
    GATHER_OUTPUT,
    HEADS,
    NORM_STYLE,
    GRAD_SUMMED,
    AUTO,
    REPLICATE,
)
_REGISTRY = Registry("style")  # name -> Style
for _style in BUILT_IN:
    _REGISTRY.add(_style.name, _style, built_in=True)
_NONE = Style("", "no style", ())  # what an unknown name reads as: no fact holds


def register_style(style: Style) -> Style:
    """Make ``style.name`` a style ``parallel.tensor.plan`` (and ``gt.nn.Linear(split=)``)
    accepts; every rank of a run registers it before it loads a config naming it."""
    return _REGISTRY.add(style.name, style)


def unregister_style(name: str) -> None:
    """Forget a style ``register_style`` added (a test's or a plugin's, for a while)."""
    _REGISTRY.remove(name)


def of(name: str | None) -> Style:
    """The style named ``name``; an unknown name (or None) reads as a style of no facts."""
    return _REGISTRY.get(name, _NONE) if name is not None else _NONE


def styles_for(kind: str) -> tuple[str, ...]:
    """The names of the styles a ``kind`` layer may take, in registration order."""
    return styles_where(lambda s: s.applies_to(kind))


def styles_where(test) -> tuple[str, ...]:
    """The names of the registered styles that pass ``test`` (a ``Style`` -> bool)."""
    return tuple(n for n, s in _REGISTRY.items() if test(s))


def from_hf(name: str) -> str:
    """A Hugging Face ``tp_plan`` style in gridtrain's name (its own where none spells it)."""
    return next((s.name for s in _REGISTRY.values() if name in s.hf_names), name)


def from_hint(split: str, flag: bool) -> str:
    """The style ``gt.nn.Linear(split=split)`` means, with its gather_output / parallel_input."""
    return next(s.name for s in _REGISTRY.values() if s.hint == (split, flag))


class Described(Mapping):
    """The registered styles, name -> what each does, as they stand when read
    (``gridtrain.config.STYLES``: the config's allowed values)."""

    def __getitem__(self, name: str) -> str:
        return _REGISTRY[name].does

    def __iter__(self) -> Iterator[str]:
        return iter(list(_REGISTRY))

    def __len__(self) -> int:
        return len(_REGISTRY)

    def __repr__(self) -> str:
        return repr(dict(self))


STYLES = Described()
