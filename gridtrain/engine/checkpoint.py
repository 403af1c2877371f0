"""Layout-free checkpoints: dense model, dense optimizer state, LR scheduler, loss scaler, epoch.

Everything is stored as the model built with no parallelism would store it:
model tensors via ``sharding.full_state_dict``, optimizer state tensors rebuilt
with their parameter's shard spec and keyed by the dense parameter name. A
checkpoint written under one layout therefore loads under any other.

Global rank 0 writes to a hidden temporary file in the same directory and
renames it over the target (``os.replace`` is atomic), so a crash mid-save
leaves the previous checkpoint intact. Loading reads the file on every rank
(a shared filesystem, or a copy per node).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from gridtrain.parallel import comm
from gridtrain.parallel.context import ParallelContext, get_context
from gridtrain.parallel.mode import ParallelMode
from gridtrain.parallel.sharding import (
    full_state_dict,
    full_tensor,
    get_shard_spec,
    load_full_state_dict,
    shard_tensor,
    unwrap,
)

FORMAT = 1


def _param_names(model: nn.Module) -> dict[int, str]:
    """id(parameter) -> dense key (a tied parameter gets its first name)."""
    model = unwrap(model)
    rename = getattr(model, "dense_key", None)
    return {id(p): (rename(n) if rename else n) for n, p in model.named_parameters()}


def _dense_shape(param: Tensor, ctx: ParallelContext) -> tuple[int, ...]:
    shape = list(param.shape)
    for dim, mode in get_shard_spec(param):
        shape[dim] *= ctx.world_size(mode)
    return tuple(shape)


def _merge_stages(local: dict, ctx: ParallelContext) -> dict:
    merged: dict = {}
    for stage in comm.all_gather_object(local, ctx.group(ParallelMode.PIPELINE)):
        merged.update(stage)
    return merged


def _inner(optimizer):
    return getattr(optimizer, "optim", optimizer)


def _owner(optimizer, param: Tensor) -> Tensor:
    return optimizer.model_param_for(param) if hasattr(optimizer, "model_param_for") else param


def _dense_optimizer_state(optimizer, model: nn.Module, ctx: ParallelContext) -> dict[str, Any]:
    """Collective: the optimizer's state with dense tensors, keyed by dense parameter name."""
    names, inner = _param_names(model), _inner(optimizer)
    state: dict[str, dict[str, Any]] = {}
    group_of: dict[str, int] = {}
    for index, group in enumerate(inner.param_groups):
        for p in group["params"]:
            owner = _owner(optimizer, p)
            if id(owner) not in names:
                if owner.numel() == 0:  # a pipeline stage's placeholder parameter
                    continue
                raise KeyError("the optimizer holds a parameter that is not in the model")
            name = names[id(owner)]
            group_of[name] = index
            entry = {}
            for key, value in inner.state.get(p, {}).items():
                if isinstance(value, Tensor):
                    if value.dim() > 0 and value.shape == p.shape:
                        value = full_tensor(value, get_shard_spec(owner), ctx)
                    value = value.detach().cpu().clone()
                entry[key] = value
            if entry:
                state[name] = entry
    groups = [{k: v for k, v in g.items() if k != "params"} for g in inner.param_groups]
    if ctx.pipeline_parallel_size > 1:
        state, group_of = _merge_stages(state, ctx), _merge_stages(group_of, ctx)
    return {"state": state, "group_of": group_of, "param_groups": groups}


def _load_dense_optimizer_state(
    optimizer, model: nn.Module, saved: dict[str, Any], ctx: ParallelContext
) -> None:
    names, inner = _param_names(model), _inner(optimizer)
    local: dict[str, Any] = {"state": {}, "param_groups": []}
    index = 0
    for g, group in enumerate(inner.param_groups):
        hyper = saved["param_groups"][g] if g < len(saved["param_groups"]) else {}
        entry = {**{k: v for k, v in group.items() if k != "params"}, **hyper, "params": []}
        for p in group["params"]:
            owner = _owner(optimizer, p)
            name = names.get(id(owner))
            entry["params"].append(index)
            if name is not None and name in saved["state"]:
                dense = _dense_shape(owner, ctx)
                local["state"][index] = {
                    k: shard_tensor(v, get_shard_spec(owner), ctx)
                    if isinstance(v, Tensor) and v.dim() > 0 and tuple(v.shape) == dense
                    else v
                    for k, v in saved["state"][name].items()
                }
            index += 1
        local["param_groups"].append(entry)
    inner.load_state_dict(local)


