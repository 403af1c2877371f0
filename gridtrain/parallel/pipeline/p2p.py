"""Point-to-point transfers between adjacent pipeline stages, with shape and dtype exchange.

Every transfer is one call of ``PipelineP2P.communicate`` (Megatron's
``_communicate``): activations go to the next stage, gradients to the previous
one, both posted in one ``dist.batch_isend_irecv`` so that the matching calls of
two neighbours cannot deadlock (gloo and NCCL alike). The next/previous stage
wraps round, which the interleaved schedule needs (last stage -> first stage);
a pipeline of one stage hands its messages to itself.

The receiver of an activation does not know its shape, so unless a fixed
``tensor_shape`` is configured, the sender first sends a small int64 header
(number of tensors, and per tensor its dtype, rank and sizes). Receiving a
header costs a round of its own (the data buffers are posted only once it is
in), and on gloo each round is a thread wake-up on both sides. The micro-batches
of one step are equal slices of the batch, so their activations have equal
shapes: the schedules name each activation stream (``send_key``/``recv_key``,
the virtual stage that receives it) and a keyed stream carries its header with
its first message after ``new_step()`` only; later messages of the step reuse
the shapes. Unkeyed messages always carry a header. A header that is sent but
none received this exchange goes in the data batch (no round of its own).
Gradients need no header: they have the shapes of the activations their
receiver sent. A stage may pass a tuple of tensors (e.g. hidden states and a
mask); only floating tensors carry gradients back.
"""

from __future__ import annotations

import weakref
from collections import deque
from collections.abc import Hashable

import torch
import torch.distributed as dist
from torch import Tensor

from gridtrain.parallel.context import ParallelContext
from gridtrain.parallel.mode import ParallelMode

Payload = Tensor | tuple[Tensor, ...] | None
Spec = tuple[list[tuple[torch.Size, torch.dtype]], bool]  # (shape, dtype) per tensor, is_tuple

MAX_TENSORS = 8
MAX_DIMS = 8
_HEADER = 2 + MAX_TENSORS * (2 + MAX_DIMS)  # count, is_tuple, then (dtype, ndim, sizes...)
_DTYPES = [
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.int64,
    torch.int32,
    torch.bool,
    torch.uint8,
    torch.int8,
    torch.int16,
]


def as_tuple(x: Payload) -> tuple[Tensor, ...]:
    if x is None:
        return ()
    return x if isinstance(x, tuple) else (x,)


def _encode(tensors: tuple[Tensor, ...], is_tuple: bool, device: torch.device) -> Tensor:
    if len(tensors) > MAX_TENSORS:
        raise ValueError(
            f"a pipeline stage may send at most {MAX_TENSORS} tensors, got {len(tensors)}"
        )
    header = torch.zeros(_HEADER, dtype=torch.int64)
    header[0], header[1] = len(tensors), int(is_tuple)
    for i, t in enumerate(tensors):
        if not isinstance(t, Tensor):
            raise TypeError(
                f"a pipeline stage must output tensors (or a tuple of them), got {type(t).__name__}"
            )
        if t.dtype not in _DTYPES or t.dim() > MAX_DIMS:
            raise ValueError(
                f"cannot send a {t.dtype} tensor of {t.dim()} dims between pipeline stages "
                f"(dtypes {_DTYPES}, at most {MAX_DIMS} dims)"
            )
        at = 2 + i * (2 + MAX_DIMS)
        header[at], header[at + 1] = _DTYPES.index(t.dtype), t.dim()
        header[at + 2 : at + 2 + t.dim()] = torch.tensor(t.shape, dtype=torch.int64)
    return header.to(device)


def _decode(header: Tensor) -> Spec:
    h = header.tolist()
    specs = []
    for i in range(h[0]):
        at = 2 + i * (2 + MAX_DIMS)
        dtype, ndim = _DTYPES[h[at]], h[at + 1]
        specs.append((torch.Size(h[at + 2 : at + 2 + ndim]), dtype))
    return specs, bool(h[1])


_WARMED: weakref.WeakSet = weakref.WeakSet()


def _spec(tensors: tuple[Tensor, ...], is_tuple: bool) -> Spec:
    return [(getattr(t, "shape", None), getattr(t, "dtype", None)) for t in tensors], is_tuple


