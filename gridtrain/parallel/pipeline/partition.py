"""Cutting a model into pipeline stages: which layers each rank keeps, and only those built.

A model is partitionable when it is an ``nn.Sequential``, defines
``pipeline_layers()`` returning its layers in execution order (modules, or
``(name, module)`` pairs), or comes from a library with a model adapter
(``gridtrain.hf`` lists a Hugging Face model's layers); the output of each layer is
the input of the next (a tuple is unpacked into positional arguments; a layer with a
``gt_pipeline_run(layer, *inputs)`` attribute is run through it). A dict batch is
passed to the first layer as keyword arguments. The layers are cut into
``P * num_chunks`` contiguous parts, evenly by layer count ("uniform") or
balancing parameter counts ("parameters"); virtual part ``c * P + s`` is chunk
``c`` of stage ``s`` (Megatron's interleaving). A stage module registers its
layers under their dense paths, so its ``state_dict`` keys are the dense
model's keys for those layers.

A model built under ``gt.lazy_init()`` lives on the meta device: each rank then
allocates only its own layers and re-runs their ``reset_parameters``
(``parallel.materialize``).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from gridtrain.parallel.materialize import materialise
from gridtrain.parallel.tags import mark_pipeline_shared
from gridtrain.parallel.tensor.plan import model_adapter

logger = logging.getLogger("gridtrain")

METHODS = ("uniform", "parameters")


def layer_list(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The model's layers in execution order, each with its dotted path inside ``model``."""
    if hasattr(model, "pipeline_layers"):
        items = list(model.pipeline_layers())
    elif isinstance(model, nn.Sequential):
        items = list(model.named_children())
    elif model_adapter(model) is not None:
        items = list(model_adapter(model).pipeline_layers(model))
    else:
        raise TypeError(
            f"pipeline parallelism needs an nn.Sequential or a model with pipeline_layers(); "
            f"got {type(model).__name__}"
        )
    path_of = {id(m): name for name, m in model.named_modules() if name}
    layers = []
    for item in items:
        name, module = item if isinstance(item, tuple) else (path_of.get(id(item)), item)
        if not isinstance(module, nn.Module) or name is None:
            raise TypeError(
                f"pipeline_layers() of {type(model).__name__} must yield submodules of the "
                f"model (or (name, module) pairs), got {type(module).__name__}"
            )
        layers.append((name, module))
    covered = {id(p) for _, m in layers for p in m.parameters()}
    outside = [n for n, p in model.named_parameters() if id(p) not in covered]
    if outside:
        raise ValueError(
            f"parameters outside the pipeline layers cannot be placed on a stage: {outside[:5]}; "
            f"wrap them in a layer listed by pipeline_layers()"
        )
    return layers


def partition(weights: list[int], parts: int, method: str = "uniform") -> list[tuple[int, int]]:
    """Cut ``len(weights)`` layers into ``parts`` contiguous non-empty ``[start, end)`` ranges.

    "uniform" balances layer counts (earlier parts take the remainder); "parameters"
    minimises the largest part's weight sum (exact dynamic programme).
    """
    n = len(weights)
    if method not in METHODS:
        raise ValueError(f"parallel.pipeline.partition must be one of {METHODS}, got {method!r}")
    if parts < 1 or n < parts:
        raise ValueError(
            f"cannot cut {n} layers into {parts} pipeline parts (pipeline size x num_chunks); "
            f"each part needs at least one layer"
        )
    if method == "uniform":
        base, extra = divmod(n, parts)
        sizes = [base + (i < extra) for i in range(parts)]
    else:
        sizes = _balanced_sizes(weights, parts)
    bounds, start = [], 0
    for size in sizes:
        bounds.append((start, start + size))
        start += size
    return bounds


