"""Which class of which mode a planned layer becomes: one table per tensor mode.

``layer_for(ctx, kind, style, options)`` returns ``(factory, options)``, where
``factory(dense_module, ctx, **options)`` builds the sharded layer, or None when
the dense module is kept as it is (replicated).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from gridtrain.parallel.context import ParallelContext
from gridtrain.parallel.mode import ParallelMode
from gridtrain.parallel.tensor import mode_1d, mode_2d, mode_3d
from gridtrain.parallel.tensor.dropout import ParallelDropout
from gridtrain.parallel.tensor.plan import DROPOUT, EMBEDDING, LINEAR, NORM, PATCH, PlanError

Factory = Callable[..., Any]


def _dropout(rng_mode, vocab_mode=None) -> Factory:
    def build(dense, ctx, sharded: bool = True, **_):
        return ParallelDropout(dense, ctx, rng_mode if sharded else None, vocab_mode)

    return build


_1D: dict[tuple[str, str], tuple[Factory, dict]] = {
    (LINEAR, "colwise"): (mode_1d.ColumnLinear, {}),
    (LINEAR, "packed_colwise"): (mode_1d.ColumnLinear, {}),
    (LINEAR, "colwise_gather_output"): (mode_1d.ColumnLinear, {"gather_output": True}),
    (LINEAR, "gather_output"): (mode_1d.ColumnLinear, {"gather_output": True}),
    (LINEAR, "vocab_parallel"): (mode_1d.ColumnLinear, {"vocab_parallel": True}),
    (LINEAR, "rowwise"): (mode_1d.RowLinear, {}),
    (LINEAR, "rowwise_split_input"): (mode_1d.RowLinear, {"parallel_input": False}),
    (EMBEDDING, "embedding_rowwise"): (mode_1d.VocabParallelEmbedding1D, {}),
    (EMBEDDING, "embedding_colwise"): (mode_1d.Embedding1D, {}),
    (EMBEDDING, "colwise"): (mode_1d.Embedding1D, {}),
    (PATCH, "colwise"): (mode_1d.PatchEmbedding1D, {}),
    (DROPOUT, "replicate"): (_dropout(mode_1d.PM1D, mode_1d.PM1D), {}),
}


def _grid_table(m) -> dict[tuple[str, str], tuple[Factory, dict]]:
    """2d/2.5d and 3d: every Linear is the mode's Linear, heads its classifiers."""
    inner = ("auto", "colwise", "rowwise", "packed_colwise", "rowwise_split_input")
    table = {(LINEAR, s): (m.Linear, {}) for s in inner}
    table[(LINEAR, "gather_output")] = (m.Classifier, {})
    table[(LINEAR, "colwise_gather_output")] = (m.Classifier, {})
    table[(LINEAR, "vocab_parallel")] = (m.VocabParallelClassifier, {})
    table[(EMBEDDING, "embedding_rowwise")] = (m.VocabParallelEmbedding, {})
    table[(EMBEDDING, "embedding_colwise")] = (m.Embedding, {})
    table[(EMBEDDING, "colwise")] = (m.Embedding, {})
    table[(NORM, "norm")] = (m.Norm, {})
    table[(PATCH, "colwise")] = (m.PatchEmbedding, {})
    table[(DROPOUT, "replicate")] = (_dropout(ParallelMode.TENSOR), {})
    return table


_2D, _3D = _grid_table(mode_2d), _grid_table(mode_3d)
_SEQUENCE = {(DROPOUT, "replicate"): (_dropout(ParallelMode.SEQUENCE), {})}
TABLES = {"1d": _1D, "2d": _2D, "2.5d": _2D, "3d": _3D, "sequence": _SEQUENCE}


def layer_for(
    ctx: ParallelContext, name: str, kind: str, style: str, options: dict[str, Any]
) -> tuple[Factory | None, dict[str, Any]]:
    """(factory, options) for a layer of ``kind`` planned ``style`` under ``ctx``'s mode."""
    table = TABLES.get(ctx.tensor_mode, {})
    if style == "replicate" and kind != DROPOUT:
        return None, {}
    if kind == NORM and ctx.tensor_mode in ("1d", "sequence"):
        return None, {}  # activations around norms are replicated (1d) or per-position
    if kind == EMBEDDING and ctx.tensor_mode == "sequence":
        return None, {}
    entry = table.get((kind, style))
    if entry is None:
        if kind == LINEAR and ctx.tensor_mode == "sequence":
            return None, {}
        raise PlanError(
            f"'{name}': style '{style}' does not apply to a {kind} layer under tensor mode "
            f"{ctx.tensor_mode!r}"
        )
    factory, fixed = entry
    return factory, {**fixed, **options}
