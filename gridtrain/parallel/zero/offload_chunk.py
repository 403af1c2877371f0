"""Gemini's chunk: the parameters of one unit (a block, or the root's own), laid out twice.

* On the device, **param-major** in the compute dtype (bf16 or fp16 under amp, the
  parameters' own dtype otherwise): one flat buffer whose views are the tensors the model
  computes with. A resident chunk keeps it; a streamed one fills it before each use and
  frees its storage after (``fetch``/``release``), FSDP2's trick, so the views stay valid.
* On the host, this rank's **row segment** (``rows``): for each parameter the rows it
  owns, padded to ``ceil(rows / n)``, parameter after parameter. The fp32 masters (the
  model's parameters at rest, ZeroRows-tagged) and their gradients are views of two pinned
  segments; a streamed chunk whose compute dtype differs also keeps a compute-dtype copy of
  its segment (``home``) to fetch from.

The row segment is what a reduce-scatter of the n-fold rank-major gradient buffer yields
(``row_buckets.RowShard`` lays it out), and an all-gather of the n segments is the buffer
the device copy is unpacked from; with one data rank both layouts coincide.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from gridtrain.parallel.comm import all_gather_single, reduce_scatter_single
from gridtrain.parallel.context import ParallelContext
from gridtrain.parallel.mode import ParallelMode
from gridtrain.parallel.rows import as_rows, set_zero_rows
from gridtrain.parallel.tags import copy_tags
from gridtrain.parallel.zero.offload_plan import ChunkShape
from gridtrain.parallel.zero.offload_streams import Streams, host_buffer
from gridtrain.parallel.zero.row_buckets import RowShard, chunks_to_rows, rows_to_chunks

Ref = tuple[nn.Module, str]  # a module and the attribute name it registers a parameter under


def master_dtype(dtype: torch.dtype) -> torch.dtype:
    """The optimizer's dtype for a parameter of ``dtype``: fp32, or fp64 for an fp64 model."""
    return dtype if dtype in (torch.float32, torch.float64) else torch.float32


class Slot:
    """One parameter of a chunk: where it is registered, its rows, its two offsets."""

    def __init__(self, name: str, refs: list[Ref], param: Tensor, offset: int, seg: int, n, r):
        self.name, self.refs, self.shape = name, refs, tuple(param.shape)
        self.numel, self.offset, self.seg = param.numel(), offset, seg
        self.shard = RowShard(param, param, ParallelMode.DATA, n, r, is_view=False)
        self.master: nn.Parameter | None = None
        self.compute: nn.Parameter | None = None

    @property
    def owned(self) -> int:
        return (self.shard.hi - self.shard.lo) * self.shard.row_numel