class PipelineP2P:
    """Sends and receives between this rank and its pipeline neighbours.

    ``tensor_shape`` (``parallel.pipeline.tensor_shape``) skips the header: every
    activation then has that shape and is sent as ``dtype``. ``rounds`` counts the
    ``batch_isend_irecv`` calls (each waits for a message), for benchmarks.
    """

    def __init__(
        self,
        ctx: ParallelContext,
        tensor_shape: tuple[int, ...] | None = None,
        dtype: torch.dtype = torch.float32,
    ):
        self.ctx = ctx
        self.group = ctx.group(ParallelMode.PIPELINE)
        self.next_rank = ctx.next_global_rank(ParallelMode.PIPELINE)
        self.prev_rank = ctx.prev_global_rank(ParallelMode.PIPELINE)
        self.device = ctx.device
        self.tensor_shape = tuple(tensor_shape) if tensor_shape else None
        self.dtype = dtype
        self.rounds = 0
        self._sent: dict[Hashable, Spec] = {}  # send_key -> shapes whose header went this step
        self._received: dict[Hashable, Spec] = {}  # recv_key -> shapes received this step
        # a pipeline of one stage (interleaved chunks on one device) sends to itself: a queue
        self.loopback = ctx.world_size(ParallelMode.PIPELINE) == 1
        self._loop: dict[str, deque] = {"act": deque(), "grad": deque()}
        if ctx not in _WARMED:
            # NCCL: the first call on a group must involve all its ranks, and
            # batch_isend_irecv between two of them would not; a collective does.
            dist.barrier(group=self.group)
            _WARMED.add(ctx)

    def new_step(self) -> None:
        """Forget the streams' shapes: the next message of every keyed stream carries a header.

        Every rank of the pipeline calls it at the same point (a schedule: when a step
        starts), so that sender and receiver agree which message has a header. A step that
        raised may have left messages to itself in the loop-back queues: they go too."""
        self._sent.clear()
        self._received.clear()
        for queue in self._loop.values():
            queue.clear()

    def _batch(self, ops: list[dist.P2POp]) -> None:
        if ops:
            for req in dist.batch_isend_irecv(ops):
                req.wait()
            self.rounds += 1

    def _header_out(self, fwd: tuple[Tensor, ...], is_tuple: bool, key: Hashable) -> Tensor | None:
        """The header to send before ``fwd`` (None: its stream's receiver has the shapes)."""
        if key is None or key not in self._sent:
            header = _encode(fwd, is_tuple, self.device)  # checks the types
            if key is not None:
                self._sent[key] = _spec(fwd, is_tuple)
            return header
        if _spec(fwd, is_tuple) != self._sent[key]:
            # the receiver allocates the shapes of the stream's first message: fail loudly
            raise ValueError(
                f"pipeline stage output changed within one step: {_spec(fwd, is_tuple)} after "
                f"{self._sent[key]}; the micro-batches of a step must give equal shapes"
            )
        return None

    def communicate(
        self,
        send_next: Payload = None,
        send_prev: Payload = None,
        recv_prev: bool = False,
        recv_next_like: Payload = None,
        send_key: Hashable | None = None,
        recv_key: Hashable | None = None,
    ) -> tuple[Payload, Payload]:
        """One exchange with both neighbours; returns (from previous, from next).

        ``send_next``: activations for the next stage. ``send_prev``: gradients for
        the previous stage. ``recv_prev``: receive activations from the previous
        stage. ``recv_next_like``: the activations this rank sent whose gradients
        it now receives from the next stage (their shapes; None = no receive).
        ``send_key``/``recv_key``: the activation streams sent and received on (the
        same name on both ends; see the module docstring); None: a header each time.
        """
        fwd = as_tuple(send_next)
        if send_next is not None and self.tensor_shape is not None:
            fwd = tuple(t.to(self.dtype) for t in fwd)
        if self.loopback:
            return self._loop_back(send_next, fwd, send_prev, recv_prev, recv_next_like)
        ops: list[dist.P2POp] = []  # the data batch
        header_out = None
        if send_next is not None and self.tensor_shape is None:
            header_out = self._header_out(fwd, isinstance(send_next, tuple), send_key)
        recv_specs, header_out = self._recv_specs(recv_prev, recv_key, header_out)
        if header_out is not None:  # messages to one peer match in posting order: header first
            ops.append(dist.P2POp(dist.isend, header_out, self.next_rank, self.group))

        for t in fwd:
            ops.append(dist.P2POp(dist.isend, t.detach().contiguous(), self.next_rank, self.group))
        from_prev = [torch.empty(s, dtype=d, device=self.device) for s, d in recv_specs[0]]
        for t in from_prev:
            ops.append(dist.P2POp(dist.irecv, t, self.prev_rank, self.group))
        for g in as_tuple(send_prev):
            ops.append(dist.P2POp(dist.isend, g.contiguous(), self.prev_rank, self.group))
        # fresh contiguous buffers: empty_like would copy a view's strides (transposed or
        # expanded stage outputs), and batch_isend_irecv takes contiguous tensors only
        from_next = [
            torch.empty(
                t.shape, dtype=self.dtype if self.tensor_shape else t.dtype, device=self.device
            )
            for t in as_tuple(recv_next_like)
            if t.is_floating_point()
        ]
        for g in from_next:
            ops.append(dist.P2POp(dist.irecv, g, self.next_rank, self.group))
        self._batch(ops)

        return _payloads(from_prev, recv_specs[1], recv_prev, from_next, recv_next_like)

    def _recv_specs(
        self, recv_prev: bool, recv_key: Hashable | None, header_out: Tensor | None
    ) -> tuple[Spec, Tensor | None]:
        """The (shapes, dtypes) of the activations to receive, and the header still to send.

        Fixed ``tensor_shape``: known. A stream seen this step: its first header's. Else
        a header is received in a round of its own, which the outgoing header joins, so
        two stages that both wait for a header (the interleaved ring) cannot deadlock."""
        if not recv_prev:
            return ([], False), header_out
        if self.tensor_shape is not None:
            return ([(torch.Size(self.tensor_shape), self.dtype)], False), header_out
        if recv_key is not None and recv_key in self._received:
            return self._received[recv_key], header_out
        header_in = torch.empty(_HEADER, dtype=torch.int64, device=self.device)
        first = [dist.P2POp(dist.irecv, header_in, self.prev_rank, self.group)]
        if header_out is not None:
            first.insert(0, dist.P2POp(dist.isend, header_out, self.next_rank, self.group))
        self._batch(first)
        specs = _decode(header_in.cpu())
        if recv_key is not None:
            self._received[recv_key] = specs
        return specs, None

    def _loop_back(
        self,
        send_next: Payload,
        fwd: tuple[Tensor, ...],
        send_prev: Payload,
        recv_prev: bool,
        recv_next_like: Payload,
    ) -> tuple[Payload, Payload]:
        """One stage: what this rank sends it receives back, in order (copies, as a transfer
        makes: the next chunk may change its input in place)."""
        if send_next is not None:
            acts = [t.detach().clone(memory_format=torch.contiguous_format) for t in fwd]
            self._loop["act"].append((acts, isinstance(send_next, tuple)))
        if send_prev is not None:
            self._loop["grad"].append([g.detach().clone() for g in as_tuple(send_prev)])
        try:
            from_prev, is_tuple = self._loop["act"].popleft() if recv_prev else ([], False)
            from_next = self._loop["grad"].popleft() if recv_next_like is not None else []
        except IndexError:
            raise RuntimeError("one-stage pipeline: a receive with nothing sent before") from None
        return _payloads(from_prev, is_tuple, recv_prev, from_next, recv_next_like)


