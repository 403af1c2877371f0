"""``load_pretrained``: a Hugging Face directory into any layout, each rank reading only its slices.

Every rank calls it on the model as trained (``engine.model``; after ``gt.initialize``,
so under ``gt.lazy_init()`` each rank has allocated only its shards). The directory's
index (or its single ``model.safetensors``) maps keys to files; ``safe_open`` reads
the headers, and every shape is checked against the dense shape of the rank's tensors
before a byte is copied. Any rank's mismatch (a missing key, a shape that differs)
raises on every rank, naming the first mismatching key and both shapes, so nothing is
half-loaded. Then each rank reads exactly its slices with ``get_slice`` (a packed
split, such as GPT-2's fused q/k/v, is one slice per block) and copies them in.

The directory is read as untrusted input (``reading``: only its own regular files, a FIFO or
a path out of it refused by name) through one open descriptor (``pinned``), so a
``save_pretrained`` that replaces it meanwhile cannot mix two exports.

A weight tied in the model and saved once (GPT-2's ``lm_head.weight``) is read from the
key it is tied to; non-persistent buffers that no checkpoint holds (rotary
``inv_freq``) are recomputed from the config, as ``transformers`` does.
"""

from __future__ import annotations

import os
from contextlib import ExitStack
from pathlib import Path

import torch
from torch import Tensor, nn

from gridtrain.engine.checkpoint.pinned import pin
from gridtrain.hf import reading
from gridtrain.hf.patches import recompute_all_rotary
from gridtrain.hf.reading import PretrainedFileError
from gridtrain.hf.save import INDEX, SINGLE
from gridtrain.hf.weights import (
    Entry,
    agree_on_error,
    current,
    entries,
    gather_objects,
    local_runs,
)
from gridtrain.parallel.context import ParallelContext
from gridtrain.parallel.dense_state import held_rows, load_local, load_rows
from gridtrain.parallel.mode import ParallelMode
from gridtrain.parallel.sharding import unwrap


class PretrainedMismatchError(ValueError):
    """The directory does not fit the model: a key is missing or a shape differs."""


@torch.no_grad()
def load_pretrained(
    model: nn.Module, directory: str | os.PathLike, ctx: ParallelContext | None = None
) -> None:
    """Load the weights of a Hugging Face directory into ``model`` in any layout (see module doc)."""
    ctx = current(ctx)
    directory = Path(directory)
    model = unwrap(model)
    mine, aliases = entries(model, ctx)
    tied = _tied_keys(mine, aliases, ctx)  # collective (pipeline): before anything can fail
    with pin(directory, ctx) as (root, _), reading.opened(root, directory) as d:
        with ExitStack() as stack:
            error, kind, plan = None, PretrainedMismatchError, []
            try:
                where = reading.weight_map(d, INDEX, SINGLE)
                plan, error = _check(mine, tied, where, d, stack)
            except PretrainedFileError as err:
                error, kind = str(err), PretrainedFileError
            except (OSError, ValueError, KeyError) as err:
                error = f"cannot read {directory}: {err}"
            agree_on_error(error, ctx, kind)
            handles = {}
            for e, key, name in plan:
                if name not in handles:
                    handles[name] = d.safetensors(name, "the weight file", stack)
                d.read(name, lambda: _load_entry(e, handles[name], key, ctx))  # noqa: B023
    recompute_all_rotary(model)


def _load_entry(e: Entry, f, key: str, ctx: ParallelContext | None) -> None:
    """Read this rank's slice of ``key`` into ``e``'s tensor through the dense-state path:
    only its rows where it holds rows (ZeRO 3, Gemini), else its tensor-parallel shard, which
    the tensor and its master (naive fp16, ZeRO 1-2) each keep their part of."""
    rows = held_rows(e.tensor, ctx) if ctx is not None else None
    if rows is not None:
        if rows[1] > rows[0]:  # a rank may own no rows of a small tensor
            load_rows(e.tensor, _read(f, key, local_runs(e, ctx, rows)))
        return
    full = _read(f, key, local_runs(e, ctx))
    if ctx is None:  # no layout: a plain model
        e.tensor.copy_(full)
    else:
        load_local(e.tensor, full, ctx)


def _check(mine: list[Entry], tied, where: dict[str, str], d: reading.Directory, stack):
    """(what to read: entry, checkpoint key, file; the first error or None)."""
    shapes: dict[str, tuple[int, ...]] = {}
    plan = []
    handles = {}
    for e in mine:
        if e.tensor.is_meta:
            return [], (
                f"'{e.key}' is on the meta device: call load_pretrained after gt.initialize "
                "(which allocates this rank's shards of a gt.lazy_init() model)"
            )
        key = e.key if e.key in where else _first(tied.get(e.key, ()), where)
        if key is None:
            missing = [x.key for x in mine if x.key not in where and not tied.get(x.key)]
            return [], (
                f"'{e.key}' is missing from {d.where} (first of {len(missing)} missing keys)"
            )
        name = where[key]
        if name not in handles:
            handles[name] = d.safetensors(name, "the weight file", stack)
        shapes[key] = d.read(name, lambda: tuple(handles[name].get_slice(key).get_shape()))  # noqa: B023
        if shapes[key] != e.shape:
            return [], (
                f"shape mismatch at '{key}' (the first mismatching key): {d.where} has "
                f"{shapes[key]}, the model has {e.shape}"
            )
        plan.append((e, key, name))
    return plan, None


def _first(keys, where: dict[str, str]) -> str | None:
    return next((k for k in keys if k in where), None)


def _tied_keys(mine: list[Entry], aliases: dict[str, str], ctx) -> dict[str, list[str]]:
    """key -> other keys of the same dense tensor (tied in this stage, or across stages)."""
    out: dict[str, list[str]] = {}
    for alias, kept in aliases.items():
        out.setdefault(kept, []).append(alias)
        out.setdefault(alias, []).append(kept)
    local = [(e.key, e.tie) for e in mine if e.tie is not None]
    by_tie: dict[int, list[str]] = {}
    for stage in gather_objects(local, ctx, ParallelMode.PIPELINE):
        for key, tie in stage:
            by_tie.setdefault(tie, []).append(key)
    for keys in by_tie.values():
        for key in keys:
            out.setdefault(key, []).extend(k for k in keys if k != key)
    return out


def _read(f, key: str, runs: list[list[tuple[int, int]]]) -> Tensor:
    """This rank's piece of ``key``: the cartesian product of its runs, read slice by slice."""
    if not runs:
        return f.get_tensor(key)
    sl = f.get_slice(key)

    def piece(prefix: list[slice], dim: int) -> Tensor:
        if dim == len(runs):
            return sl[tuple(prefix)]
        parts = [piece([*prefix, slice(a, b)], dim + 1) for a, b in runs[dim]]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)

    return piece([], 0)
