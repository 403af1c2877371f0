"""The single-file dense format: the model and optimizer as the model built with no parallelism.

Model tensors via ``gt.full_state_dict`` (``dense_state``), optimizer state tensors rebuilt
with their parameter's shard spec and keyed by the dense parameter name, plus
the LR scheduler, the loss scaler, the epoch and ``extra``. A file written
under one layout loads under any other. Global rank 0 writes (``files``:
temporary beside the target, renamed over it); every rank reads the file
(``torch.load(weights_only=True)``: tensors and plain values only).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch import Tensor, nn

from gridtrain.engine.checkpoint import files
from gridtrain.engine.checkpoint.state import (
    hyperparameters,
    inner,
    is_moment,
    optimizer_params,
)
from gridtrain.parallel.context import ParallelContext
from gridtrain.parallel.dense_batch import dense_tensors
from gridtrain.parallel.dense_state import (
    full_state_dict,
    held_like,
    load_full_state_dict,
    merge_stages,
)
from gridtrain.parallel.rows import get_zero_rows
from gridtrain.parallel.sharding import dense_shape, shard_tensor
from gridtrain.parallel.tags import get_shard_spec

FORMAT = 1


def dense_optimizer_state(optimizer, model: nn.Module, ctx: ParallelContext) -> dict[str, Any]:
    """Collective: the optimizer's state with dense tensors, keyed by dense parameter name.
    Every state tensor is gathered in one batch (``dense_tensors``: a collective per group
    and step, not per tensor)."""
    state: dict[str, dict[str, Any]] = {}
    group_of: dict[str, int] = {}
    places, items = [], []  # where each gathered tensor goes, and what it gathers
    for _, index, p, model_param, name in optimizer_params(optimizer, model):
        group_of[name] = index
        entry = {}
        for key, value in inner(optimizer).state.get(p, {}).items():
            if isinstance(value, Tensor):
                # a moment is held as its parameter is (ZeRO rows, TP shards); else whole
                moment = is_moment(value, p)
                spec = get_shard_spec(model_param) if moment else ()
                places.append((entry, key))
                items.append((value, spec, get_zero_rows(p) if moment else get_zero_rows(value)))
            entry[key] = value
        if entry:
            state[name] = entry
    for (entry, key), value in zip(places, dense_tensors(items, ctx), strict=True):
        entry[key] = value
    state, group_of = merge_stages(state, ctx), merge_stages(group_of, ctx)
    return {"state": state, "group_of": group_of, "param_groups": hyperparameters(optimizer)}


def _load_optimizer_state(optimizer, model: nn.Module, saved: dict, ctx: ParallelContext) -> None:
    opt = inner(optimizer)
    local: dict[str, Any] = {"state": {}, "param_groups": []}
    start = 0
    for g, group in enumerate(opt.param_groups):
        hyper = saved["param_groups"][g] if g < len(saved["param_groups"]) else {}
        params = list(range(start, start + len(group["params"])))
        local["param_groups"].append({**hyperparameters(optimizer)[g], **hyper, "params": params})
        start += len(params)
    for index, _, p, model_param, name in optimizer_params(optimizer, model):
        if name in saved["state"]:
            dense = dense_shape(model_param, ctx)
            local["state"][index] = {
                k: held_like(shard_tensor(v, get_shard_spec(model_param), ctx), p, ctx)
                if isinstance(v, Tensor) and v.dim() > 0 and tuple(v.shape) == dense
                else v
                for k, v in saved["state"][name].items()
            }
    opt.load_state_dict(local)


def payload(model, optimizer, lr_scheduler, epoch: int, extra, ctx: ParallelContext) -> dict:
    """Collective: the whole checkpoint as one dict of dense tensors and plain values."""
    model_state = full_state_dict(model, ctx)  # fp32 masters where the optimizer has them
    scaler = getattr(optimizer, "scaler", None)
    return {
        "format": FORMAT,
        "epoch": epoch,
        "model": model_state,
        "optimizer": dense_optimizer_state(optimizer, model, ctx) if optimizer else None,
        "lr_scheduler": lr_scheduler.state_dict() if lr_scheduler is not None else None,
        "scaler": scaler.state_dict() if scaler is not None else None,
        "extra": extra,
    }


def write(path: Path, obj: dict) -> None:
    """Rank 0 only: clean our stale temporaries beside ``path``, then write atomically."""
    path.parent.mkdir(parents=True, exist_ok=True)
    files.clean_stale(path.parent)
    files.atomic_torch_save(obj, path)


def load(
    path: Path, model, optimizer, lr_scheduler, extra, ctx: ParallelContext, where: Path
) -> int:
    """Read the file ``path`` (a pinned descriptor's name; ``where``: its name for messages)."""
    ckpt = files.safe_torch_load(path, f"'{where}'")
    path = where
    if not isinstance(ckpt, dict) or ckpt.get("format") != FORMAT:
        raise ValueError(
            f"load_checkpoint: '{path}' is not a gridtrain checkpoint (format {FORMAT})"
        )
    load_full_state_dict(model, ckpt["model"], ctx)  # the masters too
    if optimizer is not None:
        if ckpt["optimizer"] is None:
            raise KeyError(f"load_checkpoint: '{path}' holds no optimizer state")
        _load_optimizer_state(optimizer, model, ckpt["optimizer"], ctx)
        scaler = getattr(optimizer, "scaler", None)
        if scaler is not None and ckpt["scaler"] is not None:
            scaler.load_state_dict(ckpt["scaler"])
    if lr_scheduler is not None:
        if ckpt["lr_scheduler"] is None:
            raise KeyError(f"load_checkpoint: '{path}' holds no LR scheduler state")
        lr_scheduler.load_state_dict(ckpt["lr_scheduler"])
    if extra is not None and ckpt.get("extra"):
        extra.update(ckpt["extra"])
    return ckpt["epoch"]