def _balanced_sizes(weights: list[int], parts: int) -> list[int]:
    n = len(weights)
    prefix = [0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    inf = float("inf")
    # best[k][i]: smallest possible max part weight putting the first i layers in k parts
    best = [[inf] * (n + 1) for _ in range(parts + 1)]
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0
    for k in range(1, parts + 1):
        for i in range(k, n - (parts - k) + 1):
            for j in range(k - 1, i):
                cost = max(best[k - 1][j], prefix[i] - prefix[j])
                if cost < best[k][i]:
                    best[k][i], cut[k][i] = cost, j
    sizes, i = [], n
    for k in range(parts, 0, -1):
        j = cut[k][i]
        sizes.append(i - j)
        i = j
    return sizes[::-1]


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

    def forward(self, *inputs: Any, chunk: int = 0, **kwargs: Any) -> Any:
        x: Any = inputs
        for layer in self.chunk(chunk):
            args = x if isinstance(x, tuple) else (x,)
            run = getattr(layer, "gt_pipeline_run", None)  # set by model adapters
            x = run(layer, *args, **kwargs) if run is not None else layer(*args, **kwargs)
            kwargs = {}  # keyword inputs (a dict batch) go to the first layer only
        return x


def build_stage(
    model: nn.Module,
    stage: int,
    pipeline_size: int,
    num_chunks: int = 1,
    method: str = "uniform",
    device: torch.device | None = None,
) -> tuple[PipelineStage, dict[int, nn.Parameter]]:
    """Cut ``model`` and keep ``stage``'s layers; returns the stage and old->new param map.

    Weights shared between stages are tagged ``tags.mark_pipeline_shared``
    on both copies (only ties between the first and the last stage are allowed:
    ``PipelineSharedModuleGradientHandler`` sums their gradients).
    """
    layers = layer_list(model)
    weights = [sum(p.numel() for p in m.parameters()) for _, m in layers]
    bounds = partition(weights, pipeline_size * num_chunks, method)
    owner = [0] * len(layers)  # stage of each layer
    for part, (start, end) in enumerate(bounds):
        owner[start:end] = [part % pipeline_size] * (end - start)
    stages_of: dict[int, set[int]] = {}
    params: dict[int, nn.Parameter] = {}
    for (_, m), s in zip(layers, owner, strict=True):
        for p in m.parameters():
            stages_of.setdefault(id(p), set()).add(s)
            params[id(p)] = p
    shared = {pid for pid, s in stages_of.items() if len(s) > 1}
    for pid in shared:
        if stages_of[pid] != {0, pipeline_size - 1}:
            raise ValueError(
                f"a weight of shape {tuple(params[pid].shape)} is shared by pipeline stages "
                f"{sorted(stages_of[pid])}; only ties between the first and the last stage "
                f"are supported"
            )
    chunks = [
        [layers[i][0] for i in range(*bounds[part])]
        for part in stage_parts(stage, pipeline_size, num_chunks)
    ]
    kept = [(name, m) for (name, m), s in zip(layers, owner, strict=True) if s == stage]
    new_of = {id(p): p for _, m in kept for p in m.parameters()}
    on_meta = any(p.is_meta for _, m in kept for p in m.parameters()) or any(
        b.is_meta for _, m in kept for b in m.buffers()
    )
    if on_meta:
        new_of = materialise([m for _, m in kept], device or torch.device("cpu"))
        new_of.update({id(q): q for q in list(new_of.values())})  # already-new params map to self
    dense_order = [id(p) for p in model.parameters()]  # deduplicated, same on every rank
    for tie, pid in enumerate(sorted(shared, key=dense_order.index)):
        if pid in new_of:
            mark_pipeline_shared(new_of[pid], tie)
    module = PipelineStage(kept, chunks, stage, pipeline_size, getattr(model, "dense_key", None))
    if getattr(model, "config", None) is not None:  # a Hugging Face config: save_pretrained
        module.config = model.config
    logger.info(
        "pipeline stage %d/%d keeps %s (%d parameters, %d shared with another stage)",
        stage,
        pipeline_size,
        chunks,
        sum(p.numel() for p in module.parameters()),
        sum(1 for pid in shared if pid in new_of),
    )
    return module, new_of