class Chunk:
    """The parameters of one unit over one data-parallel group (see the module docstring)."""

    probe = staticmethod(lambda: None)  # engine.memory()'s sample point: the send buffer held
    send: Tensor | None = None

    def __init__(
        self,
        index: int,
        params: list[tuple[str, list[Ref], Tensor]],
        mode: ParallelMode,
        ctx: ParallelContext,
        compute_dtype: torch.dtype,
        resident: bool,
        unit: int = 0,
    ):
        self.index, self.mode, self.resident, self.unit = index, mode, resident, unit
        self.n, rank = ctx.world_size(mode), ctx.local_rank(mode)
        self.group = ctx.group(mode) if self.n > 1 else None
        self.device, self.compute_dtype = ctx.device, compute_dtype
        self.master_dtype = master_dtype(params[0][2].dtype)
        self.slots: list[Slot] = []
        offset = seg = 0
        for name, refs, p in params:
            slot = Slot(name, refs, p, offset, seg, self.n, rank)
            self.slots.append(slot)
            offset, seg = offset + slot.numel, seg + slot.shard.padded
        self.numel, self.segment = offset, seg
        pin = ctx.device.type == "cuda"
        self.masters = host_buffer(seg, self.master_dtype, pin)
        self.grads = host_buffer(seg, self.master_dtype, pin)
        separate = not resident and compute_dtype != self.master_dtype
        self.home = host_buffer(seg, compute_dtype, pin) if separate else None
        self.flat = torch.empty(self.numel, dtype=compute_dtype, device=ctx.device)
        self.present = True  # the device buffer holds storage
        self.ready = None  # event: the last fetch or upload into ``flat`` is done
        self.synced_version = -1  # ``masters._version`` when the device copy was last made
        self.pending = False  # a delayed step's result waits for the next window's backward
        for slot, (_, _, p) in zip(self.slots, params, strict=True):
            self._bind(slot, p, ctx)
        self.synced_version = self.masters._version
        if not resident:
            self.home_from_masters()
            self.release()

    @torch.no_grad()
    def _bind(self, slot: Slot, p: Tensor, ctx: ParallelContext) -> None:
        """Make the slot's master (this rank's rows) and compute tensor from ``p``'s values."""
        s = slot.shard
        owned = as_rows(p.data)[s.lo : s.hi]
        view = self.masters[slot.seg : slot.seg + slot.owned].view(owned.shape)
        view.copy_(owned)
        master = nn.Parameter(view, requires_grad=p.requires_grad)
        copy_tags(p, master)
        set_zero_rows(master, self.mode, s.lo, s.rows)
        flat = self.flat[slot.offset : slot.offset + slot.numel]
        flat.copy_(p.data.reshape(-1))
        compute = nn.Parameter(flat.view(slot.shape), requires_grad=p.requires_grad)
        copy_tags(p, compute)
        slot.master, slot.compute = master, compute

    # ---- placing the compute tensors in the model -------------------------------------------
    def swap(self, compute: bool) -> None:
        """Register the compute tensors (``True``) or the masters in every module using them."""
        for slot in self.slots:
            t = slot.compute if compute else slot.master
            for module, attr in slot.refs:
                module._parameters[attr] = t

    def param_bytes(self) -> int:
        return self.numel * torch.finfo(self.compute_dtype).bits // 8

    @property
    def upload_dtype(self) -> torch.dtype:
        """What a fetch or upload copies from the host: the compute dtype where it is narrower
        than the masters (``home``, or the masters cast on the host), else the masters'."""
        narrower = torch.finfo(self.compute_dtype).bits < torch.finfo(self.master_dtype).bits
        return self.compute_dtype if narrower else self.master_dtype

    def h2d_element_size(self) -> int:
        """Bytes per element a fetch or upload copies from the host."""
        return torch.finfo(self.upload_dtype).bits // 8

    def shape(self) -> ChunkShape:
        return ChunkShape(self.segment, self.numel, self.resident)

    # ---- host to device --------------------------------------------------------------------
    @torch.no_grad()
    def home_from_masters(self) -> None:
        """After the masters changed: the compute-dtype copy a streamed chunk fetches from."""
        if self.home is not None:
            self.home.copy_(self.masters)

    @torch.no_grad()
    def fetch(self, streams: Streams, src: Tensor | None = None) -> None:
        """Fill the device copy from this rank's host segment (and the group's, all-gathered):
        ``src``, else ``home`` or the masters.

        Everything runs on the host-to-device stream after the compute stream's queued work
        (which may still read the old values); ``ready`` marks the end."""
        if not self.present:
            self.flat.untyped_storage().resize_(self.numel * self.flat.element_size())
            self.present = True
        if src is None:
            src = self.home if self.home is not None else self.masters
        buf = self.flat.data  # a new version counter: autograd's saved views must not see writes
        with streams.h2d_after_compute():
            seg = src.to(self.device, non_blocking=True)
            if self.n == 1:
                buf.copy_(seg)
            else:
                seg = seg.to(self.compute_dtype)
                out = seg.new_empty(self.n * self.segment)
                all_gather_single(out, seg, group=self.group)
                rank_major = out.view(self.n, self.segment)
                for slot in self.slots:
                    s = slot.shard
                    part = rank_major[:, slot.seg : slot.seg + s.padded]
                    dst = buf[slot.offset : slot.offset + slot.numel]
                    chunks_to_rows(s.chunks(part, self.n), dst.view(s.rows, s.row_numel), s)
            self.ready = streams.record_h2d()
        self.synced_version = self.masters._version

    def wait(self, streams: Streams) -> None:
        """Make the compute stream wait for the last fetch or upload."""
        streams.compute_waits(self.ready)
        self.ready = None

    def release(self) -> None:
        """Free a streamed chunk's device storage (its views keep their shapes)."""
        if self.present and not self.resident:
            self.flat.untyped_storage().resize_(0)
            self.present = False

    # ---- device to host -------------------------------------------------------------------
    @torch.no_grad()
    def reduce_grads(self, dtype: torch.dtype) -> tuple[Tensor, list[bool]]:
        """This rank's rows of the group's mean gradient, as a device segment in ``dtype`` (the
        link's; compute tensors' gradients dropped); and which slots had a gradient here. A
        group of several ranks sums in the masters' dtype, then casts its rows."""
        reduce = self.master_dtype if self.n > 1 else dtype
        send = torch.zeros(self.n * self.segment, dtype=reduce, device=self.device)
        self.send = send  # held until reduced: engine.memory() counts it at the probe
        self.probe()
        rank_major = send.view(self.n, self.segment)
        had = []
        for slot in self.slots:
            g = slot.compute.grad
            had.append(g is not None)
            if g is None:
                continue
            s = slot.shard
            dst = s.chunks(rank_major[:, slot.seg : slot.seg + s.padded], self.n)
            rows_to_chunks(g.reshape(s.rows, s.row_numel), dst, s)
            slot.compute.grad = None
        self.send = None
        if self.n == 1:
            return send, had
        send.div_(self.n)  # the sum of the quotients is the mean (as the stage 1-2 buckets)
        out = send.new_empty(self.segment)
        reduce_scatter_single(out, send, group=self.group)
        return out.to(dtype), had
