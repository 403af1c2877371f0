"""What the traced data flow says about layers a split would change: packed projections and
per-head norms. Every mode applies these rules, whoever gave the style.

* **Packed outputs** (``cuts.py``). A column split hands each rank a contiguous block of a
  Linear's output features. ``column_style`` turns a Linear whose output the model cuts into
  equal blocks (GPT-2's ``[q | k | v]``, a fused ``[gate | up]``) into ``packed_colwise``
  with that many blocks; ``check_columns`` refuses, naming the module, a column split of an
  output cut into unequal blocks (Phi-3's grouped-query ``qkv_proj``), a plain split of a
  packed one, and a fused projection (one Linear feeding two of an attention's query, key and
  value) whose packing the trace did not see.
* **Loose parameters** (``check_loose_params``): a module the plan leaves whole that holds
  parameters of its own and reads a split output (Apertus's ``XIELU`` activation after a
  column-parallel ``up_proj``) would train them on each rank's part alone: refused by name.
* **Per-head norms.** A norm narrower than the Linear output it reads normalises each head
  (Qwen3's and OLMo-style ``q_norm`` over ``head_dim``): ``head_norms`` gives it
  ``replicated_with_grad_allreduce`` (weight whole, gradient summed where the heads are split).
"""

from __future__ import annotations

from torch import nn

from gridtrain.parallel.tensor.base import linear_dims
from gridtrain.parallel.tensor.cuts import Cut, packing
from gridtrain.parallel.tensor.modes import names_where
from gridtrain.parallel.tensor.norm import norm_kind
from gridtrain.parallel.tensor.plan import PlanError
from gridtrain.parallel.tensor.style import GRAD_SUMMED, LINEAR, NORM, PACKED_COLWISE, of
from gridtrain.parallel.tensor.trace import Flow


def head_norms(kinds, given, flow: Flow | None, modules) -> dict[str, tuple[str, str]]:
    """Norms not given a style that normalise each head of the Linears they read -> their
    style and origin (module docstring)."""
    out: dict[str, tuple[str, str]] = {}
    if flow is None:
        return out
    for name, kind in kinds.items():
        srcs = flow.sources.get(name, set())
        if kind != NORM or name in given or not srcs or any(kinds.get(s) != LINEAR for s in srcs):
            continue
        width = norm_kind(modules[name]).hidden
        outs = {linear_dims(modules[s])[1] for s in srcs}
        if all(o > width and o % width == 0 for o in outs):
            out[name] = (GRAD_SUMMED.name, f"traced: normalises each {width}-wide head")
    return out


def column_style(name: str, flow: Flow | None, modules, plain: str) -> str | None:
    """The style of Linear ``name``, about to be split by output columns as ``plain``: the
    same, ``packed_colwise`` for an output packing equal blocks, or None where no column
    split fits (``check_columns`` then says why)."""
    cut = flow.cuts.get(name) if flow is not None else None
    k = packing(cut, linear_dims(modules[name])[1])
    if k is None or (k == 1 and _unseen_fusion(name, flow, cut)):
        return None
    return plain if k == 1 else PACKED_COLWISE.name


def packed_blocks(name: str, flow: Flow | None, modules) -> int | None:
    """The blocks the model cuts ``name``'s output into, where they are equal (else None)."""
    cut = flow.cuts.get(name) if flow is not None else None
    k = packing(cut, linear_dims(modules[name])[1])
    return k if k and k > 1 else None


def check_columns(styles, kinds, flow: Flow | None, modules, column: tuple[str, ...]) -> None:
    """Every Linear split by output columns (``column``: the mode's styles that do) fits how
    the model cuts its output; PlanError naming the first that does not."""
    if flow is None:
        return
    for name, style in styles.items():
        if kinds.get(name) != LINEAR or style not in column:
            continue
        cut = flow.cuts.get(name)
        k = packing(cut, linear_dims(modules[name])[1])
        packed = of(style).packed
        if k is None or (k > 1 and not packed) or (packed and cut is not None and cut.inner):
            raise PlanError(_cut_error(name, style, cut, k))
        if k == 1 and not packed and _unseen_fusion(name, flow, cut):
            raise PlanError(
                f"'{name}' feeds more than one of the query, key and value of "
                f"'{flow.fused()[name]}' (a fused projection) and gridtrain cannot see how it "
                f"packs them; give '{name}' a style in parallel.tensor.plan (packed_colwise for "
                "[q | k | v] blocks, colwise for q, k and v interleaved per head)"
            )


def _unseen_fusion(name: str, flow: Flow | None, cut: Cut | None) -> bool:
    """A fused projection whose output the model cut in no way the trace follows."""
    if flow is None or name not in flow.fused():
        return False
    return cut is None or not (cut.widths or cut.inner)


def _cut_error(name: str, style: str, cut: Cut | None, k: int | None) -> str:
    if k is not None and k > 1:
        return (
            f"'{name}' as {style}: the model cuts its output into {k} equal blocks "
            f"{cut.widths}, which a plain column split would mix across ranks; use "
            "packed_colwise (each block split, so each rank keeps its part of every block)"
        )
    if k is not None:  # packed, but cut per head
        return (
            f"'{name}' as {style}: the model reshapes its output per head before cutting it, so "
            "the blocks are interleaved per head; use colwise"
        )
    return (
        f"'{name}' as {style}: the model cuts its output into blocks of unequal widths "
        f"{cut.widths}, which no "
        "column split keeps whole on each rank; keep its output whole (1d: "
        "colwise_gather_output in parallel.tensor.plan) or use a layout without tensor "
        "splitting for this model"
    )


def loose_modules(model: nn.Module, kinds: dict[str, str]) -> tuple[str, ...]:
    """Modules outside the tracked layers that hold parameters of their own (not the root, and
    not aliases of a tracked layer's: BERT's ``cls.predictions.bias`` is its decoder's)."""
    modules = dict(model.named_modules())
    tracked = {id(p) for name in kinds for p in modules[name].parameters()}
    out = []
    for name, module in modules.items():
        inside = any(name == t or name.startswith(t + ".") for t in kinds)
        own = [p for p in module.parameters(recurse=False) if id(p) not in tracked]
        if name and not inside and own:
            out.append(name)
    return tuple(out)


def check_loose_params(kinds, styles, flow: Flow | None, modules, spec) -> None:
    """PlanError naming a loose module (``loose_modules``) that reads a Linear whose output
    stays split under ``spec`` (module docstring)."""
    if flow is None:
        return
    for name, srcs in flow.watched.items():
        split = sorted(
            s for s in srcs if kinds.get(s) == LINEAR and spec.splits_output(LINEAR, styles[s])
        )
        if split:
            params = [n for n, _ in modules[name].named_parameters(recurse=False)]
            raise PlanError(
                f"'{name}' ({type(modules[name]).__name__}) holds parameters {params} and reads "
                f"the split output of {split}: each rank would train them on its part alone; "
                f"keep that output whole (colwise_gather_output in parallel.tensor.plan) or use "
                f"tensor mode {names_where(lambda g: g.splits_sequence)} or a pipeline for this model"
            )
