"""What 2d, 2.5d and 3d share: every activation is blocked over the tensor grid.

Both grids cut an activation's batch and hidden dims over their axes, so every
Linear is the mode's Linear, a Linear whose output is a model output is the
mode's classifier (logits gathered), and every parameter must belong to a layer
the mode shards: a weight left whole could not meet the blocked activations.
``mode_2d`` and ``mode_3d`` build their specs from these parts and their own layers.
"""

from __future__ import annotations

from types import ModuleType

from torch import nn

from gridtrain.parallel.mode import ParallelMode
from gridtrain.parallel.tensor.coverage import better_layout
from gridtrain.parallel.tensor.dropout import dropout_factory
from gridtrain.parallel.tensor.flow_rules import check_columns, column_style
from gridtrain.parallel.tensor.grad_summed import GradSummed
from gridtrain.parallel.tensor.modes import names_where
from gridtrain.parallel.tensor.norm import weightless_norm
from gridtrain.parallel.tensor.plan import Plan, PlanError
from gridtrain.parallel.tensor.spec import LayerTable, TensorMode
from gridtrain.parallel.tensor.style import (
    ATTENTION,
    AUTO,
    COLWISE,
    COLWISE_GATHER_OUTPUT,
    DROPOUT,
    EMBEDDING,
    EMBEDDING_COLWISE,
    EMBEDDING_ROWWISE,
    GATHER_OUTPUT,
    GRAD_SUMMED,
    HEADS,
    LINEAR,
    NORM,
    NORM_STYLE,
    OPAQUE,
    PACKED_COLWISE,
    PATCH,
    REPLICATE,
    ROWWISE,
    ROWWISE_SPLIT_INPUT,
    VOCAB_PARALLEL,
    WHOLE,
    of,
)
from gridtrain.parallel.tensor.trace import Flow

TIE_ALTERNATIVES = (GATHER_OUTPUT, VOCAB_PARALLEL)
_INNER = (AUTO, COLWISE, ROWWISE, PACKED_COLWISE, ROWWISE_SPLIT_INPUT)  # -> the mode's Linear
_DEFAULTS = {
    EMBEDDING: EMBEDDING_COLWISE.name,
    NORM: NORM_STYLE.name,
    PATCH: COLWISE.name,
    DROPOUT: REPLICATE.name,
    ATTENTION: HEADS.name,
}


def layer_table(*modules: ModuleType) -> LayerTable:
    """Every Linear is the mode's ``Linear``, a head its ``Classifier`` (logits gathered) or
    ``VocabParallelClassifier`` (logits split over the classes); each class is taken by its
    name from the first of the mode's layer ``modules`` that defines it."""

    def cls(name: str) -> type:
        return next(getattr(m, name) for m in modules if hasattr(m, name))

    table: LayerTable = {(LINEAR, s): (cls("Linear"), {}) for s in _INNER}
    table[(LINEAR, GATHER_OUTPUT)] = (cls("Classifier"), {})
    table[(LINEAR, COLWISE_GATHER_OUTPUT)] = (cls("Classifier"), {})
    table[(LINEAR, VOCAB_PARALLEL)] = (cls("VocabParallelClassifier"), {})
    table[(EMBEDDING, EMBEDDING_ROWWISE)] = (cls("VocabParallelEmbedding"), {})
    table[(EMBEDDING, EMBEDDING_COLWISE)] = (cls("Embedding"), {})
    table[(EMBEDDING, COLWISE)] = (cls("Embedding"), {})
    table[(NORM, NORM_STYLE)] = (cls("Norm"), {})
    table[(NORM, GRAD_SUMMED)] = (GradSummed, {})  # a per-head norm: its input's last dim whole
    table[(PATCH, COLWISE)] = (cls("PatchEmbedding"), {})
    table[(DROPOUT, REPLICATE)] = (dropout_factory(ParallelMode.TENSOR), {})
    table[(ATTENTION, HEADS)] = (cls("MultiheadAttention"), {})
    return table


def infer_styles(kinds, given, flow: Flow | None, modules=None, n: int = 0):
    """Every layer's style and origin: given styles a blocked layer can take, the mode's
    Linear for every other Linear (packed where the model cuts its output into equal
    blocks), its classifier for a model output, defaults elsewhere. A model plan's gathered
    Linear that is no model output (OLMo2's q/k/v under 1d) is the mode's Linear here where a
    column split fits its output: every activation is blocked, and what reads it (a norm
    over q) expects it so. A model plan's embedding split (Cohere's ``embedding_rowwise``)
    is 1d's: here the default, so a tied head keeps its logits whole."""
    styles, origin = {}, {}
    heads = flow.output_sources if flow else set()
    for name, kind in kinds.items():
        model_vocab = kind == EMBEDDING and given.get(name, ("", ""))[1] == "model plan"
        if model_vocab:  # a model plan's vocabulary split would split the tied head's logits
            styles[name], origin[name] = _DEFAULTS[kind], "default (model plan's split is 1d's)"
        elif name in given and (kind != LINEAR or _kept(name, given[name], heads, flow, modules)):
            styles[name], origin[name] = given[name]
        elif kind == LINEAR:
            styles[name] = (GATHER_OUTPUT if name in heads else AUTO).name
            origin[name] = "traced: a model output" if name in heads else "every Linear"
            if name in given:
                origin[name] = f"{given[name][1]} {given[name][0]}, no model output: the grid's"
            if name not in heads:
                styles[name] = column_style(name, flow, modules, AUTO.name) or AUTO.name
        elif kind == OPAQUE:
            raise PlanError(f"'{name}' ({kind}) cannot run on 2d/2.5d/3d blocked activations")
        else:
            styles[name], origin[name] = _DEFAULTS[kind], "default"
    check_columns(styles, kinds, flow, modules, tuple(s.name for s in _INNER))
    return styles, origin


