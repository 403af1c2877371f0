"""The family registry: ``config.model_type`` -> ``Family``, the built-in ones loaded on first use.

Adding a built-in family is its file beside this one, which calls ``register_family``, and
its name in ``BUILT_IN``; a user's family is registered the same way from the user's code.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from torch import nn

from gridtrain.registry import Registry

if TYPE_CHECKING:  # hf/moe imports this registry
    from gridtrain.hf.moe.families import MoeFamily

# the families of this package (their module names), registered on first use of the registry
BUILT_IN = ("gpt2", "phi3", "mixtral", "qwen2_moe", "qwen3_moe", "gpt_oss", "deepseek_v3")
_loaded: list[bool] = []

TensorPlan = Callable[[nn.Module, Any], dict[str, str]]  # (model, ctx) -> pattern -> style
# (model, plan, heads split, undo list): give the model's code this rank's head counts
Localise = Callable[[nn.Module, Any, int, list], None]
# model -> module path -> (inputs, outputs), transformers' _pp_plan form; None: the model's own
PipelinePlan = Callable[[nn.Module], dict[str, tuple[list[str], list[str]]] | None]


@dataclass(frozen=True)
class Family:
    """What gridtrain adds to one family's own plans; None leaves that part to the model.

    ``tensor_plan``: the tensor plan (HF pattern -> style) under a context whose mode splits
    weights, in place of the model's ``_tp_plan``; heads are checked before. ``localise``:
    make the model's code compute with this rank's heads once the plan is applied (the
    default sets attention attributes equal to the config's head counts where a projection's
    output is split, ``patches.localise_heads``); every change goes through
    ``patches.set_undoable`` so the planner's forward on this rank's shapes can undo it.
    ``pipeline_plan``: the pipeline units, in place of the model's ``_pp_plan``. ``moe``: a
    mixture-of-experts family's router losses (``hf/moe/families.py``), which gridtrain makes
    the global batch's under data parallelism.
    """

    model_type: str
    tensor_plan: TensorPlan | None = None
    localise: Localise | None = None
    pipeline_plan: PipelinePlan | None = None
    moe: MoeFamily | None = None
    note: str = ""


FAMILIES = Registry("family", "; pass replace=True to override it")  # model_type -> Family


def register_family(family: Family, replace: bool = False) -> Family:
    """Make ``family`` the entry for its ``model_type``; one already registered (built-in or
    not) is replaced only with ``replace=True``. Every rank registers it, before
    ``gt.initialize``."""
    _load_built_in()
    return FAMILIES.add(family.model_type, family, replace=replace)


def unregister_family(model_type: str) -> None:
    """Forget the entry for ``model_type`` (a test's, or a built-in one to run without it)."""
    _load_built_in()
    FAMILIES.remove(model_type, keep_built_in=False)


def family_of(model: nn.Module) -> Family:
    """The entry for ``model``'s ``config.model_type``; an empty one (the model's own plans)
    for a family with none."""
    _load_built_in()
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    return FAMILIES.get(model_type) or Family(str(model_type))


def _load_built_in() -> None:
    if _loaded:
        return
    _loaded.append(True)  # before the imports: each family module registers itself
    for name in BUILT_IN:
        importlib.import_module(f"gridtrain.hf.families.{name}")
