"""An input to trace a model with when the user gave none, built from the model's entry layer.

The planner runs the model once on the meta device (``trace.py``) to read its
data flow. ``gt.initialize`` takes that input from ``example_inputs=``, the first
training batch or a Hugging Face model's ``dummy_inputs``; with none of them it
asks ``infer_example``, which builds candidates from the first layers that can
take a model's input (in the order the model registers them):

* an ``Embedding``: token ids ``[batch, seq]`` in ``[0, num_embeddings)``, then ``[batch]``;
* a ``Linear`` (or a registered transposed Linear, ``base.register_transposed_linear``): features ``[batch, seq, in]``, then ``[batch, in]``;
* a ``Conv1d/2d/3d``: ``[batch, in_channels, *spatial]`` at a few sizes;
* ``gt.nn.PatchEmbedding``: images of its own ``img_size``.

Each candidate is run on meta (no memory, no compute) and the first whose forward
runs is kept. A model none of them fits gets an error naming ``example_inputs=``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from gridtrain.parallel.tensor.base import is_transposed_linear, linear_dims
from gridtrain.parallel.tensor.plan import PATCH, PlanError, kind_of
from gridtrain.parallel.tensor.trace import run_on_meta

BATCH, SEQ = 2, 8  # small: shapes on meta cost nothing, and the sharded trace repeats rows
ENTRY_LAYERS = 3  # how many candidate entry layers are tried, in registration order
SPATIAL = {1: ((64,), (256,)), 2: ((32, 32), (64, 64), (224, 224)), 3: ((16, 16, 16),)}


def infer_example(model: nn.Module, why: str) -> Any:
    """A meta input ``model``'s forward runs on (see the module docstring).

    ``why`` says what needs it (for the error). Raises ``PlanError`` naming
    ``example_inputs=`` when no candidate runs.
    """
    tried: list[str] = []
    last = ""
    for layer, example in entry_candidates(model):
        shape = f"{layer} {list(example.shape)} {str(example.dtype).removeprefix('torch.')}"
        try:
            run_on_meta(model, example)
        except Exception as err:  # noqa: BLE001 - the next candidate may fit
            tried.append(shape)
            last = f"{type(err).__name__}: {err}"
            continue
        return example
    detail = f"; tried {', '.join(tried)} (last: {last.splitlines()[0][:200]})" if tried else ""
    raise PlanError(
        f"{why}, and no input could be built for {type(model).__name__} from its first layers"
        f"{detail}: pass example_inputs= (one batch of the model's input) or a "
        "train_dataloader to gt.initialize"
    )


def entry_candidates(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(layer path, meta input) pairs for the first ``ENTRY_LAYERS`` layers that can take a
    model's input, each layer's candidates in the order they are tried."""
    seen: set[tuple] = set()
    layers = 0
    for name, module in model.named_modules():
        shapes = list(_inputs_for(module))
        if not shapes:
            continue
        for shape, dtype in shapes:
            if (shape, dtype) not in seen:
                seen.add((shape, dtype))
                yield name or type(model).__name__, torch.zeros(shape, dtype=dtype, device="meta")
        layers += 1
        if layers == ENTRY_LAYERS:
            return


def _inputs_for(module: nn.Module) -> Iterator[tuple[tuple[int, ...], torch.dtype]]:
    """(shape, dtype) candidates for an input entering ``module``; none for other layers."""
    dtype = _float_dtype(module)
    if isinstance(module, nn.Embedding):
        yield (BATCH, SEQ), torch.long
        yield (BATCH,), torch.long
    elif isinstance(module, nn.Linear) or is_transposed_linear(module):
        in_features = linear_dims(module)[0]
        yield (BATCH, SEQ, in_features), dtype
        yield (BATCH, in_features), dtype
    elif isinstance(module, nn.Conv1d | nn.Conv2d | nn.Conv3d):
        dims = module.weight.dim() - 2
        for spatial in SPATIAL[dims]:
            yield (BATCH, module.in_channels, *spatial), dtype
    elif kind_of(module) == PATCH:
        yield (BATCH, module.in_chans, module.img_size, module.img_size), dtype


def _float_dtype(module: nn.Module) -> torch.dtype:
    """The dtype of ``module``'s first floating-point parameter (the model's compute dtype)."""
    for p in module.parameters():
        if p.is_floating_point():
            return p.dtype
    return torch.get_default_dtype()