def _masters(optimizer) -> list[tuple[Tensor, Tensor]]:
    """(model param, fp32 master) pairs of naive fp16; [] otherwise."""
    return optimizer.masters() if hasattr(optimizer, "masters") else []


def _agree(ctx: ParallelContext, failed: bool) -> bool:
    """Barrier over GLOBAL that also tells every rank whether any rank failed."""
    flag = torch.tensor([1.0 if failed else 0.0], device=ctx.device)
    comm.all_reduce_(flag, ctx.group(ParallelMode.GLOBAL))
    return flag.item() > 0


def _atomic_save(obj: Any, path: Path) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def save_checkpoint(
    path: str | os.PathLike,
    epoch: int,
    model: nn.Module,
    optimizer=None,
    lr_scheduler=None,
    ctx: ParallelContext | None = None,
) -> None:
    """Save a layout-free checkpoint (collective: call on every rank; rank 0 writes).

    Holds the dense model (fp32 master weights under naive fp16), the dense
    optimizer state, the LR scheduler, the loss scaler and ``epoch``.
    """
    if not isinstance(path, str | os.PathLike):
        raise TypeError(f"save_checkpoint: path must be a str or os.PathLike, got {path!r}")
    ctx = ctx or get_context()
    path = Path(path)
    model_state = full_state_dict(model, ctx)
    if _masters(optimizer):
        names = _param_names(model)
        masters = {
            names[id(p)]: full_tensor(m.detach(), get_shard_spec(p), ctx).cpu().clone()
            for p, m in _masters(optimizer)
        }
        if ctx.pipeline_parallel_size > 1:
            masters = _merge_stages(masters, ctx)
        model_state.update(masters)
    payload = {
        "format": FORMAT,
        "epoch": epoch,
        "model": model_state,
        "optimizer": _dense_optimizer_state(optimizer, model, ctx) if optimizer else None,
        "lr_scheduler": lr_scheduler.state_dict() if lr_scheduler is not None else None,
        "scaler": optimizer.scaler.state_dict() if getattr(optimizer, "scaler", None) else None,
    }
    error = None
    if ctx.global_rank == 0:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            _atomic_save(payload, path)
        except Exception as err:  # noqa: BLE001 - every rank must learn of it, not hang
            error = err
    if _agree(ctx, error is not None):
        if error is not None:
            raise error
        raise RuntimeError(f"save_checkpoint: rank 0 failed to write {path}")


def load_checkpoint(
    path: str | os.PathLike,
    model: nn.Module,
    optimizer=None,
    lr_scheduler=None,
    ctx: ParallelContext | None = None,
) -> int:
    """Load a checkpoint saved under any layout into this one; returns its epoch.

    Every rank reads ``path``. The optimizer must hold the same parameters in
    the same groups as the one saved (its dense names are matched).
    """
    ctx = ctx or get_context()
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"load_checkpoint: no checkpoint at '{path}'")
    ckpt = torch.load(path, map_location="cpu", weights_only=False)
    if not isinstance(ckpt, dict) or ckpt.get("format") != FORMAT:
        raise ValueError(
            f"load_checkpoint: '{path}' is not a gridtrain checkpoint (format {FORMAT})"
        )
    load_full_state_dict(model, ckpt["model"], ctx)
    if optimizer is not None:
        if ckpt["optimizer"] is None:
            raise KeyError(f"load_checkpoint: '{path}' holds no optimizer state")
        names = _param_names(model)
        with torch.no_grad():
            for p, master in _masters(optimizer):
                master.copy_(shard_tensor(ckpt["model"][names[id(p)]], get_shard_spec(p), ctx))
        _load_dense_optimizer_state(optimizer, model, ckpt["optimizer"], ctx)
        scaler = getattr(optimizer, "scaler", None)
        if scaler is not None and ckpt["scaler"] is not None:
            scaler.load_state_dict(ckpt["scaler"])
    if lr_scheduler is not None:
        if ckpt["lr_scheduler"] is None:
            raise KeyError(f"load_checkpoint: '{path}' holds no LR scheduler state")
        lr_scheduler.load_state_dict(ckpt["lr_scheduler"])
    return ckpt["epoch"]
