"""The sharded format: a directory written through ``torch.distributed.checkpoint`` (DCP).

Every rank hands DCP its own shards, described as chunks of the dense tensors
(``state.chunk_view``), under flat keys::

    model/<dense key>                  weights and buffers (fp32 masters under naive fp16)
    optim/state/<dense name>/<key>     optimizer state; moments carry their parameter's chunks
    optim/param_groups  lr_scheduler  scaler  extra      plain values, written once
    rng/<global rank>                  every generator of that rank

DCP writes each distinct chunk once (replicas of a chunk are deduplicated), so
the directory holds about one copy of the state however many ranks wrote it,
and no rank builds a dense tensor. Loading asks DCP for exactly this rank's
chunks of the dense tensors, so a checkpoint reshards to any layout.

Writing, atomically and optionally in the background, is ``writer``'s; this
file holds the layout of the state and the loading.
"""

from __future__ import annotations

import json
import logging
import os
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import Tensor
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.tensor import DTensor

from gridtrain.engine.checkpoint import files, integrity, pinned
from gridtrain.engine.checkpoint.dcp_metadata import load_metadata
from gridtrain.engine.checkpoint.errors import FULL, CheckpointError, CorruptCheckpointError
from gridtrain.engine.checkpoint.state import (
    chunk_view,
    hyperparameters,
    inner,
    is_moment,
    layout,
    masters,
    optimizer_params,
    rng_state,
    set_rng_state,
    sync_model_from_masters,
)
from gridtrain.parallel import comm
from gridtrain.parallel.context import ParallelContext
from gridtrain.parallel.mode import ParallelMode
from gridtrain.parallel.rows import get_zero_rows, local
from gridtrain.parallel.sharding import dense_items, dense_shape
from gridtrain.parallel.tags import get_shard_spec

logger = logging.getLogger("gridtrain")

FORMAT = "gridtrain-dcp"
VERSION = 1
MODEL, OPTIM, GROUPS = "model/", "optim/state/", "optim/param_groups"


# ---- DCP with nothing unpickled but plain values ----------------------------------------------
class _SafeReader(dcp.FileSystemReader):
    """DCP's reader, but ``.metadata`` is read as data (``dcp_metadata``); ``where`` names the
    checkpoint in messages (``path`` may be a pinned descriptor's)."""

    def __init__(self, path: Path, where: Path):
        super().__init__(path)
        self.where = where

    def read_metadata(self, *args: Any, **kwargs: Any):
        rank = kwargs.get("rank")
        path = self._get_metadata_path(rank)
        with self.fs.create_stream(path, "rb") as f:
            metadata = load_metadata(f, f"'{self.where}'")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = dcp.metadata.StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class _SafeLoadPlanner(dcp.DefaultLoadPlanner):
    """Reads plain values with ``weights_only=True`` and keeps them apart from the tensors."""

    def __init__(self, where: str):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.where = where
        self.values: dict[str, Any] = {}

    def load_bytes(self, read_item, value) -> None:
        key = read_item.dest_index.fqn
        self.values[key] = files.safe_torch_load(value, f"'{key}' of {self.where}")


def first_failure(err: CheckpointException) -> BaseException:
    """DCP gathers every rank's exception into one; hand on the one that says what went wrong
    (the same on every rank): an unsafe file first, then a full disk."""
    failures = [exc for exc, _ in err.failures.values()]
    unsafe = [exc for exc in failures if isinstance(exc, files.UnsafeCheckpointError)]
    full = [exc for exc in failures if isinstance(exc, OSError) and exc.errno in FULL]
    return (unsafe or full or failures or [err])[0]


