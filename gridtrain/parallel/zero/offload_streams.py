"""Gemini's transfers: CUDA streams and events for the copies, and the host side of gradients.

Host-to-device copies (fetches, uploads after the step) run on one side stream and
device-to-host gradient copies on another, so both overlap the compute stream: a side
stream first waits for the compute stream's queued work (which may still read a buffer
being replaced), and the compute stream waits for a copy's event only where it uses the
result. On the CPU (gloo CI) the same calls copy at once, so the logic is exercised.

Gradients reach the host once per backward, chunk by chunk, in the link's dtype
(``memory_rules.gemini_link_bytes``: bf16 in a bf16 run). Where that is the host rows' own
dtype, the window's first one is copied straight into the chunk's pinned gradient segment;
every other one (a bf16 row, a later micro-step or pipeline micro-batch) lands in a pinned
staging buffer and a host thread copies or adds it in, in fp32, as the dense model
accumulates ``.grad``. Uploads of masters whose device copy is narrower (``Uploads``) are
cast on the host into pinned compute-dtype buffers first, so the link carries the compute
dtype.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import torch
from torch import Tensor


def host_buffer(numel: int, dtype: torch.dtype, pin: bool) -> Tensor:
    """A zeroed host tensor, page-locked for asynchronous copies when ``pin``.

    Registered with ``cudaHostRegister`` rather than taken from torch's pinned allocator,
    which rounds every block up to a power of two: a 600 MB chunk segment would hold 1 GiB,
    and the host memory that bounds the model size would be 1.7x what it stores."""
    t = torch.zeros(numel, dtype=dtype)
    if pin and numel:
        cudart = torch.cuda.cudart()
        ptr = t.data_ptr()
        code = int(cudart.cudaHostRegister(ptr, numel * t.element_size(), 0))
        if code != 0:
            raise MemoryError(f"cudaHostRegister of {numel * t.element_size()} bytes: error {code}")
        weakref.finalize(t, cudart.cudaHostUnregister, ptr)
    return t


class Streams:
    """The side streams of one device (none on the CPU)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.h2d = torch.cuda.Stream(device) if self.cuda else None
        self.d2h = torch.cuda.Stream(device) if self.cuda else None

    @contextlib.contextmanager
    def h2d_after_compute(self) -> Iterator[None]:
        """Run the body on the host-to-device stream, after the compute stream's queued work."""
        if not self.cuda:
            yield
            return
        self.h2d.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.h2d):
            yield

    def record_h2d(self):
        return self.h2d.record_event() if self.cuda else None

    def compute_waits(self, event) -> None:
        if event is not None:
            torch.cuda.current_stream().wait_event(event)

    def to_host(self, device_tensor: Tensor, host: Tensor):
        """Copy ``device_tensor`` into pinned ``host`` once the compute stream has made it;
        returns the copy's event (None on the CPU, where it is done)."""
        if not self.cuda:
            host.copy_(device_tensor)
            return None
        self.d2h.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.d2h):
            host.copy_(device_tensor, non_blocking=True)
            device_tensor.record_stream(self.d2h)  # the allocator keeps it until the copy ends
            return self.d2h.record_event()


class HostGrads:
    """Lands each chunk's gradient segment in its pinned host buffer, summing within a window;
    ``dtype``: the segments' as they arrive (the link's), the host rows may be wider."""

    def __init__(
        self, streams: Streams, staging_numel: int, dtype: torch.dtype, slots: int, host_dtype
    ):
        self.streams = streams
        pin = streams.cuda
        self.direct = dtype == host_dtype  # the window's first copy needs no host pass
        self._staging = [host_buffer(staging_numel, dtype, pin) for _ in range(slots)]
        self._busy: list[Future | None] = [None] * slots
        self._next = 0
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="gt-offload") if pin else None
        self._pending: list = []  # events and futures to wait for before the step
        self.started: set[int] = set()  # chunks whose segment holds this window's sum so far

    @property
    def staging(self) -> list[Tensor]:
        """The pinned buffers later gradients of a window land in before they are summed."""
        return list(self._staging)

    def land(self, index: int, device_segment: Tensor, host_segment: Tensor) -> None:
        """The window's first gradient of chunk ``index`` replaces its host segment's values;
        a later one is added to them."""
        first = index not in self.started
        self.started.add(index)
        if first and self.direct:
            self._pending.append(self.streams.to_host(device_segment, host_segment))
            return
        slot = self._next
        self._next = (slot + 1) % len(self._staging)
        if self._busy[slot] is not None:
            self._busy[slot].result()  # its earlier sum is done: the buffer is free
        staging = self._staging[slot][: host_segment.numel()]
        event = self.streams.to_host(device_segment, staging)
        if self._pool is None:
            _add_after(None, host_segment, staging, first)
            return
        future = self._pool.submit(_add_after, event, host_segment, staging, first)
        self._busy[slot] = future
        self._pending.append(future)

    def wait(self) -> None:
        """Every copy and sum launched so far is done; the next window starts afresh."""
        for item in self._pending:
            if isinstance(item, Future):
                item.result()
            elif item is not None:
                item.synchronize()
        self._pending.clear()
        self._busy = [None] * len(self._busy)
        self.started.clear()


def _add_after(event, host_segment: Tensor, staging: Tensor, first: bool) -> None:
    if event is not None:
        event.synchronize()
    if first:
        host_segment.copy_(staging)
    else:
        host_segment.add_(staging)


class Uploads:
    """Pinned compute-dtype buffers the masters are cast into before an upload, used in
    turn: the host casts one chunk while the previous one's copy runs."""

    def __init__(self, numel: int, dtype: torch.dtype, slots: int, pin: bool):
        self._buffers = [host_buffer(numel, dtype, pin) for _ in range(slots)]
        self._events: list = [None] * slots
        self._next = 0

    @property
    def buffers(self) -> list[Tensor]:
        return list(self._buffers)

    @torch.no_grad()
    def cast(self, masters: Tensor) -> tuple[Tensor, int]:
        """``masters`` cast into the next free buffer: ``(the copy, its slot)``."""
        slot = self._next
        self._next = (slot + 1) % len(self._buffers)
        if self._events[slot] is not None:
            self._events[slot].synchronize()  # its last upload has left the buffer
            self._events[slot] = None
        out = self._buffers[slot][: masters.numel()]
        out.copy_(masters)
        return out, slot

    def uploaded(self, slot: int, event) -> None:
        """The upload from ``slot`` ends at ``event`` (None: done)."""
        self._events[slot] = event
