"""Make the plan for a model and apply it: each planned layer replaced, in place, by its mode's
sharded layer, under the same module path (so state dict keys stay the dense ones).

``build_plan`` decides everything and checks it on meta copies of the layers
(divisibility, ties, the data flow) and on the model's forward run with this
rank's shapes (``local_shapes.py``) before a single weight moves;
``apply_plan`` then builds each sharded layer from the dense one's current
weights and returns the old -> new parameter map the optimizer is rebound with.
"""

from __future__ import annotations

import copy
import logging
from contextlib import nullcontext
from typing import Any

import torch
from torch import nn

from gridtrain.parallel.context import ParallelContext
from gridtrain.parallel.mode import ParallelMode
from gridtrain.parallel.tags import get_shard_spec
from gridtrain.parallel.tensor.base import ShardedModule, describe_spec, linear_dims
from gridtrain.parallel.tensor.coverage import count_sharded
from gridtrain.parallel.tensor.entry_input import infer_example
from gridtrain.parallel.tensor.flow_rules import (
    check_loose_params,
    head_norms,
    loose_modules,
    packed_blocks,
)
from gridtrain.parallel.tensor.local_shapes import check_local_shapes
from gridtrain.parallel.tensor.norm import norm_offset
from gridtrain.parallel.tensor.plan import (
    LINEAR,
    NORM,
    TRACE_HOW,
    ModelAdapter,
    Plan,
    PlanEntry,
    PlanError,
    layout_of,
    match_patterns,
    tracked_modules,
)
from gridtrain.parallel.tensor.registry import mode_spec
from gridtrain.parallel.tensor.spec import TensorMode
from gridtrain.parallel.tensor.style import GRAD_SUMMED, SPLIT, STYLES, of, styles_for
from gridtrain.parallel.tensor.trace import Flow, trace_flow

logger = logging.getLogger("gridtrain")

HINT_ATTR = "gt_style"  # gt.nn layers carry their hinted style here


OWN_PLAN_ATTR = "gt_tp_plan"  # a model's own plan (full module paths), where no adapter gives it


def model_plan(model: nn.Module) -> dict[str, str]:
    """The model's own plan (``OWN_PLAN_ATTR``), if any; a library's adapter gives its models'
    (``ModelAdapter.plan_model``: Hugging Face's ``_tp_plan``)."""
    plan = getattr(model, OWN_PLAN_ATTR, None)
    return dict(plan) if isinstance(plan, dict) else {}


def meta_twin(module: nn.Module) -> nn.Module:
    """A copy of ``module`` whose parameters and buffers are meta tensors (no weights copied)."""
    memo: dict[int, Any] = {}
    for t in [*module.parameters(recurse=False), *module.buffers(recurse=False)]:
        meta = torch.empty_like(t, device="meta")
        memo[id(t)] = nn.Parameter(meta, t.requires_grad) if isinstance(t, nn.Parameter) else meta
    return copy.deepcopy(module, memo)


def build_plan(
    model: nn.Module, ctx: ParallelContext, example: Any = None, adapter: ModelAdapter | None = None
) -> Plan:
    """The plan of ``model`` under ``ctx``'s layout (see ``plan.py``); raises ``PlanError``.

    ``example`` (one batch of the model's input) drives the meta trace; None builds one
    from the model's entry layer (``entry_input.py``). ``adapter``: the model's library
    adapter (``gridtrain.adapters.adapter_for``), which gives its plan and checks its heads.
    """
    spec, n = mode_spec(ctx.tensor_mode), ctx.world_size(ParallelMode.TENSOR)
    plan = Plan(spec.name, n, layout=layout_of(ctx))
    if spec.name is None:  # no tensor mode: nothing to plan
        count_sharded(plan, model)
        return plan
    own_plan = model_plan(model)
    if adapter is not None:  # e.g. Hugging Face: gridtrain's plan for GPT-2, head checks
        own_plan, example = adapter.plan_model(model, ctx, example)
    kinds = tracked_modules(model)
    modules = dict(model.named_modules())
    source = getattr(adapter, "own_plan_name", OWN_PLAN_ATTR)  # the name messages give it
    given = _given_styles(model, ctx, kinds, modules, own_plan, source)
    flow, example = _trace(model, spec, kinds, given, example)
    given.update(head_norms(kinds, given, flow, modules))
    styles, origin = spec.infer_styles(kinds, given, flow, modules, n)
    _add_entries(plan, spec, kinds, styles, origin, flow, modules)
    _dry_run(plan, modules, ctx, spec)
    _resolve_ties(plan, modules, ctx, spec)
    if flow is not None:
        plan.heads = {
            m: (linear_dims(modules[m])[1], of(plan[m].style).logits == SPLIT)
            for m in flow.order
            if kinds.get(m) == LINEAR and m in flow.output_sources
        }
    spec.check(plan, model)
    check_loose_params(kinds, {m: e.style for m, e in plan.entries.items()}, flow, modules, spec)
    count_sharded(plan, model)
    with adapter.local_view(model, plan, ctx) if adapter is not None else nullcontext():
        check_local_shapes(model, example, plan, flow, ctx, attention_replaced=adapter is not None)
    return plan