# ---- what a rank writes ----------------------------------------------------------------------
def state_dict(model, optimizer, lr_scheduler, extra, ctx: ParallelContext) -> dict[str, Any]:
    """This rank's part of the checkpoint as DCP's flat state dict (tensors share storage)."""
    fp32 = {id(p): m for p, m in masters(optimizer)}
    out: dict[str, Any] = {}
    for key, t in dense_items(model):
        view = chunk_view(fp32.get(id(t), t), get_shard_spec(t), ctx)
        if view is not None:  # None: ZeRO gave this rank no rows of it
            out[MODEL + key] = view
    if optimizer is not None:
        opt = inner(optimizer)
        for _, _, p, model_param, name in optimizer_params(optimizer, model):
            for key, value in opt.state.get(p, {}).items():
                fqn = f"{OPTIM}{name}/{key}"
                if isinstance(value, Tensor):
                    if is_moment(value, p):  # cut as the parameter is: ZeRO rows too
                        view = chunk_view(value, get_shard_spec(model_param), ctx, get_zero_rows(p))
                    else:
                        view = chunk_view(local(value), (), ctx)
                    if view is not None:
                        out[fqn] = view
                else:
                    out[fqn] = value
        out[GROUPS] = hyperparameters(optimizer)
        scaler = getattr(optimizer, "scaler", None)
        if scaler is not None:
            out["scaler"] = scaler.state_dict()
    if lr_scheduler is not None:
        out["lr_scheduler"] = lr_scheduler.state_dict()
    if extra is not None:
        out["extra"] = dict(extra)
    out[f"rng/{ctx.global_rank}"] = rng_state(ctx)
    return out


