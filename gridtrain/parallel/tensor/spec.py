"""A tensor mode as one object: everything the planner, the engine and ``gt.nn`` ask of a mode.

Each mode package (``none/``, ``mode_1d/``, ``mode_2d/`` for 2d and 2.5d, ``mode_3d/``,
``sequence/``) builds one ``TensorMode`` from its own parts in its ``runtime.py``, on its
torch-free geometry (``geometry.py``: groups, head split, sizes), and ``registry.py`` finds
it by the config's mode name. ``parallelize.py`` drives a spec without knowing which mode it
is; the engine asks it for ``split_batch``, ``gt.nn`` for the loss and accuracy.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from gridtrain.parallel.tensor import style
from gridtrain.parallel.tensor.geometry import ModeGeometry
from gridtrain.parallel.tensor.plan import DROPOUT, Plan, PlanError
from gridtrain.parallel.tensor.trace import Flow

Factory = Callable[..., Any]  # factory(dense_module, ctx, **options) -> the sharded layer
# (kind, style) -> the factory that implements the style on that kind, and its fixed options
LayerTable = dict[tuple[str, style.Style], tuple[Factory, dict[str, Any]]]
Styles = tuple[dict[str, str], dict[str, str]]  # module -> style, module -> where it came from


def keep_given(kinds: dict, given: dict, flow: Flow | None, modules: dict, n: int) -> Styles:
    """Styles for a mode with no inference of its own: the given ones, ``replicate`` else."""
    rest = (style.REPLICATE.name, "default")
    return (
        {m: given.get(m, rest)[0] for m in kinds},
        {m: given.get(m, rest)[1] for m in kinds},
    )


def never_needs_flow(kinds: dict, given: dict) -> bool:
    """The plan does without the data flow (it is still traced where an input is given)."""
    return False


def no_options(kinds: dict, styles: dict, flow: Flow | None) -> dict[str, dict]:
    """No options beyond each layer's own."""
    return {}


def no_check(plan: Plan, model: nn.Module) -> None:
    """Nothing to check after the dry run."""


def never_splits(kind: str, style_name: str) -> bool:
    """No replaced layer leaves its output's last dim split."""
    return False


def either_width(kind: str, style_name: str) -> bool | None:
    """A replaced layer takes its input's last dim split or whole."""
    return None


def no_forward_context(ctx: Any) -> AbstractContextManager:
    """Nothing around the model's forward."""
    return nullcontext()


@dataclass(frozen=True)
class TensorMode:
    """One tensor mode's parts (see the module docstring); the mode package fills them in,
    and every part it leaves out has a default that does nothing.

    ``infer_styles(kinds, given, flow, modules, n)`` gives every tracked layer's style and
    origin (``given``: module -> (style, origin) from the config, hints and the model's
    plan); ``needs_flow(kinds, given)`` says whether the plan cannot do without the data
    flow; ``entry_options(kinds, styles, flow)`` adds the options its layers take (module ->
    options); ``check(plan, model)`` runs after the dry run; ``splits_output(kind, style)``
    says whether a replaced layer's output leaves its last dim split, and
    ``splits_input(kind, style)`` whether it takes its input so (the dry run checks it);
    ``splits_weights``: the mode splits weights over its group, so the planner traces the
    data flow, re-runs the model's forward on this rank's shapes and the coverage notice
    applies; ``forward_mode(ctx)`` is the context the engine runs every forward of the model
    in (the planner's dry run on this rank's shapes too).
    """

    geometry: ModeGeometry  # the torch-free half: name, groups, head split, sizes
    split_batch: Callable  # (x, ctx) -> this rank's part of a batch tensor
    loss: type[nn.Module]  # gt.nn.CrossEntropyLoss's implementation under the mode
    accuracy: Callable  # (logits, labels, ctx) -> (correct, total)
    layers: LayerTable = field(default_factory=dict)
    kept: frozenset[str] = frozenset()  # kinds the mode leaves dense whatever their style
    infer_styles: Callable[..., Styles] = keep_given
    needs_flow: Callable[[dict, dict], bool] = never_needs_flow
    entry_options: Callable[[dict, dict, Flow | None], dict[str, dict]] = no_options
    check: Callable[[Plan, nn.Module], None] = no_check
    tie_alternatives: tuple[style.Style, ...] = ()  # a tied Linear's styles to match its twin
    splits_output: Callable[[str, str], bool] = never_splits
    # (kind, style) -> whether the replaced layer takes its input's last dim split (None: split
    # or whole)
    splits_input: Callable[[str, str], bool | None] = either_width
    splits_weights: bool = False
    forward_mode: Callable[[Any], AbstractContextManager] = no_forward_context

    @property
    def wraps_forward(self) -> bool:
        """Whether the mode runs the model's forward inside a context of its own."""
        return self.forward_mode is not no_forward_context

    @property
    def name(self) -> str | None:
        """The mode's config name (None: no tensor mode)."""
        return self.geometry.name

    @property
    def head_split(self) -> Callable[[int, int], tuple[int, str]]:
        """(size, depth) -> (ways heads are split, the group in words): the geometry's."""
        return self.geometry.head_split

    def layer_for(
        self, name: str, kind: str, style_name: str, options: dict[str, Any]
    ) -> tuple[Factory | None, dict[str, Any]]:
        """(factory, options) for ``name``, a ``kind`` layer planned ``style_name``: what the
        style makes of it under this mode (``Style.layer``); (None, {}) where the dense module
        is kept as it is."""
        planned = style.of(style_name)
        entry = planned.layer(kind, self)
        if (kind in self.kept and entry is None) or (planned.keeps and kind != DROPOUT):
            return None, {}
        if entry is None:
            raise PlanError(
                f"'{name}': style '{style_name}' does not apply to a {kind} layer under tensor "
                f"mode {self.name!r}"
            )
        factory, fixed = entry
        return factory, {**fixed, **options}
