"""A tensor mode as one object: everything the planner, the engine and ``gt.nn`` ask of a mode.

Each mode package (``none/``, ``mode_1d/``, ``mode_2d/`` for 2d and 2.5d, ``mode_3d/``,
``sequence/``) builds one ``TensorMode`` from its own parts in its ``runtime.py``, on its
torch-free geometry (``geometry.py``: groups, head split, sizes), and ``registry.py`` finds
it by the config's mode name. ``parallelize.py`` drives a spec without knowing which mode it
is; the engine asks it for ``split_batch``, ``gt.nn`` for the loss and accuracy.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
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


@dataclass(frozen=True)
class TensorMode:
    """One tensor mode's parts (see the module docstring); the mode package fills them in.

    ``infer_styles(kinds, given, flow, modules, n)`` gives every tracked layer's style and
    origin (``given``: module -> (style, origin) from the config, hints and the model's
    plan); ``needs_flow(kinds, given)`` says whether the plan cannot do without the data
    flow (None: the mode never traces); ``entry_options(kinds, styles, flow)`` adds the
    options its layers take (module -> options); ``check(plan, model)`` runs after the dry
    run; ``splits_output(kind, style)`` says whether a replaced layer's output leaves its
    last dim split (None: the model's forward is not re-run on local shapes), and
    ``splits_input(kind, style)`` whether it takes its input so (the dry run checks it);
    ``forward_mode(ctx)`` is the context the engine runs every forward of the model in
    (the planner's dry run on this rank's shapes too).
    """

    geometry: ModeGeometry  # the torch-free half: name, groups, head split, sizes
    split_batch: Callable  # (x, ctx) -> this rank's part of a batch tensor
    loss: type[nn.Module]  # gt.nn.CrossEntropyLoss's implementation under the mode
    accuracy: Callable  # (logits, labels, ctx) -> (correct, total)
    layers: LayerTable = field(default_factory=dict)
    kept: frozenset[str] = frozenset()  # kinds the mode leaves dense whatever their style
    infer_styles: Callable[..., Styles] | None = None  # None: no layer is planned
    needs_flow: Callable[[dict, dict], bool] | None = None
    entry_options: Callable[[dict, dict, Flow | None], dict[str, dict]] | None = None
    check: Callable[[Plan, nn.Module], None] | None = None
    tie_alternatives: tuple[style.Style, ...] = ()  # a tied Linear's styles to match its twin
    splits_output: Callable[[str, str], bool] | None = None
    # (kind, style) -> whether the replaced layer takes its input's last dim split (None: split
    # or whole); the field None: not checked
    splits_input: Callable[[str, str], bool | None] | None = None
    splits_weights: bool = False  # whether the coverage notice applies
    # (ctx) -> the context every forward of the model runs in; None: nothing around it
    forward_mode: Callable[[Any], AbstractContextManager] | None = None

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
