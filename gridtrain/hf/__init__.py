"""Hugging Face ``transformers`` models in gridtrain: every layout from the config alone, and
pretrained weights in and out of any layout.

    model = GPT2LMHeadModel(config)            # or LlamaForCausalLM / from_pretrained / lazy_init
    engine, *_ = gt.initialize(model, optimizer, gt.nn.CrossEntropyLoss())
    gridtrain.hf.load_pretrained(engine.model, "path/to/hf_dir")  # each rank reads its slices
    out = engine(input_ids)                    # the HF output object; out.logits gathered
    loss = engine.criterion(out.logits.reshape(-1, V), labels.reshape(-1))  # labels shifted
    gridtrain.hf.save_pretrained(engine.model, "out_dir")  # transformers' from_pretrained loads it

``gt.initialize`` hands this package to the planner for any ``transformers`` model
(``gridtrain.adapters.adapter_for``; the interface is ``parallel.tensor.plan.ModelAdapter``):
``plan_model`` gives the tensor plan
(``plans.py``: the model's own ``_tp_plan``, head checks; gridtrain's for a family
registered in ``families/``, GPT-2's and Phi-3's) and checks what replaced layers must keep
computing (``embeddings.py``: embeddings that do more than look up rows, Gemma's and OPT's;
a ``1 + weight`` norm is the planner's ``norm_offset``), ``after_apply`` fixes what the
model's code needs once sharded (``patches.py``, a family's ``localise``, ``embeddings.py``;
ring attention and global positions where the mode cuts the sequence: ``attention.py``),
and ``pipeline_layers`` gives its pipeline units (``pipeline.py``: every stage runs the
model's own forward, other stages' layers stood in for). ``layers.py`` hands
``transformers``' own layer classes (``Conv1D``) to the planner. ``save_pretrained`` /
``load_pretrained`` (``save.py``, ``load.py``) move weights between any layout and a Hugging
Face directory.

Labels are shifted by the user before the batch is split: under sequence parallelism
HF's internal shift (``labels=`` passed to the model) would cross shards.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from torch import nn

from gridtrain.hf.families import Family, register_family
from gridtrain.hf.layers import register_layers
from gridtrain.hf.load import PretrainedMismatchError, load_pretrained
from gridtrain.hf.moe import parallelize_experts
from gridtrain.hf.pipeline import pipeline_layers
from gridtrain.hf.reading import PretrainedFileError
from gridtrain.hf.save import save_pretrained
from gridtrain.parallel.context import ParallelContext

__all__ = [
    "Family",
    "PretrainedFileError",
    "PretrainedMismatchError",
    "after_apply",
    "example_input",
    "local_view",
    "load_pretrained",
    "parallelize_experts",
    "prepare_model",
    "pipeline_layers",
    "plan_model",
    "register_family",
    "save_pretrained",
]

register_layers()  # Conv1D is a Linear to the planner (parallel/ names no library class)
# the name the model's own tensor plan goes by in the planner's messages
own_plan_name = "_tp_plan"


def plan_model(model: nn.Module, ctx: ParallelContext, example: Any) -> tuple[dict, Any]:
    """The tensor plan of a ``transformers`` model under ``ctx`` and the example to trace it
    with; raises ``PlanError`` (heads not divisible, no plan where one is needed)."""
    from gridtrain.hf import embeddings
    from gridtrain.hf.patches import give_reset_parameters
    from gridtrain.hf.plans import tensor_plan, trace_example
    from gridtrain.hf.sequence_checks import refuse_random_draws

    if not ctx.tensor_geometry.splits_sequence:  # under sequence: attention.install's run
        refuse_random_draws(model, ctx.tensor_mode)
    plan = tensor_plan(model, ctx)
    plan.update(embeddings.check(model, ctx.tensor_geometry, ctx.config.parallel.tensor.plan or {}))
    if not model.config.architectures:
        model.config.architectures = [type(model).__name__]
    give_reset_parameters(model)  # gt.lazy_init: shards re-run the model's own init
    return plan, trace_example(example)


def prepare_model(model: nn.Module, ctx: ParallelContext) -> tuple[dict, Any]:
    """Before planning, in every layout: the model's experts spread over EXPERT
    (``moe/``), a training forward without a key/value cache under activation
    checkpointing (``training.py``). Returns ``parallelize_experts``' result."""
    from gridtrain.hf.training import prepare_training

    prepare_training(model, ctx)
    return parallelize_experts(model, ctx)


def after_apply(model: nn.Module, plan, ctx: ParallelContext) -> None:
    """Once the plan is applied: local head counts (GPT-2, Phi-3), what replaced layers must
    keep computing (Gemma's scaled embedding), ring attention where the mode splits the
    sequence."""
    from gridtrain.hf import embeddings
    from gridtrain.hf.attention import install

    _localise(model, plan, ctx, [])
    embeddings.restore(model)
    if ctx.tensor_geometry.splits_sequence:
        install(model, ctx)


@contextlib.contextmanager
def local_view(model: nn.Module, plan, ctx: ParallelContext) -> Iterator[None]:
    """The model's own code as it will run once ``plan`` is applied (this rank's head counts),
    for the planner's forward on this rank's shapes; undone on exit."""
    from gridtrain.hf.patches import restore

    undo: list = []
    try:
        _localise(model, plan, ctx, undo)
        yield
    finally:
        restore(undo)


def example_input(model: nn.Module) -> Any:
    """The model's ``dummy_inputs`` (a dict of tensors), to trace it with when the user gave no
    input and the engine has no batch; else None."""
    dummy = getattr(model, "dummy_inputs", None)
    return dummy if isinstance(dummy, dict) else None


def _localise(model: nn.Module, plan, ctx: ParallelContext, undo: list) -> None:
    """Attention that takes its head counts from attributes gets this rank's: the family's own
    ``localise`` (``families/``), else ``patches.localise_heads`` on the attention modules
    whose projections' outputs stay split."""
    from gridtrain.hf.families import family_of
    from gridtrain.hf.patches import localise_heads
    from gridtrain.hf.plans import head_split
    from gridtrain.parallel.tensor.plan import LINEAR
    from gridtrain.parallel.tensor.registry import spec_of

    split, _ = head_split(ctx)
    localise = family_of(model).localise
    if localise is not None:
        localise(model, plan, split, undo)
        return
    splits = spec_of(ctx).splits_output
    split_out = {
        n
        for n, e in plan.entries.items()
        if e.kind == LINEAR and e.layer and splits and splits(e.kind, e.style)
    }
    localise_heads(model, split_out, split, undo)