# ---- loading -----------------------------------------------------------------------------------
def read_marker(path: Path, where: Path | None = None) -> dict[str, Any]:
    """The completion marker's dict (its own CRC-32 checked), or a ``CheckpointError``.
    ``where``: the name for messages when ``path`` is a pinned descriptor's."""
    where = where or path
    try:  # O_NOFOLLOW: a link in the marker's place is no marker
        fd = os.open(path / files.MARKER, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except OSError:
        fd = None
    if fd is None or not stat.S_ISREG(os.fstat(fd).st_mode):
        if fd is not None:
            os.close(fd)
        raise CorruptCheckpointError(
            f"load_checkpoint: '{where}' is not a complete gridtrain checkpoint "
            f"(no {files.MARKER}: an interrupted save, or not written by gridtrain)"
        )
    with os.fdopen(fd, "rb") as f:
        marker = integrity.parse_marker(f.read(1 << 26), f"load_checkpoint: '{where}'")
    if marker.get("format") != FORMAT or marker.get("version") != VERSION:
        raise CheckpointError(
            f"load_checkpoint: '{where}' has format {str(marker.get('format'))[:40]!r} "
            f"version {str(marker.get('version'))[:40]!r}; expected {FORMAT!r} {VERSION}"
        )
    if not isinstance(marker.get("epoch"), int) or "layout" not in marker:
        raise CorruptCheckpointError(f"load_checkpoint: '{where}': its marker lacks the epoch")
    return marker


def verify_files(path: Path, marker: dict[str, Any], ctx: ParallelContext, where: Path) -> None:
    """Collective: every file the marker lists has its size and CRC-32 (each rank reads a
    share of them); markers written before the CRCs list none."""
    listed = marker.get("files")
    if listed is None:
        return
    if not integrity.well_formed(listed):
        raise CorruptCheckpointError(f"load_checkpoint: '{where}': its file list is damaged")
    n = ctx.world_size(ParallelMode.GLOBAL)
    share = sorted(listed)[ctx.global_rank :: n]
    problem = integrity.check_files(path, listed, share, f"load_checkpoint: '{where}'")
    found = [p for p in comm.all_gather_object(problem, ctx.group(ParallelMode.GLOBAL)) if p]
    if found:
        raise CorruptCheckpointError(found[0])


def _optimizer_targets(optimizer, model, md: dict, ctx: ParallelContext):
    """Tensors shaped like this rank's optimizer state, for DCP to fill (no step needed).

    Returns (targets by key, [(flat index, dense name, state keys)]).
    """
    saved: dict[str, list[str]] = {}
    for fqn in md:
        if fqn.startswith(OPTIM):
            name, key = fqn[len(OPTIM) :].rsplit("/", 1)
            saved.setdefault(name, []).append(key)
    targets: dict[str, Any] = {}
    entries = []
    for index, _, p, model_param, name in optimizer_params(optimizer, model):
        keys = saved.get(name, [])
        for key in keys:
            fqn = f"{OPTIM}{name}/{key}"
            meta = md[fqn]
            if not isinstance(meta, TensorStorageMetadata):
                targets[fqn] = None  # a plain value
            elif len(meta.size) > 0 and tuple(meta.size) == dense_shape(model_param, ctx):
                mine = local(p)  # ZeRO: this rank's rows (stage 3: of the DTensor)
                buf = torch.empty(mine.shape, dtype=meta.properties.dtype, device=mine.device)
                view = chunk_view(buf, get_shard_spec(model_param), ctx, get_zero_rows(p))
                targets[fqn] = _Filled(buf if view is None else view, p)
            else:
                targets[fqn] = torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
        entries.append((index, name, keys))
    return targets, entries


class _Filled:
    """An optimizer-state buffer DCP fills (``None`` view: ZeRO left this rank no rows), and
    the parameter whose layout it takes."""

    def __init__(self, buf: Tensor, param: Tensor):
        self.buf, self.param = buf, param

    def value(self) -> Tensor:
        if isinstance(self.param, DTensor):  # stage 3: state is a DTensor like its parameter
            p = self.param
            return DTensor.from_local(
                self.buf,
                p.device_mesh,
                p.placements,
                run_check=False,
                shape=p.shape,
                stride=p.stride(),
            )
        return self.buf


def _model_targets(path: Path, model, optimizer, md, ctx: ParallelContext) -> dict[str, Any]:
    """DCP key -> the view of this rank's chunk of every model tensor (fp32 masters where
    the optimizer steps them); every key present and of the saved dense shape."""
    fp32 = {id(p): m for p, m in masters(optimizer)}
    targets: dict[str, Any] = {}
    missing = []
    for key, t in dense_items(model):
        fqn = MODEL + key
        if fqn not in md:
            missing.append(key)
            continue
        want = dense_shape(t, ctx)
        if tuple(md[fqn].size) != want:
            raise ValueError(
                f"load_checkpoint: '{key}' has dense shape {tuple(md[fqn].size)} in '{path}', "
                f"the model's is {want}"
            )
        view = chunk_view(fp32.get(id(t), t), get_shard_spec(t), ctx)
        if view is not None:
            targets[fqn] = view
    if missing:
        raise KeyError(f"load_checkpoint: '{path}' lacks {len(missing)} keys, e.g. {missing[:5]}")
    return targets


def load(path: Path, model, optimizer, lr_scheduler, extra, ctx: ParallelContext) -> int:
    """Collective: read this rank's chunks of every tensor it holds from the directory ``path``
    (one version of it, ``pinned``, whatever saves replace it meanwhile)."""
    return pinned.load(
        path, ctx, lambda root: _load(root, path, model, optimizer, lr_scheduler, extra, ctx)
    )


def _agreed(read: Callable[[], Any], ctx: ParallelContext) -> Any:
    """``read()`` (a local read of the checkpoint), its failure raised on every rank."""
    error, out = None, None
    try:
        out = read()
    except (CheckpointError, OSError) as err:
        error = err
    pinned.agree(error, ctx)
    return out


def _load(root: Path, path: Path, model, optimizer, lr_scheduler, extra, ctx) -> int:
    marker = _agreed(lambda: read_marker(root, path), ctx)
    verify_files(root, marker, ctx, path)  # every byte checked before DCP reads any
    reader = _SafeReader(root, path)
    md = _agreed(lambda: reader.read_metadata().state_dict_metadata, ctx)
    targets = _model_targets(path, model, optimizer, md, ctx)
    plain = ["extra"] if extra is not None else []
    opt_targets, opt_entries = {}, None
    if optimizer is not None:
        if GROUPS not in md:
            raise KeyError(f"load_checkpoint: '{path}' holds no optimizer state")
        opt_targets, opt_entries = _optimizer_targets(optimizer, model, md, ctx)
        targets.update(
            {
                k: v.buf if isinstance(v, _Filled) else v
                for k, v in opt_targets.items()
                if not (isinstance(v, _Filled) and not _has_chunks(v.buf))
            }
        )
        plain += [GROUPS, "scaler"]
    if lr_scheduler is not None:
        if "lr_scheduler" not in md:
            raise KeyError(f"load_checkpoint: '{path}' holds no LR scheduler state")
        plain.append("lr_scheduler")
    rng_key = f"rng/{ctx.global_rank}"
    same_layout = marker.get("layout") == json.loads(json.dumps(layout(ctx)))
    if same_layout and rng_key in md:
        plain.append(rng_key)
    elif ctx.global_rank == 0:
        logger.warning(
            "load_checkpoint: '%s' was written under another layout; RNG states not restored",
            path,
        )
    targets.update({key: None for key in plain if key in md})

    planner = _read(path, targets, reader)
    sync_model_from_masters(optimizer, ctx)
    try:  # plain values that do not fit what they are loaded into: a checkpoint error
        _load_values(optimizer, lr_scheduler, extra, planner.values, opt_targets, opt_entries)
        if rng_key in planner.values:
            set_rng_state(ctx, planner.values[rng_key])
    except (KeyError, IndexError, TypeError, ValueError, RuntimeError) as err:
        raise CheckpointError(
            f"load_checkpoint: '{path}' does not fit: {type(err).__name__}: {err}"
        ) from err
    return int(marker["epoch"])


def _read(path: Path, targets: dict[str, Any], reader: _SafeReader) -> _SafeLoadPlanner:
    """``dcp.load`` into ``targets``; returns the planner holding the plain values. Whatever
    goes wrong reading the checkpoint is a ``CheckpointError``."""
    planner = _SafeLoadPlanner(f"'{path}'")
    try:
        dcp.load(targets, storage_reader=reader, planner=planner)
    except CheckpointException as err:
        cause = first_failure(err)
        if isinstance(cause, CheckpointError):
            raise cause from err
        raise CheckpointError(
            f"load_checkpoint: reading '{path}' failed: {type(cause).__name__}: {cause}"
        ) from err
    return planner


def _load_values(optimizer, lr_scheduler, extra, values, opt_targets, opt_entries) -> None:
    if optimizer is not None:
        _load_optimizer(optimizer, opt_targets, values, opt_entries)
        scaler = getattr(optimizer, "scaler", None)
        if scaler is not None and "scaler" in values:
            scaler.load_state_dict(values["scaler"])
    if lr_scheduler is not None:
        lr_scheduler.load_state_dict(values["lr_scheduler"])
    if extra is not None and "extra" in values:
        extra.update(values["extra"])


def _load_optimizer(optimizer, targets: dict, values: dict, entries) -> None:
    """Hand the optimizer a state dict numbered as its own ``state_dict`` would number it."""
    opt = inner(optimizer)
    local: dict[str, Any] = {"state": {}, "param_groups": []}
    start = 0
    for g, hyper in enumerate(hyperparameters(optimizer)):
        saved = values[GROUPS][g] if g < len(values[GROUPS]) else {}
        params = list(range(start, start + len(opt.param_groups[g]["params"])))
        local["param_groups"].append({**hyper, **saved, "params": params})
        start += len(params)
    for index, name, keys in entries:
        if keys:
            local["state"][index] = {
                key: _value(targets[fqn], values.get(fqn))
                for key in keys
                for fqn in [f"{OPTIM}{name}/{key}"]
            }
    opt.load_state_dict(local)


def _has_chunks(t: Tensor) -> bool:
    return hasattr(t, "global_offsets")


def _value(target: Any, plain: Any) -> Any:
    if target is None:
        return plain
    return target.value() if isinstance(target, _Filled) else target


__all__ = ["load", "read_marker", "state_dict"]
