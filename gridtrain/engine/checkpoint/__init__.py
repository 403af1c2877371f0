"""Layout-free checkpoints: a dense single file, or a sharded directory (DCP), both resharding.

``save_checkpoint(..., sharded=False)`` gathers the dense model and optimizer
state and global rank 0 writes one file (``dense``); ``sharded=True`` has every
rank write only its own shards into a directory through
``torch.distributed.checkpoint`` (``sharded``), optionally in the background
(``async_save=True``). ``load_checkpoint`` reads either (a file is dense, a
directory sharded) into any layout. Both become visible only when complete, replace
only a checkpoint of ours (``files``), carry CRC-32s that make any damaged byte an
error (``integrity``) and load nothing but tensors and plain values (``files``,
``dcp_metadata``). ``latest_checkpoint`` finds the newest intact one in a directory
(``latest``), skipping damaged ones.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from gridtrain.engine.checkpoint import dense as dense_format
from gridtrain.engine.checkpoint import files, integrity, latest, pinned, writer
from gridtrain.engine.checkpoint import sharded as sharded_format
from gridtrain.engine.checkpoint.errors import (
    CheckpointError,
    CheckpointTargetError,
    CorruptCheckpointError,
    UnsafeCheckpointError,
)
from gridtrain.engine.checkpoint.writer import CheckpointFuture, on_rank0, wait_pending
from gridtrain.parallel.context import ParallelContext, get_context


def save_checkpoint(
    path: str | os.PathLike,
    epoch: int,
    model,
    optimizer=None,
    lr_scheduler=None,
    sharded: bool = False,
    async_save: bool = False,
    extra: Mapping[str, Any] | None = None,
    ctx: ParallelContext | None = None,
) -> CheckpointFuture | None:
    """Save model, optimizer state, LR scheduler, loss scaler, ``epoch`` and ``extra``.

    Collective: call on every rank. ``sharded=False``: one dense file, written by
    global rank 0 (fp32 master weights under naive fp16). ``sharded=True``: a
    directory in which every rank writes only the shards it owns, once per
    distinct shard, plus every rank's RNG states (so a resume draws the same
    dropout masks). ``async_save=True`` (sharded only) returns once this rank's
    state is copied aside, writes in the background and returns a
    :class:`CheckpointFuture`; the checkpoint appears at ``path`` when complete.
    ``extra`` is a dict of plain values (numbers, strings, lists, dicts,
    tensors), e.g. a data-loader position; ``load_checkpoint(extra=d)`` fills ``d``.
    A ``path`` that exists and is not a checkpoint of ours (nor an empty directory) is
    refused with :class:`CheckpointTargetError` before anything is written.
    """
    if not isinstance(path, str | os.PathLike):
        raise TypeError(f"save_checkpoint: path must be a str or os.PathLike, got {path!r}")
    if async_save and not sharded:
        raise ValueError("save_checkpoint: async_save=True needs sharded=True")
    if extra is not None and not isinstance(extra, Mapping):
        raise TypeError(f"save_checkpoint: extra must be a dict, got {type(extra).__name__}")
    ctx = ctx or get_context()
    path = Path(path)
    if sharded:
        state = sharded_format.state_dict(model, optimizer, lr_scheduler, extra, ctx)
        future = writer.save(path, epoch, state, ctx, async_save)
        return future if async_save else None

    wait_pending()
    on_rank0(lambda: files.check_target(path), ctx)  # before gathering anything
    payload = dense_format.payload(model, optimizer, lr_scheduler, epoch, dict(extra or {}), ctx)
    on_rank0(lambda: dense_format.write(path, payload), ctx)
    return None


def load_checkpoint(
    path: str | os.PathLike,
    model,
    optimizer=None,
    lr_scheduler=None,
    ctx: ParallelContext | None = None,
    *,
    extra: dict | None = None,
) -> int:
    """Load a checkpoint saved under any layout into this one; returns its epoch.

    Collective. A file is the dense format, a directory the sharded one; each
    rank reads its own shards. The optimizer must hold the same parameters in
    the same groups as the one saved (matched by dense name); its state is
    rebuilt from the checkpoint, so it need not have stepped. RNG states come
    back when the layout is the one saved. ``extra``: a dict that receives the
    saved ``extra``. Files holding anything but tensors and plain values are
    refused (:class:`UnsafeCheckpointError`), before anything runs; files whose
    bytes are not the ones written (truncated, altered) are
    :class:`CorruptCheckpointError`. Both are :class:`CheckpointError`.
    """
    ctx = ctx or get_context()
    path = Path(path)
    wait_pending()
    if path.is_dir():
        return sharded_format.load(path, model, optimizer, lr_scheduler, extra, ctx)
    if not path.is_file():
        raise FileNotFoundError(f"load_checkpoint: no checkpoint at '{path}'")

    def read(root: Path) -> int:  # the file every rank opened (pinned): one version of it
        error = None
        try:
            integrity.verify_dense(root, f"load_checkpoint: '{path}'")
        except (CheckpointError, OSError) as err:
            error = err
        pinned.agree(error, ctx)
        return dense_format.load(root, model, optimizer, lr_scheduler, extra, ctx, path)

    return pinned.load(path, ctx, read)


def full_optimizer_state_dict(
    model, optimizer, ctx: ParallelContext | None = None
) -> dict[str, Any]:
    """The optimizer's state as the model built with no parallelism would hold it.

    ``{"state": {dense parameter name: {key: value}}, "param_groups": [hyperparameters],
    "group_of": {dense parameter name: group index}}``: every state tensor shaped as its
    dense parameter (plain CPU tensors; scalars such as a step count as they are), the
    dense checkpoint's ``"optimizer"`` entry. The same in every layout (tensor modes,
    pipeline stages, experts, ZeRO 1-3, Gemini; the fp32 masters' state under naive fp16),
    on every rank. Collective: call on every rank.
    """
    return dense_format.dense_optimizer_state(optimizer, model, ctx or get_context())


def latest_checkpoint(directory: str | os.PathLike, verify: bool = True) -> Path | None:
    """The newest intact checkpoint directly in ``directory``, or None.

    Newest: the latest completed write (modification time of the file or of the
    sharded directory's completion marker), whatever the names; hidden entries
    (temporaries of saves in flight or interrupted) never count. Intact: every byte
    matches the CRC-32s written with it (this reads the whole checkpoint on the
    calling process). A newer checkpoint that is damaged (truncated, a byte changed, a
    shard missing, no completion marker) is skipped with a warning naming it and why,
    and the one before it is tried: an automatic resume falls back rather than fails.
    ``verify=False``: the newest complete one, its bytes unread.
    """
    return latest.newest_intact(directory, verify)


__all__ = [
    "CheckpointError",
    "CheckpointFuture",
    "CheckpointTargetError",
    "CorruptCheckpointError",
    "UnsafeCheckpointError",
    "full_optimizer_state_dict",
    "latest_checkpoint",
    "load_checkpoint",
    "save_checkpoint",
    "wait_pending",
]