def _trace(model, spec: TensorMode, kinds, given, example) -> tuple[Flow | None, Any]:
    """The model's data flow (None where the mode never traces, or where nothing needs it
    and no input can be built) and the example it was traced on."""
    if not spec.splits_weights:  # weights whole: nothing is planned from the flow
        return None, example
    if example is None:  # a given plan is checked against the flow too
        example = _entry_example(model, spec.name, spec.needs_flow(kinds, given))
    if example is None:
        return None, None
    how = {m: TRACE_HOW[k] for m, k in kinds.items()}
    try:
        return trace_flow(model, example, how, loose_modules(model, kinds)), example
    except RuntimeError as err:  # the planner cannot plan what it cannot trace: a refusal
        raise PlanError(str(err)) from err.__cause__


def _entry_example(model: nn.Module, mode: str, needed: bool) -> Any:
    """An input built from ``model``'s entry layer; None when the plan needs no trace and
    none can be built (the trace then only checks a plan given in full)."""
    why = (
        f"tensor mode {mode!r}: gridtrain traces the model's data flow on the meta device to "
        "pick each layer's split"
    )
    try:
        return infer_example(model, why)
    except PlanError:
        if needed:
            raise
        return None


def _given_styles(model, ctx, kinds, modules, own_plan, own_name) -> dict[str, tuple[str, str]]:
    """Module -> (style, origin) from the config's plan, ``gt.nn`` hints and the model's plan."""
    names = list(kinds)
    given: dict[str, tuple[str, str]] = {}
    cfg_plan = getattr(ctx.config.parallel.tensor, "plan", None) or {}
    for name, style in match_patterns(cfg_plan, names, "parallel.tensor.plan", True).items():
        given[name] = (style, "config")
    for name in names:
        hint = getattr(modules[name], HINT_ATTR, None)
        if hint is not None and name not in given:
            given[name] = (hint, "hint")
    source = f"{type(model).__name__}.{own_name}"
    own = match_patterns(own_plan, names, source, strict=False, known=False)
    for name, style in own.items():  # entry by entry: the config's entries win
        if name in given:
            continue
        if style not in STYLES:
            raise PlanError(
                f"{source}: '{name}' has style '{style}', which gridtrain does not implement; "
                f"give '{name}' a style in parallel.tensor.plan (allowed: {', '.join(STYLES)})"
            )
        given[name] = (style, "model plan")
    _check_kinds(given, kinds)
    return given


def _add_entries(plan: Plan, spec: TensorMode, kinds, styles, origin, flow, modules) -> None:
    """One ``PlanEntry`` per tracked layer, with the options its mode's layer takes."""
    extra = spec.entry_options(kinds, styles, flow)
    for name, kind in kinds.items():
        options: dict[str, Any] = {}
        style = styles[name]
        if of(style).packed:
            options["packed"] = _packed_blocks(name, modules[name], flow)
        if kind == NORM and style != GRAD_SUMMED.name and spec.layer_for(name, kind, style, {})[0]:
            options.update(_norm_options(name, modules[name]))
        options.update(extra.get(name, {}))
        plan.entries[name] = PlanEntry(name, kind, style, origin[name], options)


def find_heads(model: nn.Module, example: Any) -> dict[str, tuple[int, bool]]:
    """Linears whose output is a model output: name -> (vocab, vocab-split logits).

    Traced here (Linears only) on ``example``, else on an input built from the model's
    entry layer."""
    kinds = {n: k for n, k in tracked_modules(model).items() if k == LINEAR}
    if example is None:
        example = infer_example(model, "chunked_loss needs to find the model's head")
    flow = trace_flow(model, example, {m: TRACE_HOW[k] for m, k in kinds.items()})
    modules = dict(model.named_modules())
    return {m: (linear_dims(modules[m])[1], False) for m in flow.order if m in flow.output_sources}


def _check_kinds(given: dict[str, tuple[str, str]], kinds: dict[str, str]) -> None:
    for name, (style, origin) in given.items():
        allowed = styles_for(kinds[name])
        if style not in allowed:
            raise PlanError(
                f"{origin}: '{name}' is a {kinds[name]} layer; style '{style}' does not apply "
                f"(allowed: {', '.join(allowed)})"
            )


def _norm_options(name: str, module: nn.Module) -> dict[str, Any]:
    """``offset=1`` for a norm scaling by ``1 + weight`` (``norm.norm_offset``); a norm of
    neither form is refused by name, since the mode's norm would compute another function."""
    try:
        offset = norm_offset(module)
    except ValueError as err:
        raise PlanError(f"'{name}': {err}") from None
    return {"offset": offset} if offset else {}


def _packed_blocks(name: str, module: nn.Module, flow: Flow | None) -> int:
    """The packed blocks of ``name``: its ``gt_packed`` hint, else the equal blocks the model
    cuts its output into (the trace), else out_features / in_features."""
    hinted = getattr(module, "gt_packed", None) or packed_blocks(name, flow, {name: module})
    if hinted:
        return int(hinted)
    in_f, out_f, _ = linear_dims(module)
    if out_f % in_f or out_f // in_f < 2:
        raise PlanError(
            f"'{name}': packed_colwise needs the number of packed blocks; out_features "
            f"{out_f} is not a multiple of in_features {in_f} (set module.gt_packed = k)"
        )
    return out_f // in_f


