"""``save_pretrained``: a Hugging Face directory (config.json, *.safetensors, index) from any layout.

Every rank calls it. The dense tensors are cut into files of at most
``max_shard_size`` bytes (HF's names: ``model.safetensors``, or
``model-0000i-of-0000N.safetensors`` plus ``model.safetensors.index.json``); a file
only holds tensors of one pipeline stage, and its writer is one rank of that stage's
first data-parallel replica (files go round the tensor ranks). Each tensor's dense value
comes from the one dense-state path (``dense_state.dense_value``: tensor-parallel shards,
ZeRO rows, FSDP2's DTensors, Gemini's rows, naive fp16's fp32 masters), one tensor at a
time, every rank of the stage joining its gathers, and the writer streams it to disk: no
rank ever holds more than one dense tensor, never the model.

The export appears whole or not at all: every file is written into a temporary directory
beside the target, which then replaces the whole directory in one rename (``export_dir``):
a full disk, a crash or a failed rank leaves the previous export as it was, never old and
new files side by side. A write that fails on any rank (a full disk says so, naming the
directory) raises on every rank; the writer keeps joining the gathers meanwhile, so no
rank hangs.

The file is written by hand because ``safetensors.torch.save_file`` needs every tensor
of a file in memory at once; the format is an 8-byte header length, a JSON header
(dtype, shape and byte offsets per tensor, ``__metadata__: {"format": "pt"}``) and the
raw little-endian bytes. ``safetensors.safe_open`` and ``transformers`` read it.
"""

from __future__ import annotations

import copy
import json
import os
import re
import struct
from pathlib import Path
from typing import Any

import torch
from torch import nn

from gridtrain.engine.checkpoint import files as ckpt_files
from gridtrain.engine.checkpoint.errors import disk_full
from gridtrain.engine.checkpoint.writer import on_rank0, wait_pending
from gridtrain.hf import export_dir
from gridtrain.hf.weights import (
    DTYPES,
    Entry,
    agree_on_error,
    current,
    entries,
    gather_objects,
    hf_config,
    world,
)
from gridtrain.parallel.context import ParallelContext
from gridtrain.parallel.dense_state import dense_value
from gridtrain.parallel.mode import ParallelMode

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"


def save_pretrained(
    model: nn.Module,
    directory: str | os.PathLike,
    max_shard_size: int | str = "5GB",
    ctx: ParallelContext | None = None,
) -> list[str]:
    """Write ``model`` (any layout; ``engine.model`` or the sharded HF model) as a Hugging Face
    directory that ``transformers``' ``from_pretrained`` and ``gridtrain.hf.load_pretrained``
    load. Every rank calls it; returns the weight file names. The directory is replaced as a
    whole (``export_dir``): files there that are not part of an export are kept."""
    ctx = current(ctx)
    config = hf_config(model)
    directory = Path(directory)
    limit = parse_size(max_shard_size)
    mine, _ = entries(model, ctx)
    stage = ctx.local_rank(ParallelMode.PIPELINE) if ctx is not None else 0
    meta = [(e.key, e.shape, str(e.dtype), e.tie, e.nbytes) for e in mine]
    stages = gather_objects(meta, ctx, ParallelMode.PIPELINE)
    files = plan_files(stages, limit)

    wait_pending()  # an async save_checkpoint's temporary beside it is not stale

    def start() -> str:
        export_dir.check_target(directory)
        return str(export_dir.make_temporary(directory))

    tmp = Path(_on_rank0(start, ctx))
    try:
        by_key = {e.key: e for e in mine}
        error = None
        for index, (name, file_stage, keys) in enumerate(files):
            if file_stage == stage:  # every rank of the stage: ZeRO and FSDP2 gather over DATA
                failed = _write_file(tmp / name, keys, by_key, stages[file_stage], ctx, index)
                error = error or failed
        agree_on_error(_message(error, directory), ctx, OSError)

        def finish() -> None:
            _write_index(tmp, files, stages)
            _write_config(tmp, config, model, stages)
            export_dir.carry_over(directory, tmp)
            export_dir.swap_in(tmp, directory)

        _on_rank0(lambda: _full_disk(finish, directory), ctx)
    except BaseException:
        if _rank(ctx) == 0:
            ckpt_files.remove_entry(tmp)
        raise
    return [name for name, _, _ in files]


def _message(error: OSError | None, directory: Path) -> str | None:
    if error is None:
        return None
    full = disk_full(error, directory, "save_pretrained")
    return str(full) if full is not None else f"save_pretrained: writing '{directory}': {error}"


def _full_disk(fn, directory: Path):
    """``fn()``; a full disk raised as an ``OSError`` that names ``directory`` and says so."""
    try:
        return fn()
    except OSError as err:
        full = disk_full(err, directory, "save_pretrained")
        if full is None:
            raise
        raise full from err


def _on_rank0(fn, ctx: ParallelContext | None):
    """``fn()`` on global rank 0, its result or error on every rank (one process: just ``fn()``)."""
    if world(ctx) == 1:
        return fn()
    return on_rank0(fn, ctx)