def _kept(name: str, given: tuple[str, str], heads, flow: Flow | None, modules) -> bool:
    """Whether a given Linear style stays (see ``infer_styles``): a model plan's gathered
    Linear that is no model output stays gathered only where no column split fits how the
    model cuts its output (Phi-3's grouped-query ``qkv_proj``)."""
    style, origin = of(given[0]), given[1]
    if style.logits == WHOLE and origin == "model plan" and name not in heads:
        return column_style(name, flow, modules, AUTO.name) is None
    return style.logits is not None or style.packed  # a head, or packed blocks


def needs_flow(kinds: dict, given: dict) -> bool:
    """Heads (and 3d's orientations) are read off the flow, so it is always needed."""
    return True


def splits_output(kind: str, style: str) -> bool:
    """Every output keeps its hidden dim blocked, except gathered logits."""
    return not (kind == LINEAR and of(style).logits == WHOLE)


def splits_input(kind: str, style: str) -> bool | None:
    """A norm reads blocked activations (a per-head norm its last dim whole); a Linear takes
    them blocked or whole (it cuts a whole input itself: None)."""
    if kind == NORM:
        return style != GRAD_SUMMED.name
    return None if kind == LINEAR else False


def check_all_params_planned(plan: Plan, model: nn.Module) -> None:
    """Every parameter must belong to a layer the mode replaces (module docstring)."""
    covered = {
        id(p)
        for name, e in plan.entries.items()
        if e.layer
        for p in model.get_submodule(name).parameters()
    }
    _check_weightless_norms(plan, model)
    params = dict(model.named_parameters())
    loose = [n for n, p in params.items() if id(p) not in covered]
    if loose:
        more = f" ... and {len(loose) - 8} more" if len(loose) > 8 else ""
        raise PlanError(
            f"tensor mode {plan.mode!r} blocks every activation over the grid, so every parameter "
            f"must belong to a layer gridtrain shards (Linear, Embedding, a norm, "
            f"nn.MultiheadAttention, gt.nn.PatchEmbedding); these do not: "
            f"{', '.join(loose[:8])}{more}. {_advice(model, params, loose)}"
        )


def _check_weightless_norms(plan: Plan, model: nn.Module) -> None:
    """A module normalising over the last dim with no weight and no width the planner can read
    (``norm.weightless_norm``) would normalise each rank's block of the hidden dim alone."""
    for name, module in model.named_modules():
        if name not in plan.entries and weightless_norm(module):
            raise PlanError(
                f"'{name}' ({type(module).__name__}) normalises over the last dim with no weight "
                f"and no normalized_shape, so gridtrain cannot tell its width; under tensor mode "
                f"{plan.mode!r} each rank holds a block of the hidden dim and it would normalise "
                f"each block alone: use tensor mode {names_where(lambda g: not g.blocked)}, or "
                "give it a normalized_shape"
            )


def _advice(model: nn.Module, params: dict, loose: list[str]) -> str:
    """Where few parameters are loose (a ViT's patch convolution, class token and position
    embedding, used by the model's own code), the modes that keep them whole; else the
    layout that suits a model of mostly other layers."""
    if 2 * sum(params[n].numel() for n in loose) >= sum(p.numel() for p in params.values()):
        return better_layout(model, sentence=True)
    return (
        "They are a small part of the model, used by its own code on whole activations: "
        f"tensor mode {names_where(lambda g: not g.blocked)} (which keeps them whole on every "
        "rank) runs it"
    )


def blocked_mode(geometry, split_batch, loss, accuracy, **parts) -> TensorMode:
    """A blocked mode's spec: ``TensorMode``'s first four fields, these shared parts, and
    ``parts``, what else is the mode's own (layers, entry options...)."""
    return TensorMode(
        geometry,
        split_batch,
        loss,
        accuracy,
        infer_styles=infer_styles,
        needs_flow=needs_flow,
        check=check_all_params_planned,
        tie_alternatives=TIE_ALTERNATIVES,
        splits_output=splits_output,
        splits_input=splits_input,
        splits_weights=True,
        **parts,
    )