def _dry_run(
    plan: Plan, modules: dict[str, nn.Module], ctx: ParallelContext, spec: TensorMode
) -> None:
    """Build every sharded layer from a meta copy: checks divisibility, records shard shapes."""
    for name, entry in plan.entries.items():
        factory, options = spec.layer_for(name, entry.kind, entry.style, entry.options)
        entry.shards, entry.specs, entry.layer = {}, {}, ""
        if factory is None:
            continue
        try:
            layer = factory(meta_twin(modules[name]), ctx, **options)
        except (ValueError, TypeError) as err:
            raise PlanError(f"'{name}' as {entry.style}: {err}") from None
        entry.layer = type(layer).__name__
        dense = dict(modules[name].named_parameters())  # a layer's own children too (out_proj)
        for pname, p in layer.named_parameters():
            if pname in dense:
                entry.shards[pname] = (tuple(dense[pname].shape), tuple(p.shape))
        entry.specs = {n: get_shard_spec(p) for n, p in layer.named_parameters()}


def _resolve_ties(plan: Plan, modules, ctx: ParallelContext, spec: TensorMode) -> None:
    """Weights shared by two planned layers must be cut the same way in both."""
    users: dict[int, list[tuple[str, str]]] = {}
    for name in plan.entries:
        for pname, p in modules[name].named_parameters(recurse=False):
            users.setdefault(id(p), []).append((name, pname))
    for shared in users.values():
        if len(shared) < 2:
            continue
        first, first_p = shared[0]
        want = plan[first].specs.get(first_p, ())
        for name, pname in shared[1:]:
            entry = plan[name]
            if entry.specs.get(pname, ()) == want:
                continue
            if entry.origin in ("config", "hint") or entry.kind != LINEAR:
                raise PlanError(_tie_error(plan, first, first_p, name, pname, want))
            for style in spec.tie_alternatives:
                entry.style, entry.origin = style.name, f"tied to {first}.{first_p}"
                _dry_run(Plan(plan.mode, plan.size, {name: entry}), modules, ctx, spec)
                if entry.specs.get(pname, ()) == want:
                    break
            else:
                raise PlanError(_tie_error(plan, first, first_p, name, pname, want))


def _tie_error(plan, first, first_p, name, pname, want) -> str:
    return (
        f"'{name}.{pname}' is tied to '{first}.{first_p}', which is split "
        f"{describe_spec(want)} as {plan[first].style}; no style of '{name}' cuts it the "
        "same way: choose matching styles in parallel.tensor.plan"
    )


def _follow_aliases(model: nn.Module, new_of: dict, replaced: dict) -> None:
    """Every other module attribute that held a replaced parameter (BERT's
    ``cls.predictions.bias``, tied by HF to the decoder's bias) now holds its replacement, so
    the model, its state dict and its checkpoints see one tensor, as in the dense model."""
    for module in model.modules():
        for pname, p in list(module._parameters.items()):
            if p is not None and replaced.get(id(p)) is p:
                module._parameters[pname] = new_of[id(p)]


def apply_plan(
    model: nn.Module, plan: Plan, ctx: ParallelContext, adapter: ModelAdapter | None = None
) -> dict[int, nn.Parameter]:
    """Replace every planned layer of ``model`` in place; returns id(old param) -> new param.

    ``adapter``: the model's library adapter, as given to ``build_plan``."""
    spec = mode_spec(ctx.tensor_mode)
    new_of: dict[int, nn.Parameter] = {}
    replaced: dict[int, nn.Parameter] = {}  # the old parameters, alive while ids are compared
    built: list[ShardedModule] = []
    for name, entry in plan.entries.items():
        factory, options = spec.layer_for(name, entry.kind, entry.style, entry.options)
        if factory is None:
            continue
        dense = model.get_submodule(name)
        old = dict(dense.named_parameters())  # a layer's own children too (out_proj)
        layer = factory(dense, ctx, **options)
        for pname, p in old.items():
            if id(p) in new_of:
                layer.tie(pname, new_of[id(p)])
            elif _param(layer, pname) is not None:
                new_of[id(p)], replaced[id(p)] = _param(layer, pname), p
        model.set_submodule(name, layer)
        if isinstance(layer, ShardedModule):
            built.append(layer)
    _follow_aliases(model, new_of, replaced)
    for layer in built:
        layer.release_dense()
    if adapter is not None:  # runtime fixes the model's own code needs (local head counts...)
        adapter.after_apply(model, plan, ctx)
    logger.info("tensor plan applied: %d layers replaced", len(built))
    return new_of


def _param(layer: nn.Module, name: str) -> nn.Parameter | None:
    """``layer``'s parameter at the dotted path ``name`` (None where there is none)."""
    owner, _, leaf = name.rpartition(".")
    try:
        return getattr(layer.get_submodule(owner), leaf, None)
    except AttributeError:
        return None
