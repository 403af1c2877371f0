"""A model's pipeline layers: the modules a pipeline may cut between, in execution order.

Where they come from, first match wins:

* ``model.pipeline_layers()``: modules, or ``(name, module)`` pairs, listed by the model;
* an ``nn.Sequential``: its children;
* the model library's adapter, handed in by ``gt.initialize``: ``gridtrain.hf`` gives a
  Hugging Face model's units along its ``_pp_plan`` as a ``ModelCut``, and every stage then
  runs the model's own forward (``model_stage.py``);
* any other model whose ``forward`` only chains its layers, such as
  ``self.head(self.norm(self.blocks(self.emb(ids))))`` or a loop over an
  ``nn.ModuleList`` of blocks. ``torch.fx`` traces the forward symbolically (no input
  needed, nothing runs), looking through ``nn.Sequential`` / ``nn.ModuleList`` /
  ``nn.ModuleDict`` containers and stopping at every other module; the graph must be a
  chain in which each layer reads only the previous layer's output. Anything else
  (a residual at the top level, arithmetic between layers, a layer called twice) is
  refused with the operation that breaks the chain, since a stage boundary there
  would drop what crosses it.

Every parameter must belong to a listed layer: one outside them would be on no stage.
A model that cannot be cut is refused with a ``PlanError`` naming what is missing.
"""

from __future__ import annotations

from torch import fx, nn

from gridtrain.parallel.pipeline.model_stage import ModelCut
from gridtrain.parallel.tensor.plan import ModelAdapter, PlanError

CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict)


def layer_list(
    model: nn.Module, adapter: ModelAdapter | None = None
) -> list[tuple[str, nn.Module]]:
    """The model's layers in execution order, each with its dotted path inside ``model``."""
    return stage_layers(model, adapter)[0]


def stage_layers(
    model: nn.Module, adapter: ModelAdapter | None = None
) -> tuple[list[tuple[str, nn.Module]], ModelCut | None]:
    """``layer_list``'s layers, and the adapter's ``ModelCut`` where the stages run the model's
    own forward (None where they chain the layers)."""
    cut = None
    if hasattr(model, "pipeline_layers"):
        items = list(model.pipeline_layers())
    elif isinstance(model, nn.Sequential):
        items = list(model.named_children())
    elif adapter is not None:
        given = adapter.pipeline_layers(model)
        cut = given if isinstance(given, ModelCut) else None
        items = [(u.name, u.module) for u in cut.units] if cut is not None else list(given)
    else:
        items = chained_layers(model)
    path_of = {id(m): name for name, m in model.named_modules() if name}
    layers = []
    for item in items:
        name, module = item if isinstance(item, tuple) else (path_of.get(id(item)), item)
        if not isinstance(module, nn.Module) or name is None:
            raise PlanError(
                f"pipeline_layers() of {type(model).__name__} must yield submodules of the "
                f"model (or (name, module) pairs), got {type(module).__name__}"
            )
        layers.append((name, module))
    covered = {id(p) for _, m in layers for p in m.parameters()}
    outside = [n for n, p in model.named_parameters() if id(p) not in covered]
    if outside:
        raise PlanError(
            f"parameters outside the pipeline layers cannot be placed on a stage: {outside[:5]}; "
            f"wrap them in a layer listed by pipeline_layers()"
        )
    return layers, cut


class _LayerTracer(fx.Tracer):
    """Stops at every module but the containers, so each layer is one ``call_module`` node."""

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return not isinstance(m, CONTAINERS)


def chained_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The layers of a model whose forward only chains them (module docstring), in order."""
    what = f"pipeline parallelism cannot cut {type(model).__name__}"
    how = (
        "make the model an nn.Sequential, or give it a pipeline_layers() method returning its "
        "layers in execution order (each layer's output is the next layer's input)"
    )
    try:
        graph = _LayerTracer().trace(model)
    except Exception as err:  # noqa: BLE001 - any trace failure gets the same advice
        first = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise PlanError(f"{what}: torch.fx could not trace its forward ({first}); {how}") from err
    layers: list[tuple[str, nn.Module]] = []
    inputs = [n for n in graph.nodes if n.op == "placeholder"]
    previous = None
    for node in graph.nodes:
        if node.op == "placeholder":
            continue
        if node.op == "output":
            if previous is None or node.args[0] is not previous:
                raise PlanError(f"{what}: its output is not the last layer's output; {how}")
            break
        problem = _chain_problem(node, previous, inputs, [n for n, _ in layers])
        if problem:
            raise PlanError(f"{what}: {problem}; {how}")
        layers.append((node.target, model.get_submodule(node.target)))
        previous = node
    return layers


def _chain_problem(node: fx.Node, previous: fx.Node | None, inputs, seen: list[str]) -> str:
    """Why ``node`` does not continue the chain after ``previous`` ('' when it does)."""
    if node.op != "call_module":
        where = f"after layer '{previous.target}'" if previous is not None else "before any layer"
        return f"its forward computes {node.op} '{_target(node)}' {where}"
    if node.target in seen:
        return f"layer '{node.target}' is called twice"
    if node.kwargs:
        return f"layer '{node.target}' takes keyword arguments {sorted(node.kwargs)}"
    if previous is None:
        used = [n for n in inputs if n.users]
        if list(node.args) != used:
            return f"the first layer '{node.target}' does not take the model's inputs as they are"
    elif list(node.args) != [previous]:
        return f"layer '{node.target}' reads more than the output of '{previous.target}'"
    if len(node.users) != 1:
        return f"the output of layer '{node.target}' is used {len(node.users)} times"
    return ""


def _target(node: fx.Node) -> str:
    return getattr(node.target, "__name__", str(node.target))