def parse_size(size: int | str) -> int:
    """Bytes of ``size``: an int, or ``"5GB"``/``"500MB"``/``"2GiB"`` (HF's convention)."""
    if isinstance(size, int):
        return size
    m = re.fullmatch(r"\s*([\d.]+)\s*([KMGT]?)(i?)B\s*", size.upper().replace("IB", "iB"))
    if not m:
        raise ValueError(f"max_shard_size: expected bytes or e.g. '5GB', got {size!r}")
    base = 1024 if m.group(3) else 1000
    return int(float(m.group(1)) * base ** " KMGT".index(m.group(2) or " "))


def plan_files(stages: list[list[tuple]], limit: int) -> list[tuple[str, int, list[str]]]:
    """``(file name, stage, keys)``: dense order, one stage per file, each under ``limit``
    bytes (a larger tensor gets a file of its own). A weight tied across the first and last
    stage is written once, under the first stage's key."""
    files: list[tuple[int, list[str], int]] = []
    ties: set[int] = set()
    for stage, meta in enumerate(stages):
        current_keys: list[str] = []
        size = 0
        for key, _, _, tie, nbytes in meta:
            if tie is not None:
                if tie in ties:
                    continue
                ties.add(tie)
            if current_keys and size + nbytes > limit:
                files.append((stage, current_keys, size))
                current_keys, size = [], 0
            current_keys.append(key)
            size += nbytes
        if current_keys:
            files.append((stage, current_keys, size))
    n = len(files)
    names = [SINGLE] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    return [(name, stage, keys) for name, (stage, keys, _) in zip(names, files, strict=True)]


def _write_file(
    path: Path, keys, by_key: dict[str, Entry], meta, ctx, index: int
) -> OSError | None:
    """Stream the dense tensors of ``keys`` into ``path`` (file ``index``): every rank of the
    stage gathers each in turn, the file's writer writes it. A write that fails (a full disk)
    is returned, and the writer goes on joining the gathers without writing."""
    info = {key: (shape, dtype) for key, shape, dtype, _, _ in meta}
    out, error = None, None
    if _writes(ctx, index):
        try:
            out = open(path, "xb")  # noqa: SIM115 - closed below, whatever happens
            out.write(_header(keys, info))
        except OSError as err:
            error = err
    for key in keys:
        dense = dense_value(by_key[key].tensor, ctx)
        if out is not None and error is None:
            try:
                out.write(dense.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
            except OSError as err:
                error = err
        del dense
    if out is not None:
        try:
            out.close()  # flushes: a full disk may only show here
        except OSError as err:
            error = error or err
    return error


def _header(keys: list[str], info: dict[str, tuple]) -> bytes:
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for key in keys:
        shape, dtype = info[key]
        dtype = getattr(torch, dtype.removeprefix("torch."))
        nbytes = int(torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size()
        header[key] = {
            "dtype": DTYPES[dtype],
            "shape": list(shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    return struct.pack("<Q", len(raw)) + raw


def _write_index(directory: Path, files, stages) -> None:
    if len(files) == 1:
        return
    sizes = {key: nbytes for meta in stages for key, _, _, _, nbytes in meta}
    weight_map = {key: name for name, _, keys in files for key in keys}
    total = sum(sizes[k] for k in weight_map)
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (directory / INDEX).write_text(json.dumps(index, indent=2) + "\n")


def _write_config(directory: Path, config, model: nn.Module, stages) -> None:
    config = copy.deepcopy(config)
    if not getattr(config, "architectures", None) and hasattr(model, "base_model_prefix"):
        config.architectures = [type(model).__name__]
    dtypes = [d for meta in stages for _, _, d, _, _ in meta]
    floats = [d for d in dtypes if getattr(torch, d.removeprefix("torch.")).is_floating_point]
    if floats:
        config.dtype = getattr(torch, floats[0].removeprefix("torch."))
    if getattr(config, "_attn_implementation_internal", None) == "gridtrain_ring":
        config._attn_implementation_internal = None  # a runtime choice of gridtrain's, not saved
    config.save_pretrained(directory)  # transformers' own writer


def _rank(ctx: ParallelContext | None) -> int:
    return ctx.global_rank if ctx is not None and world(ctx) > 1 else 0


def _writes(ctx: ParallelContext | None, index: int) -> bool:
    """Whether this rank writes file ``index`` of its stage: one rank of the stage's first
    replica, going round the tensor ranks."""
    if ctx is None or world(ctx) == 1:
        return True
    first = ctx.local_rank(ParallelMode.DATA) == 0
    if ctx.tensor_geometry.splits_sequence:  # sequence ranks are replicas of the weights too
        return first and ctx.local_rank(ParallelMode.SEQUENCE) == 0
    tensor = ctx.world_size(ParallelMode.TENSOR)
    return first and ctx.local_rank(ParallelMode.TENSOR) == index % tensor
