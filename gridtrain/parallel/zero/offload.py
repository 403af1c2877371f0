"""Gemini: ZeRO stage 3 with offload, ``zero = dict(stage=3, offload=True)``.

ZeRO-Offload's split (Ren et al., 2021) with Colossal-AI's chunks: what the step needs
(fp32 masters, Adam moments, gradients) lives in pinned host memory, partitioned over the
data-parallel group (each rank owns ``1/n`` of every parameter's rows, ``rows``);
the device holds only compute-dtype parameters, and only where they fit.

* **Chunks** (``offload_chunk``): one per unit (each block of a ``ModuleList`` or
  ``Sequential``, as ``fsdp.units`` picks them, and the root's own parameters), per
  data-parallel group. In forward order, chunks stay **resident** on the device while they
  fit ``device_param_mb``; the rest are **streamed**: fetched before the unit's forward and
  its backward, the next one prefetched on a side stream, and freed after each use.
* **Forward and backward** use the compute tensors: they are registered in the modules
  for the duration of the model's forward and of each backward, and the masters are put
  back after, so at rest ``model.parameters()`` are the masters (this rank's rows, tagged
  like every ZeRO shard): ``gt.full_state_dict``, both checkpoint formats and the optimizer
  see plain per-rank shards.
* **Gradients** leave the device chunk by chunk as the backward finishes them (in the
  backward's order, strictly, so every rank issues the same collectives; under an
  interleaved pipeline each backward reaches one pipeline chunk's Gemini chunks, its
  ``lane``, and sends only those): reduce-scattered
  in fp32 over the group, copied to the chunk's pinned host segment on a side stream and,
  within an accumulation window, summed there in fp32. The device never holds a whole
  gradient; every backward communicates (there is nowhere to keep partial sums).
* **The step** is the user's optimizer on the host masters; Adam and AdamW are switched to
  torch's fused CPU kernel (vectorised, multi-threaded: ~9x its foreach path on CPU).
  ``after_step`` then uploads each resident chunk on a side stream while the host goes on
  to the next, and the next forward waits only for the chunk it needs.

Writes into the masters from outside (loading a checkpoint or a state dict) are seen by
their version counter, and the device copies are refreshed before the next forward.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.autograd import Variable
from torch.autograd.graph import register_multi_grad_hook
from torch.optim import Optimizer
from torch.utils._pytree import tree_flatten, tree_map

from gridtrain.config import AMP_TYPE, ConfigError
from gridtrain.parallel import comm
from gridtrain.parallel.context import ParallelContext
from gridtrain.parallel.optimizer_rebind import rebind_optimizer
from gridtrain.parallel.sync.base import GradSync
from gridtrain.parallel.sync.each_backward import pipeline_chunks
from gridtrain.parallel.tags import get_dp_mode
from gridtrain.parallel.zero.fsdp import units
from gridtrain.parallel.zero.memory import Source, grads, state_tensors
from gridtrain.parallel.zero.memory_rules import (
    GEMINI_STAGING_BUFFERS,
    GRADIENTS,
    MASTERS,
    OPTIMIZER_STATE,
    PARAMETERS,
    gemini_link_bytes,
)
from gridtrain.parallel.zero.offload_chunk import Chunk
from gridtrain.parallel.zero.offload_delayed import DelayedStep
from gridtrain.parallel.zero.offload_plan import compute_dtype, group_units, place
from gridtrain.parallel.zero.offload_setup import (
    device_full,
    fuse_on_cpu,
    host_full,
    move_state,
)
from gridtrain.parallel.zero.offload_streams import HostGrads, Streams, Uploads

logger = logging.getLogger("gridtrain")


class OffloadZero(GradSync):
    """Gemini for one engine: the chunks, their hooks, the gradient stream and the upload.

    As a ``GradSync``: gradients stream to the host during each backward, ``finish()``
    waits for them, ``after_step()`` uploads the stepped masters.
    """

    stage = 3
    allows_device_skip = False  # the optimizer steps host masters

    def __init__(
        self,
        model: nn.Module,
        optimizer: Optimizer,
        ctx: ParallelContext,
        amp: AMP_TYPE | None = None,
        device_param_mb: float | None = None,
        delayed_update: bool = False,
    ):
        self.ctx, self.model, self.amp = ctx, model, amp
        self.streams = Streams(ctx.device)
        blocks = units(model)
        groups = group_units(model, blocks, ctx)  # [(unit index, params)] in forward order
        self._lane_of = _lanes(groups, pipeline_chunks(model))
        compute = compute_dtype(amp, next(iter(model.parameters())).dtype)
        sizes = [sum(p.numel() for _, _, p in params) for _, params in groups]
        resident = place(sizes, compute, ctx.device, device_param_mb)
        self.chunks: list[Chunk] = []
        rebind_optimizer(optimizer, self._build_chunks(groups, resident, compute, optimizer))
        fuse_on_cpu(optimizer)
        _buffers_to_device(model, ctx.device, half=amp is AMP_TYPE.NAIVE)
        self._link(compute, bf16=amp is AMP_TYPE.BF16)
        self.bytes_h2d = self.bytes_d2h = 0  # counted per transfer (benchmarks/offload.py)
        self._init_backward_state()
        self._hooks(model, blocks)
        self.delayed = None
        if delayed_update:
            self._check_all_resident(device_param_mb)
            self.delayed = DelayedStep(optimizer, self._order)
            model.register_state_dict_pre_hook(lambda *_: self.delayed.wait())
        logger.info(
            "zero stage 3 offload (Gemini): %d chunks, %d resident (%.0f MiB of %s), "
            "%d streamed; masters and optimizer state in host memory, gradients sent in %s",
            len(self.chunks),
            sum(c.resident for c in self.chunks),
            sum(c.param_bytes() for c in self.chunks if c.resident) / 2**20,
            compute,
            sum(not c.resident for c in self.chunks),
            self.grad_dtype,
        )

    def _link(self, compute: torch.dtype, bf16: bool) -> None:
        """The host link's dtypes (``memory_rules.gemini_link_bytes``) and its pinned buffers:
        gradients land in ``host`` staging, resident masters are cast into ``uploads``."""
        master = self.chunks[0].master_dtype if self.chunks else torch.float32
        size = {torch.finfo(t).bits // 8: t for t in (master, compute)}
        grad_bytes, _ = gemini_link_bytes(size_of(compute), size_of(master), bf16=bf16)
        self.grad_dtype = size[grad_bytes]
        largest = max((c.segment for c in self.chunks), default=0)
        slots = GEMINI_STAGING_BUFFERS
        self.host = HostGrads(self.streams, largest, self.grad_dtype, slots, master)
        cast = [c.segment for c in self.chunks if _casts_upload(c)]
        pin = self.streams.cuda
        self.uploads = Uploads(max(cast), compute, slots, pin) if cast else None

    def _build_chunks(self, groups, resident, dtype, optimizer) -> dict[int, nn.Parameter]:
        """The chunks, each made from its parameters' values, which are then dropped; an
        allocation that fails names what fits (``offload_plan``'s bytes, as the estimate's)."""
        new_of: dict[int, nn.Parameter] = {}
        for (unit, params), keep in zip(groups, resident, strict=True):
            mode = get_dp_mode(params[0][2], self.ctx)
            try:
                chunk = Chunk(len(self.chunks), params, mode, self.ctx, dtype, keep, unit)
            except torch.OutOfMemoryError as e:
                raise device_full(self.chunks) from e
            except (MemoryError, RuntimeError) as e:
                if not isinstance(e, MemoryError) and "memory" not in str(e).lower():
                    raise
                raise host_full(self.chunks, groups) from e
            self.chunks.append(chunk)
            for slot, (_, _, p) in zip(chunk.slots, params, strict=True):
                new_of[id(p)] = slot.master
                move_state(optimizer, p, slot)
                p.data = torch.empty(0, dtype=p.dtype)  # the full fp32 copy is not kept
            chunk.swap(compute=False)
        return new_of

    def _check_all_resident(self, device_param_mb: float | None) -> None:
        streamed = [c for c in self.chunks if not c.resident]
        if streamed:
            need = sum(c.param_bytes() for c in self.chunks) / 2**20
            raise ConfigError(
                f"zero.delayed_update needs every chunk on the device ({len(streamed)} of "
                f"{len(self.chunks)} stream at device_param_mb {device_param_mb}): set "
                f"zero.device_param_mb to at least {need:.0f} or drop delayed_update"
            )

    # ---- hooks -------------------------------------------------------------------------
    def _hooks(self, model: nn.Module, blocks: list[nn.Module]) -> None:
        self._of_unit: dict[int, list[Chunk]] = {}
        for chunk in self.chunks:
            self._of_unit.setdefault(chunk.unit, []).append(chunk)
        self._units = [model, *blocks]  # unit 0 is the root
        model.register_forward_pre_hook(self._root_pre, with_kwargs=True, prepend=True)
        model.register_forward_hook(self._root_post)
        for i, block in enumerate(blocks, start=1):
            block.register_forward_pre_hook(lambda m, a, i=i: self._unit_pre(i, forward=True))
            block.register_forward_hook(lambda m, a, out, i=i: self._unit_post(i, out))
        self._chunk_of: dict[int, Chunk] = {}
        for chunk in self.chunks:
            for slot in chunk.slots:
                if slot.compute.requires_grad:
                    self._chunk_of[id(slot.compute)] = chunk
                    slot.compute.register_post_accumulate_grad_hook(self._on_grad)
        self._trainable = {
            c.index: sum(s.compute.requires_grad for s in c.slots) for c in self.chunks
        }

    def _swap(self, compute: bool) -> None:
        if self._swapped != compute:
            for chunk in self.chunks:
                chunk.swap(compute)
            self._swapped = compute

    def _root_pre(self, module, args, kwargs):
        self.refresh()
        self._swap(True)
        self._unit_pre(0, forward=True)
        if self.amp is AMP_TYPE.NAIVE:  # no autocast: floating inputs in fp16, as FSDP2's policy
            cast = _cast_floats(torch.float16)
            return tree_map(cast, args), tree_map(cast, kwargs)
        return None

    def _root_post(self, module, args, output):
        self._unit_post(0, output)
        self._swap(False)
        if self.amp is AMP_TYPE.NAIVE:
            return tree_map(_cast_floats(torch.float32), output)
        return None

    def _unit_pre(self, unit: int, forward: bool) -> None:
        """Before a unit's forward or backward: its chunks present, the next unit's prefetched."""
        for chunk in self._of_unit.get(unit, []):
            if not chunk.present:
                self._fetch(chunk)
            chunk.wait(self.streams)
        step = 1 if forward else -1
        nxt = unit + step
        while 0 < nxt < len(self._units):  # the root (0) is fetched by its own hooks
            chunks = self._of_unit.get(nxt, [])
            if any(not c.resident for c in chunks):
                for chunk in chunks:
                    if not chunk.present:
                        self._fetch(chunk)
                break
            nxt += step

    def _unit_post(self, unit: int, output) -> None:
        if torch.is_grad_enabled():
            outs = [t for t in tree_flatten(output)[0] if isinstance(t, Tensor) and t.requires_grad]
            if outs:
                register_multi_grad_hook(outs, lambda _, u=unit: self._pre_backward(u), mode="any")
        for chunk in self._of_unit.get(unit, []):
            chunk.release()

    def _pre_backward(self, unit: int) -> None:
        if not self._in_backward:
            self._in_backward = True
            Variable._execution_engine.queue_callback(self._end_backward)
        self._swap(True)  # activation checkpointing recomputes through the modules
        self._unit_pre(unit, forward=False)

    def _fetch(self, chunk: Chunk, src: Tensor | None = None) -> None:
        chunk.fetch(self.streams, src)
        self.bytes_h2d += chunk.segment * chunk.h2d_element_size()

    # ---- gradients ---------------------------------------------------------------------
    def _init_backward_state(self) -> None:
        self._swapped = False
        self._in_backward = False
        self._last = False
        self._count = {c.index: 0 for c in self.chunks}
        self._order = list(reversed(self.chunks))  # the backward's order
        self._lanes: dict[int, list[Chunk]] = {}  # pipeline chunk -> its chunks, backward order
        for c in self._order:
            self._lanes.setdefault(self._lane_of[c.index], []).append(c)
        self._next = dict.fromkeys(self._lanes, 0)
        self._touched: set[int] = {-1}  # lanes this backward reached; -1: several chunks'
        self._seen: dict[int, list[bool]] = {}  # chunk -> slots with a gradient this window
        self._finished = False

    def _on_grad(self, param: Tensor) -> None:
        chunk = self._chunk_of[id(param)]
        self._count[chunk.index] += 1
        lane = self._lane_of[chunk.index]
        self._touched.add(lane)
        self._advance(lane, until_end=False)

    def _advance(self, lane: int, until_end: bool) -> None:
        """Send the lane's chunks in the backward's order while complete (all: ``until_end``).

        A lane is one pipeline chunk's Gemini chunks (an interleaved stage's backward reaches
        one); every rank of a group runs the same schedule, so the same lanes, in order."""
        order = self._lanes.get(lane, [])
        while self._next[lane] < len(order):
            c = order[self._next[lane]]
            if not until_end and self._count[c.index] < self._trainable[c.index]:
                return
            self._launch(c)
            self._next[lane] += 1

    def _launch(self, chunk: Chunk) -> None:
        segment, had = chunk.reduce_grads(self.grad_dtype)
        seen = self._seen.setdefault(chunk.index, [False] * len(had))
        self._seen[chunk.index] = [a or b for a, b in zip(seen, had, strict=True)]
        if self.delayed is not None:  # the delayed step must be done with the last gradient
            self.delayed.wait_chunk(chunk.index)
        self.host.land(chunk.index, segment, chunk.grads)
        self.bytes_d2h += segment.numel() * segment.element_size()
        chunk.release()
        if chunk.pending and self._last:  # the backward is done with the stale copy
            self._sync_chunk(chunk)

    def _end_backward(self) -> None:
        """Queued by the backward's first hook: send what no hook sent (unused parameters),
        free streamed chunks, put the masters back; after the window's last backward the
        gradients are final on the host (a tied pipeline weight's handler sums them next)."""
        for lane in sorted(self._lanes):
            if lane in self._touched:
                self._advance(lane, until_end=True)
        for chunk in self.chunks:
            if chunk.pending and self._last:  # a lane this backward did not reach
                self.delayed.wait_chunk(chunk.index)
                self._sync_chunk(chunk)
            chunk.release()
        self._count = dict.fromkeys(self._count, 0)
        self._next = dict.fromkeys(self._lanes, 0)
        self._touched = {-1}
        self._in_backward = False
        self._swap(False)
        if self._last:
            self._finish_grads()

    @contextlib.contextmanager
    def around_backward(self, last: bool) -> Iterator[None]:
        """The window's last backward leaves the gradients final on the host."""
        self._last = last
        try:
            yield
        finally:
            self._last = False

    def finish(self) -> None:
        self._finish_grads()
        self._finished = False

    @torch.no_grad()
    def _finish_grads(self) -> None:
        """Wait for every copy and sum; each master's ``.grad`` views its host gradient
        (None where no rank of its group had one, as the dense model would leave it)."""
        if self._finished:
            return
        self.host.wait()
        seen = self._agreed_seen()
        for chunk in self.chunks:
            flags = seen.get(chunk.index, [False] * len(chunk.slots))
            for slot, had in zip(chunk.slots, flags, strict=True):
                grad = chunk.grads[slot.seg : slot.seg + slot.owned].view(slot.master.shape)
                slot.master.grad = grad if had and slot.master.requires_grad else None
        self._seen = {}
        self._finished = True

    def _agreed_seen(self) -> dict[int, list[bool]]:
        by_mode: dict = {}
        for chunk in self.chunks:
            if chunk.n > 1:
                by_mode.setdefault(chunk.mode, []).append(chunk)
        seen = dict(self._seen)
        for mode, chunks in by_mode.items():
            flags = [f for c in chunks for f in seen.get(c.index, [False] * len(c.slots))]
            agreed = torch.tensor(flags, dtype=torch.float32, device=self.ctx.device)
            comm.all_reduce_(agreed, self.ctx.group(mode), op=dist.ReduceOp.MAX)
            values = agreed.bool().tolist()
            for c in chunks:
                seen[c.index], values = values[: len(c.slots)], values[len(c.slots) :]
        return seen

    # ---- after the step ----------------------------------------------------------------
    @torch.no_grad()
    def after_step(self) -> None:
        """Upload the stepped masters: each resident chunk on the side stream, in forward order,
        while the host casts the next streamed chunk's copy. A delayed step uploads each chunk
        in the next window's last backward instead."""
        delayed = self.delayed is not None and self.delayed.pending
        for chunk in self.chunks:
            if delayed:
                chunk.pending = True
            else:
                self._sync_chunk(chunk)

    def refresh(self) -> None:
        """Rebuild the device copies of chunks whose masters were written since (a load). A
        forward without gradients (evaluation) also takes a delayed step's result now."""
        if self.delayed is not None and not torch.is_grad_enabled():
            self.delayed.wait()
            for chunk in self.chunks:
                if chunk.pending:
                    self._sync_chunk(chunk)
        for chunk in self.chunks:
            if not chunk.pending and chunk.masters._version != chunk.synced_version:
                self._sync_chunk(chunk)

    def _sync_chunk(self, chunk: Chunk) -> None:
        chunk.home_from_masters()
        if chunk.resident and self.uploads is not None and _casts_upload(chunk):
            src, slot = self.uploads.cast(chunk.masters)  # the link carries the compute dtype
            self._fetch(chunk, src)
            self.uploads.uploaded(slot, chunk.ready)
        elif chunk.resident:
            self._fetch(chunk)
        chunk.synced_version = chunk.masters._version
        chunk.pending = False

    def masters(self) -> list[tuple[Tensor, Tensor]]:
        return []  # the model's parameters are the masters

    @property
    def units(self) -> list[nn.Module]:
        """The modules whose chunks are fetched around their forward and backward (the root
        first)."""
        return self._units

    def set_probe(self, probe) -> None:
        super().set_probe(probe)
        for chunk in self.chunks:
            chunk.probe = probe

    def buffers(self) -> list[tuple[str, Tensor]]:
        return [(GRADIENTS, c.send) for c in self.chunks if c.send is not None]

    def memory_sources(self, model: nn.Module, optimizer) -> list[Source]:
        """The device copies (and streamed chunks' host copies) as parameters; the host rows
        of masters, gradients (and the staging buffers of accumulation) and optimizer state;
        the device's gradients of a backward."""
        compute = [s.compute for c in self.chunks for s in c.slots]
        homes = [c.home for c in self.chunks if c.home is not None]
        homes += self.uploads.buffers if self.uploads is not None else []
        return [
            (PARAMETERS, compute, False),
            (PARAMETERS, homes, True),
            (MASTERS, [c.masters for c in self.chunks], True),
            (GRADIENTS, grads(compute), False),
            (GRADIENTS, [c.grads for c in self.chunks] + self.host.staging, True),
            (OPTIMIZER_STATE, state_tensors(optimizer), True),
        ]

    def memory_report(self) -> dict[str, int]:
        """Bytes held now: compute-dtype parameters on the device (resident chunks, and streamed
        ones while fetched) and host segments (masters, gradients, streamed copies)."""
        device = sum(c.param_bytes() for c in self.chunks if c.present)
        host = sum(
            t.numel() * t.element_size()
            for c in self.chunks
            for t in (c.masters, c.grads, c.home)
            if t is not None
        )
        return {"device_params": device, "host_segments": host}

    def transfer_bytes(self) -> dict[str, int]:
        """Bytes copied host-to-device and device-to-host since the engine was built."""
        return {"h2d": self.bytes_h2d, "d2h": self.bytes_d2h}


def size_of(dtype: torch.dtype) -> int:
    return torch.finfo(dtype).bits // 8


def _casts_upload(chunk: Chunk) -> bool:
    """A resident chunk whose device copy is narrower than its masters: cast on the host."""
    return chunk.home is None and chunk.upload_dtype != chunk.master_dtype


def _buffers_to_device(model: nn.Module, device: torch.device, half: bool) -> None:
    """Buffers compute on the device (naive fp16: in fp16, as the whole model); parameters
    do not move."""
    for module in model.modules():
        for name, buf in module._buffers.items():
            if buf is not None:
                dtype = torch.float16 if half and buf.is_floating_point() else buf.dtype
                module._buffers[name] = buf.to(device, dtype)


def _lanes(groups, chunk_of: dict[int, int]) -> dict[int, int]:
    """Gemini chunk index -> the pipeline chunk of its parameters (0 without interleaving,
    -1 for parameters of several)."""
    out = {}
    for index, (_, params) in enumerate(groups):
        found = {chunk_of.get(id(p), 0) for _, _, p in params}
        out[index] = found.pop() if len(found) == 1 else -1
    return out


def _cast_floats(dtype: torch.dtype):
    def cast(t):
        return t.to(dtype) if isinstance(t, Tensor) and t.is_floating_point() else t

    return cast
