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

A checkpoint in a family's original layout (Mixtral's per-expert
``block_sparse_moe.experts.3.w1.weight``, as most hub checkpoints store it, where the
installed ``transformers`` fuses experts into ``[num_experts, ...]`` tensors) is converted by
``transformers``' own checkpoint conversion mapping (``sources``), each rank reading only
the experts it holds.
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
from gridtrain.hf.sources import Source, Stored, keys_from_mapping, read_runs
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
            files = _Files(d, stack)
            error, kind, plan = None, PretrainedMismatchError, []
            try:
                where = reading.weight_map(d, INDEX, SINGLE)
                plan, error = _check(model, mine, tied, where, files, d.where)
            except PretrainedFileError as err:
                error, kind = str(err), PretrainedFileError
            except (OSError, ValueError, KeyError) as err:
                error = f"cannot read {directory}: {err}"
            agree_on_error(error, ctx, kind)
            for e, source in plan:
                _load_entry(e, source, files, ctx)
    recompute_all_rotary(model)


class _Files:
    """The directory's weight files (``sources.Files``): each opened once, on ``stack``; a
    safetensors error raised naming its file."""

    def __init__(self, d: reading.Directory, stack: ExitStack):
        self.d, self.stack, self.handles = d, stack, {}

    def _open(self, name: str):
        if name not in self.handles:
            self.handles[name] = self.d.safetensors(name, "the weight file", self.stack)
        return self.handles[name]

    def shape(self, key: str, name: str) -> tuple[int, ...]:
        return self.d.read(name, lambda: tuple(self._open(name).get_slice(key).get_shape()))

    def read(self, key: str, name: str, runs) -> Tensor:
        def get() -> Tensor:
            f = self._open(name)
            return read_runs(f.get_slice(key), runs) if runs else f.get_tensor(key)

        return self.d.read(name, get)


def _load_entry(e: Entry, source: Source, files: _Files, ctx: ParallelContext | None) -> None:
    """Read this rank's slice of ``source`` into ``e``'s tensor through the dense-state path:
    only its rows where it holds rows (ZeRO 3, Gemini), else its tensor-parallel shard, which
    the tensor and its master (naive fp16, ZeRO 1-2) each keep their part of."""
    rows = held_rows(e.tensor, ctx) if ctx is not None else None
    if rows is not None:
        if rows[1] > rows[0]:  # a rank may own no rows of a small tensor
            load_rows(e.tensor, source.read(files, local_runs(e, ctx, rows)))
        return
    full = source.read(files, local_runs(e, ctx))
    if ctx is None:  # no layout: a plain model
        e.tensor.copy_(full)
    else:
        load_local(e.tensor, full, ctx)


def _check(model: nn.Module, mine: list[Entry], tied, where: dict[str, str], files, named):
    """(what to read: entry and its source; the first error or None). A key the directory
    lacks is read from what ``transformers``' conversion mapping makes it from (``sources``)."""
    converted = keys_from_mapping(model, where, [e.key for e in mine])
    plan = []
    for e in mine:
        if e.tensor.is_meta:
            return [], (
                f"'{e.key}' is on the meta device: call load_pretrained after gt.initialize "
                "(which allocates this rank's shards of a gt.lazy_init() model)"
            )
        source = _source(e.key, tied, where, converted)
        if source is None:
            missing = [x.key for x in mine if _source(x.key, tied, where, converted) is None]
            return [], (f"'{e.key}' is missing from {named} (first of {len(missing)} missing keys)")
        shape = source.shape(files)
        if shape != e.shape:
            return [], (
                f"shape mismatch at '{source.name}' (the first mismatching key): {named} has "
                f"{shape}, the model has {e.shape}"
            )
        plan.append((e, source))
    return plan, None


def _source(key: str, tied, where: dict[str, str], converted: dict[str, Source]) -> Source | None:
    """Where ``key`` is read from: itself, a key tied to it, or what converts into it."""
    for k in (key, *tied.get(key, ())):
        if k in where:
            return Stored(k, where[k])
    return converted.get(key)


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
