"""The model's forward on this rank's activation shapes, on meta: the planner's last check.

A plain model's own code sees the activations each rank holds: under 2d, 2.5d and
3d every hidden dim arrives split over the grid, under 1d a column-parallel
projection's output holds ``heads / n`` heads. Code that takes a shape from an
activation (``head_dim = x.shape[-1] // heads``) then computes something else on
each rank, silently; code that fixes the head count dies inside the first step.

``check_local_shapes`` runs the user's forward once more on the meta device, each
layer the plan replaces stood in by a shape-only function that returns what this
rank's layer would (the same leading dims, the last dim this rank keeps; no
collectives), on this rank's part of the batch (``split_batch``). It records what
reaches ``scaled_dot_product_attention`` and requires each call's head size to
equal the dense trace's (``Flow.attention``). A failing or differing forward gets a
``PlanError`` naming the module: the head count the tensor size cannot split (in
``gridtrain estimate``'s words), or how to take shapes from the model's configuration.

Under sequence parallelism the forward runs on this rank's block of positions inside the
mode's forward context (``SequenceAttention``): an attention call ring attention cannot
compute as the dense model would (an arbitrary ``attn_mask``, ``nn.MultiheadAttention``)
gets a ``PlanError`` naming the module and the argument before training.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import Tensor, nn
from torch.utils._pytree import tree_map

from gridtrain.parallel.context import ParallelContext
from gridtrain.parallel.mode import ParallelMode
from gridtrain.parallel.tensor.base import linear_dims
from gridtrain.parallel.tensor.entry_input import infer_example
from gridtrain.parallel.tensor.norm import norm_kind
from gridtrain.parallel.tensor.plan import (
    ATTENTION,
    DROPOUT,
    LINEAR,
    NORM,
    OPAQUE,
    Plan,
    PlanError,
)
from gridtrain.parallel.tensor.registry import mode_spec, split_batch
from gridtrain.parallel.tensor.sequence import SequenceAttentionError
from gridtrain.parallel.tensor.spec import TensorMode
from gridtrain.parallel.tensor.trace import (
    AttentionCall,
    AttentionRecorder,
    Flow,
    ModuleTrail,
    first_input_shape,
    run_on_meta,
)

FIX = (
    "take shapes from the model's configuration, not from activations "
    "(head_dim = hidden // heads, then view(batch, seq, -1, head_dim): -1 is this rank's heads)"
)


def check_local_shapes(
    model: nn.Module,
    example: Any,
    plan: Plan,
    flow: Flow | None,
    ctx: ParallelContext,
    attention_replaced: bool = False,
) -> None:
    """Raise ``PlanError`` when ``model``'s forward fails, or reaches attention with another
    head size, on this rank's shapes under ``plan`` (module docstring); under a mode with a
    forward context, when an attention call is one that context refuses."""
    spec = mode_spec(plan.mode)
    # an adapter that replaces the model's attention under the mode (HF: ring attention)
    # checks its own calls at initialize; the model's original attention is not what runs
    if spec.wraps_forward and not attention_replaced:
        check_routed_attention(model, example, spec, ctx, attention_stand_ins(model, plan, ctx))
    if not spec.splits_weights or flow is None:  # activations keep their dense widths
        return
    split, what = spec.head_split(plan.size, ctx.config.parallel.tensor.depth)
    local = _local_example(example, ctx)
    if local is None:  # a batch the mode cannot split: the engine will say so at the step
        return
    recorder = AttentionRecorder(model)
    try:
        with ModuleTrail(model) as trail:
            stand_ins = _stand_ins(model, plan, spec, split, ctx, what)
            run_on_meta(model, local, stand_ins, (recorder,))
    except PlanError:  # a layer's own refusal (an MHA argument it does not compute)
        raise
    except Exception as err:  # noqa: BLE001 - the model's own error, explained
        raise _heads_error(flow.attention, split, what) or PlanError(
            f"tensor mode {plan.mode!r}: {type(model).__name__}'s forward fails in "
            f"{trail.where()} on this rank's activations, whose hidden dims arrive split over "
            f"{what} ({type(err).__name__}: {str(err).splitlines()[0][:300]}); {FIX}"
            f"{_styles_inside(plan, trail.innermost())}"
        ) from None
    if len(recorder.calls) != len(flow.attention):
        return  # data-dependent control flow: the calls cannot be paired
    for dense, here in zip(flow.attention, recorder.calls, strict=True):
        if dense.q[-1:] != here.q[-1:]:
            raise _heads_error(flow.attention, split, what) or PlanError(
                f"'{here.module}' calls scaled_dot_product_attention with head size "
                f"{here.q[-1]} on this rank under tensor mode {plan.mode!r}, {dense.q[-1]} in "
                f"the dense model: its shapes come from activations, whose hidden dim arrives "
                f"split over {what}; {FIX}"
            )


def check_routed_attention(
    model: nn.Module,
    example: Any,
    spec: TensorMode,
    ctx: ParallelContext,
    forwards: dict[str, Callable] | None = None,
) -> None:
    """Run ``model`` on meta on this rank's shapes under ``spec.forward_mode`` (sequence: SDPA
    as ring attention) and raise ``PlanError`` naming the module whose attention call the
    mode refuses (``SequenceAttentionError``). Skipped where no input can be had; a forward
    that fails on meta for another reason is left to the first step."""
    if example is None:
        try:
            example = infer_example(model, "the attention check")
        except PlanError:
            return
    local = _local_example(example, ctx)
    if local is None:
        return
    recorder = AttentionRecorder(model)  # entered last, so it sees each call first
    try:
        run_on_meta(model, local, forwards, modes=(spec.forward_mode(ctx), recorder))
    except PlanError:  # a layer's own refusal (an MHA argument ring attention lacks)
        raise
    except SequenceAttentionError as err:
        sdpa = err.function == "scaled_dot_product_attention" and recorder.calls
        where = (recorder.calls[-1].module if sdpa else _attention_module(model)) or type(
            model
        ).__name__
        raise PlanError(f"'{where}' under tensor mode {spec.name!r}: {err}") from None
    except Exception:  # noqa: BLE001 - not an attention call: the first step will say
        return


def _attention_module(model: nn.Module) -> str:
    """The first ``nn.MultiheadAttention`` of ``model`` (the other call the mode refuses)."""
    names = [n for n, m in model.named_modules() if isinstance(m, nn.MultiheadAttention)]
    return names[0] if names else type(model).__name__


def _styles_inside(plan: Plan, path: str) -> str:
    """The styles the plan gives the split layers inside ``path`` and where each came from:
    what a user overrides in ``parallel.tensor.plan`` when the module cannot take them."""
    inside = [
        f"{name}: {e.style} ({e.origin})"
        for name, e in plan.entries.items()
        if e.layer and (not path or name.startswith(path + "."))
    ]
    if not inside:
        return ""
    return (
        f"; or give these layers other styles (e.g. 'replicate') in parallel.tensor.plan: "
        f"{inside[:6]}{' ...' if len(inside) > 6 else ''}"
    )


def _heads_error(calls: list[AttentionCall], split: int, what: str) -> PlanError | None:
    """A head count (query or key/value) that ``split`` does not divide, if any."""
    for call in calls:
        for label, shape in (("heads", call.q), ("key/value heads", call.k)):
            n = shape[-3] if len(shape) >= 3 else 1
            if n % split:
                return PlanError(
                    f"'{call.module}': {n} attention {label} do not split over {what}: "
                    f"{n} % {split} != 0 (choose a tensor size that divides the head count)"
                )
    return None


def _local_example(example: Any, ctx: ParallelContext) -> Any:
    """This rank's part of ``example`` on meta (rows repeated first where the batch does not
    divide: only shapes matter here); None when a tensor cannot be split at all."""

    def cut(t: Tensor) -> Tensor:
        t = t.to("meta")
        try:
            return split_batch(t, ctx)
        except ValueError:
            if t.dim() == 0:
                raise
            rows = ctx.world_size(ParallelMode.TENSOR)  # a multiple of every mode's batch blocks
            return split_batch(t.repeat(rows, *[1] * (t.dim() - 1)), ctx)

    try:
        return tree_map(lambda t: cut(t) if isinstance(t, Tensor) else t, example)
    except ValueError:
        return None


def _stand_ins(
    model: nn.Module, plan: Plan, spec: TensorMode, split: int, ctx: ParallelContext, what: str
) -> dict[str, Callable]:
    """Module path -> shape-only forward, for every layer the plan replaces (or keeps opaque);
    a replaced Linear or norm first checks the width of what reaches it (``_in_width``)."""
    out: dict[str, Callable] = attention_stand_ins(model, plan, ctx)
    for name, entry in plan.entries.items():
        if name in out:
            continue
        forward = None
        if entry.kind == OPAQUE or (entry.layer and entry.kind in (NORM, DROPOUT)):
            forward = first_input_shape
        elif entry.layer:  # a Linear, an embedding or a patch embedding
            module = model.get_submodule(name)
            width = _out_width(module)
            if spec.splits_output(entry.kind, entry.style):
                width //= split
            forward = _resized(module, entry.kind, width)
        if forward is None:
            continue
        width = _in_width(model.get_submodule(name), entry, spec, split)
        out[name] = (
            forward if width is None else _checked(forward, name, entry, width, what, plan.mode)
        )
    return out


def _in_width(module: nn.Module, entry, spec: TensorMode, split: int) -> set[int] | None:
    """The last dims this rank's replacement of a Linear or norm takes (None: not checked)."""
    if not entry.layer or entry.kind not in (LINEAR, NORM):
        return None
    if entry.kind == LINEAR:
        width = linear_dims(module)[0]
    else:
        kind = norm_kind(module)
        if kind is None:
            return None
        width = kind.hidden
    split_in = spec.splits_input(entry.kind, entry.style)
    return (
        {width // split} if split_in else {width} if split_in is False else {width, width // split}
    )


def _checked(forward: Callable, name: str, entry, widths: set[int], what: str, mode: str):
    """``forward``, refusing by name an input whose last dim is none of ``widths``: the layer
    that feeds it leaves its output split where this one needs it whole, or the reverse."""

    def checked(x: Tensor, *args, **kwargs):
        if isinstance(x, Tensor) and x.dim() and x.shape[-1] not in widths:
            split = "split over " + what if x.shape[-1] < max(widths) else "whole"
            raise PlanError(
                f"'{name}' ({entry.kind}, style {entry.style!r}) takes inputs whose last dim is "
                f"{' or '.join(map(str, sorted(widths)))} on this rank under tensor mode "
                f"{mode!r}, but gets {x.shape[-1]}: what feeds it arrives {split}; give it and "
                "the layers before it matching styles in parallel.tensor.plan"
            )
        return forward(x, *args, **kwargs)

    return checked


def _out_width(module: nn.Module) -> int:
    if isinstance(module, nn.Embedding):
        return module.embedding_dim
    if hasattr(module, "embed_size"):  # gt.nn.PatchEmbedding
        return module.embed_size
    return linear_dims(module)[1]


def _resized(module: nn.Module, kind: str, width: int) -> Callable:
    """A forward giving the dense layer's output shape with the last dim ``width``; the dense
    forward runs (on meta) on a full-width input, as this rank's may arrive split."""
    dense_forward = type(module).forward
    in_features = linear_dims(module)[0] if kind == LINEAR else None

    def forward(x: Tensor, *args, **kwargs) -> Tensor:
        if in_features is not None:
            x = x.new_empty(*x.shape[:-1], in_features)
        y = dense_forward(module, x, *args, **kwargs)
        return y.new_empty(*y.shape[:-1], width)

    return forward


def attention_stand_ins(model: nn.Module, plan: Plan, ctx: ParallelContext) -> dict[str, Callable]:
    """The mode's MHA layer of every replaced ``nn.MultiheadAttention``, built on meta: its
    forward checks the call as the real one does and returns this rank's shapes; a refusal
    names the module."""
    from gridtrain.parallel.tensor.parallelize import meta_twin  # which imports this module

    spec, out = mode_spec(plan.mode), {}
    for name, entry in plan.entries.items():
        if entry.kind != ATTENTION or not entry.layer:
            continue
        factory, options = spec.layer_for(name, entry.kind, entry.style, entry.options)
        out[name] = _named(name, factory(meta_twin(model.get_submodule(name)), ctx, **options))
    return out


def _named(name: str, layer: nn.Module) -> Callable:
    def forward(*args, **kwargs):
        try:
            return layer(*args, **kwargs)
        except PlanError as err:
            raise PlanError(f"'{name}': {err}") from None

    return forward