def _payloads(
    from_prev: list[Tensor],
    is_tuple: bool,
    recv_prev: bool,
    from_next: list[Tensor],
    recv_next_like: Payload,
) -> tuple[Payload, Payload]:
    """What ``communicate`` returns, from the received buffers."""
    prev_out: Payload = None
    if recv_prev:
        for t in from_prev:
            t.requires_grad_(t.is_floating_point())
        prev_out = tuple(from_prev) if is_tuple else from_prev[0]
    next_out: Payload = None
    if recv_next_like is not None:
        grads = iter(from_next)
        sent = as_tuple(recv_next_like)
        next_out = tuple(next(grads).to(t.dtype) if t.is_floating_point() else None for t in sent)
    return prev_out, next_out


def input_grads(inputs: Payload) -> Payload:
    """The gradients to send back for received ``inputs`` (zeros where none flowed)."""
    if inputs is None:
        return None
    return tuple(
        (t.grad if t.grad is not None else torch.zeros(t.shape, dtype=t.dtype, device=t.device))
        for t in as_tuple(inputs)
        if t.is_floating_point()
    )


_SHARED_GROUPS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def first_last_stage_group(ctx: ParallelContext) -> dist.ProcessGroup | None:
    """The group {first stage, last stage} of this rank's pipeline (tied embedding/head).

    Only the two member ranks take part in creating it (local synchronisation),
    so middle stages need not call this. Cached per context; None on middle stages.
    """
    if ctx not in _SHARED_GROUPS:
        ranks = ctx.ranks(ParallelMode.PIPELINE)
        pair = [ranks[0], ranks[-1]]
        mine = None
        if ctx.global_rank in pair and len(set(pair)) == 2:
            mine = dist.new_group(pair, use_local_synchronization=True)
        _SHARED_GROUPS[ctx] = mine
    return _SHARED_GROUPS[ctx]
