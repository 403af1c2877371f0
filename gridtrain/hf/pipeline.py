"""A Hugging Face causal LM under pipeline parallelism: every stage runs the model's own forward.

The cut points come from ``transformers``' pipeline plan (``_pp_plan``: the base model's
``base_model_pp_plan`` prefixed, plus ``lm_head``: Llama, Qwen2, Gemma2, Granite,
Cohere...): ``model.embed_tokens``, every ``model.layers.i``, ``model.norm``, ``lm_head``.
A family registered in ``families/`` may give its own (GPT-2 has none: ``families/gpt2.py``
holds gridtrain's, in the same form). The plan
becomes a ``ModelCut`` (``parallel.pipeline.model_stage``): each stage keeps the model with
the units other stages hold replaced by stand-ins and runs ``model.forward`` on every
micro-batch, so what the family does around its layers (scaled or multiplied embeddings,
soft-capped or scaled logits, final norms, rotary tables, masks) runs, by the model's own
code, on the stage that owns it. A stage never begins at a unit given token ids (GPT-2's
position embedding), only at one given the hidden states.

A dict batch may hold ``input_ids``, ``attention_mask``, ``position_ids`` and
``token_type_ids`` (those the model's forward takes) and ``labels`` (the criterion's): every
stage's forward gets the micro-batch again, so the padding mask and positions reach every
stage; one tensor, the hidden states, crosses each cut. Stages call the forward with
``use_cache=False`` (training keeps no key/value cache). The last stage returns the model's
output object (``CausalLMOutputWithPast``), so the loss reads ``out.logits`` as without a
pipeline.
"""

from __future__ import annotations

import inspect

from torch import nn

from gridtrain.hf.families import family_of
from gridtrain.hf.patches import give_reset_parameters
from gridtrain.hf.plans import base_prefix
from gridtrain.parallel.pipeline.model_stage import ModelCut, StageUnit
from gridtrain.parallel.tensor.plan import PlanError

# the batch keys a stage's forward may be given, where the model's forward takes them
BATCH_KEYS = ("input_ids", "attention_mask", "position_ids", "token_type_ids")


def pipeline_layers(model: nn.Module) -> ModelCut:
    """The model's units in execution order (its pipeline plan), and the batch keys every
    stage's forward takes; a ``PlanError`` for a model no plan covers."""
    cfg = model.config
    if not cfg.architectures:
        cfg.architectures = [type(model).__name__]
    give_reset_parameters(model)  # gt.lazy_init: each stage re-initialises what it keeps
    units: list[StageUnit] = []
    for path, (inputs, _) in _pipeline_plan(model).items():
        module = model.get_submodule(path)
        cut_before = not inputs[0].endswith("_ids")  # a lookup of token ids starts no stage
        if isinstance(module, nn.ModuleList):
            units += [
                StageUnit(f"{path}.{i}", m, cut_before, inputs[0]) for i, m in enumerate(module)
            ]
        else:
            units.append(StageUnit(path, module, cut_before, inputs[0]))
    params = _forward_parameters(model)
    keys = tuple(k for k in BATCH_KEYS if k in params)
    call = {"use_cache": False} if "use_cache" in params else {}
    return ModelCut(tuple(units), keys, call)


def _pipeline_plan(model: nn.Module) -> dict[str, tuple[list[str], list[str]]]:
    """Module path -> (inputs, outputs), base model first: ``_pp_plan`` lists ``lm_head``
    before the base model's units; the base model's keep their order."""
    hook = family_of(model).pipeline_plan
    own = hook(model) if hook is not None else None
    if own is not None:  # gridtrain's plan for the family (families/)
        return own
    plan = dict(getattr(model, "_pp_plan", None) or {})
    prefix = base_prefix(model)
    base = dict(getattr(model.config, "base_model_pp_plan", None) or {})
    ordered = {prefix + k: v for k, v in base.items()}
    ordered.update({k: v for k, v in plan.items() if k.startswith(prefix) and k not in ordered})
    ordered.update({k: v for k, v in plan.items() if k not in ordered})
    _refuse_missing(model, ordered)
    covered = {id(p) for k in ordered for p in model.get_submodule(k).parameters()}
    outside = [n for n, p in model.named_parameters() if id(p) not in covered]
    if not plan or outside:
        name = type(model).__name__
        raise PlanError(
            f"{name} has no pipeline plan (transformers' _pp_plan"
            + (f" covers {sorted(ordered)} but not {outside[:3]}" if plan else "")
            + ") and gridtrain has none for it: pipeline parallelism cannot cut it; use a "
            "layout without parallel.pipeline"
        )
    return ordered


def _refuse_missing(model: nn.Module, plan: dict) -> None:
    """A plan naming a module the model lacks (HRM's config inherits Llama's ``layers`` while
    its blocks live in an ``L_module`` and an ``H_module`` run in cycles) cannot cut it."""
    modules = dict(model.named_modules(remove_duplicate=False))
    missing = [path for path in plan if path not in modules]
    if missing:
        raise PlanError(
            f"{type(model).__name__}'s pipeline plan (transformers' _pp_plan) names "
            f"{missing}, which the model does not have: its layers are arranged otherwise "
            "and pipeline parallelism cannot cut it; use a layout without parallel.pipeline"
        )


def _forward_parameters(model: nn.Module) -> set[str]:
    """The named parameters of the model's forward, and of the forwards a subclass's
    ``forward(*args, **kwargs)`` hands on to."""
    names: set[str] = set()
    for cls in type(model).__mro__:
        if "forward" in vars(cls):
            names |= set(inspect.signature(vars(cls)["forward"]).parameters)
    return names
