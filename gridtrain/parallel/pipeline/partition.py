"""Cutting a model into pipeline stages: which layers each rank keeps, and only those built.

The model's layers (``layers.py``: an ``nn.Sequential``, ``pipeline_layers()``, a
library adapter, or a forward that chains its layers) are cut into ``P * num_chunks``
contiguous parts (``balance.py``: by parameters and compute by default); virtual part
``c * P + s`` is chunk ``c`` of stage ``s`` (Megatron's interleaving).

Two kinds of stage come out. A model whose layers only chain gets a ``PipelineStage``:
the output of each layer is the input of the next (a tuple is unpacked into positional
arguments), a dict batch goes to the first layer as keyword arguments, and the layers are
registered under their dense paths. A model its library's adapter cuts into units (a
``ModelCut``: Hugging Face models) stays itself and runs its own forward on every stage,
the units other stages hold replaced by stand-ins (``model_stage.py``). Either way the
stage's ``state_dict`` keys are the dense model's keys for what it holds, and it carries
the cut's ``stage_table`` (``table.py``).

A model built under ``gt.lazy_init()`` lives on the meta device: each rank then
allocates only its own layers and re-runs their ``reset_parameters``
(``parallel.materialize``).
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch
from torch import nn

from gridtrain.parallel import tags
from gridtrain.parallel.materialize import materialise
from gridtrain.parallel.pipeline.balance import METHODS, layer_costs, partition
from gridtrain.parallel.pipeline.layers import layer_list, stage_layers
from gridtrain.parallel.pipeline.model_stage import cut_model
from gridtrain.parallel.pipeline.table import StageTable, stage_table
from gridtrain.parallel.sharding import dense_shape
from gridtrain.parallel.tensor.plan import PlanError

logger = logging.getLogger("gridtrain")
UNEVEN = 1.5  # a stage holding more than this times an even share of the parameters is named

__all__ = [
    "METHODS",
    "PipelineStage",
    "build_stage",
    "layer_list",
    "mark_pipeline_shared",
    "partition",
    "stage_parts",
]


def stage_parts(stage: int, pipeline_size: int, num_chunks: int) -> list[int]:
    """Virtual part indices held by ``stage``, one per chunk: ``c * P + stage``."""
    return [c * pipeline_size + stage for c in range(num_chunks)]


class PipelineStage(nn.Module):
    """This rank's layers of a partitioned model; ``forward(*inputs, chunk=0)`` runs one chunk.

    Layers are registered under their dense dotted paths (``blocks.3``), so
    ``state_dict()`` keys equal the dense model's keys for the kept layers.
    """

    def __init__(
        self,
        layers: list[tuple[str, nn.Module]],
        chunks: list[list[str]],
        stage: int,
        pipeline_size: int,
        dense_key: Any = None,
    ):
        super().__init__()
        for name, module in layers:
            parent = self
            *path, leaf = name.split(".")
            for part in path:
                if not hasattr(parent, part):
                    parent.add_module(part, nn.Module())
                parent = getattr(parent, part)
            parent.add_module(leaf, module)
        self.chunk_layer_names = chunks
        self.stage = stage
        self.pipeline_size = pipeline_size
        if dense_key is not None:
            self.dense_key = dense_key
        self.stage_table: StageTable | None = None  # set by build_stage

    @property
    def num_chunks(self) -> int:
        return len(self.chunk_layer_names)

    @property
    def is_first_stage(self) -> bool:
        return self.stage == 0

    @property
    def is_last_stage(self) -> bool:
        return self.stage == self.pipeline_size - 1

    def chunk(self, index: int) -> list[nn.Module]:
        """The layers of chunk ``index``, in execution order."""
        return [self.get_submodule(name) for name in self.chunk_layer_names[index]]

    def forward(self, *inputs: Any, chunk: int = 0, batch: Any = None, **kwargs: Any) -> Any:
        """Chunk ``chunk`` on ``inputs`` (the batch on the first part, else the previous
        part's output); ``batch``, the micro-batch the schedule hands every later part, is
        not read: chained layers see only their predecessor's output."""
        x: Any = inputs
        for layer in self.chunk(chunk):
            x = layer(*(x if isinstance(x, tuple) else (x,)), **kwargs)
            kwargs = {}  # keyword inputs (a dict batch) go to the first layer only
        return x


def build_stage(
    model: nn.Module,
    stage: int,
    pipeline_size: int,
    num_chunks: int = 1,
    method: str = "balanced",
    device: torch.device | None = None,
    ctx: Any = None,
    adapter: Any = None,
) -> tuple[nn.Module, dict[int, nn.Parameter]]:
    """Cut ``model`` and keep ``stage``'s layers; returns the stage and old->new param map.

    ``method``: one of ``METHODS`` (``balance.py``). With ``ctx``, a tensor-parallel
    shard counts as its dense tensor, so every rank of a stage makes the same cut and
    the stage table shows the model's numbers; ``adapter`` (``layers.layer_list``) lists a
    library model's layers. Where the adapter gives a ``ModelCut``, the stage is ``model``
    itself running its own forward (``model_stage.py``); else a ``PipelineStage`` chaining
    the layers. Weights shared between stages are tagged ``tags.mark_pipeline_shared`` on
    both copies (only ties between the first and the last stage are allowed:
    ``PipelineSharedModuleGradientHandler`` sums their gradients).
    """
    layers, cut = stage_layers(model, adapter)
    numel = (lambda p: math.prod(dense_shape(p, ctx))) if ctx is not None else torch.numel
    costs = layer_costs([m for _, m in layers], numel)
    starts = None if cut is None else [u.cut_before for u in cut.units]
    bounds = partition(costs, pipeline_size * num_chunks, method, starts)
    owner = [0] * len(layers)  # stage of each layer
    for part, (start, end) in enumerate(bounds):
        owner[start:end] = [part % pipeline_size] * (end - start)
    shared = _shared_across_stages(layers, owner, pipeline_size)
    parts = stage_parts(stage, pipeline_size, num_chunks)
    chunks = [[layers[i][0] for i in range(*bounds[part])] for part in parts]
    dense_order = [id(p) for p in model.parameters()]  # deduplicated, same on every rank
    if cut is not None:
        module = cut_model(model, cut, owner, [bounds[p] for p in parts], stage)
        new_of = _materialised([module], device)
    else:
        kept = [(name, m) for (name, m), s in zip(layers, owner, strict=True) if s == stage]
        new_of = _materialised([m for _, m in kept], device)
        dense_key = getattr(model, "dense_key", None)
        module = PipelineStage(kept, chunks, stage, pipeline_size, dense_key)
        if getattr(model, "config", None) is not None:  # a Hugging Face config: save_pretrained
            module.config = model.config
    for tie, pid in enumerate(sorted(shared, key=dense_order.index)):
        if pid in new_of:
            tags.mark_pipeline_shared(new_of[pid], tie)
    module.stage_table = stage_table(method, bounds, [n for n, _ in layers], costs, pipeline_size)
    if stage == 0:
        _warn_uneven(module.stage_table, [n for n, _ in layers], costs)
    logger.info(
        "pipeline stage %d/%d keeps %s\n%s", stage, pipeline_size, chunks, module.stage_table
    )
    return module, new_of


def _warn_uneven(table: StageTable, names: list[str], costs) -> None:
    """One line when a stage holds over ``UNEVEN`` times an even share of the parameters
    because one layer alone holds more than that share (no cut between layers avoids it)."""
    stages = len(table.rows)
    even = 1 / stages
    heaviest = max(range(stages), key=table.share)
    total = costs.total_params or 1
    big = max(range(len(names)), key=lambda i: costs.span_params(i, i + 1))
    big_share = costs.span_params(big, big + 1) / total
    if table.share(heaviest) > UNEVEN * even and big_share > even:
        logger.warning(
            "pipeline: stage %d holds %.2f of the model's parameters (an even cut: %.2f): its "
            "layer %r alone holds %.2f, and stages are cut between layers",
            heaviest,
            table.share(heaviest),
            even,
            names[big],
            big_share,
        )


def _materialised(modules: list[nn.Module], device: torch.device | None) -> dict[int, nn.Parameter]:
    """Old parameter id -> the parameter this stage trains: the same one, or under
    ``gt.lazy_init`` the one allocated and initialised now (and each new one -> itself)."""
    new_of = {id(p): p for m in modules for p in m.parameters()}
    tensors = [t for m in modules for t in (*m.parameters(), *m.buffers())]
    if any(t.is_meta for t in tensors):
        new_of = materialise(modules, device or torch.device("cpu"))
        new_of.update({id(q): q for q in list(new_of.values())})  # already-new params map to self
    return new_of


def _shared_across_stages(layers, owner: list[int], pipeline_size: int) -> set[int]:
    """Ids of the parameters held by layers of different stages (first and last only)."""
    stages_of: dict[int, set[int]] = {}
    params: dict[int, nn.Parameter] = {}
    for (_, m), s in zip(layers, owner, strict=True):
        for p in m.parameters():
            stages_of.setdefault(id(p), set()).add(s)
            params[id(p)] = p
    shared = {pid for pid, s in stages_of.items() if len(s) > 1}
    for pid in shared:
        if stages_of[pid] != {0, pipeline_size - 1}:
            raise PlanError(
                f"a weight of shape {tuple(params[pid].shape)} is shared by pipeline stages "
                f"{sorted(stages_of[pid])}; only ties between the first and the last stage "
                f"are supported"
            )
    return shared


def mark_pipeline_shared(*params: nn.Parameter) -> None:
    """Declare weights that are tied across stages but are separate tensors (e.g. built by
    separate layer factories): their gradients are summed between first and last stage."""
    for p in params:
        tags.mark_pipeline_shared(p)
