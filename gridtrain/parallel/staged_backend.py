"""``backend="staged"``: several CUDA ranks on one GPU, their collectives through gloo.

NCCL takes one GPU per rank and refuses a second rank on it ("Duplicate GPU detected"),
so on a machine with fewer GPUs than ranks the ranks could only run on the CPU, and no
CUDA code path of a multi-rank layout (device placement, streams, pinned buffers,
compiled blocks over sharded weights, cuDNN attention inside ring attention) would run.
Here each rank keeps its tensors on its GPU (``local_rank % device_count``) and every
collective runs in a gloo group on host copies: a CUDA tensor is copied to a pinned host
buffer, gloo's CPU collective runs on it, and waiting on the work copies the results
back. Gloo's CPU side has every collective FSDP2, DTensor, DCP and gridtrain's own
``comm`` call (reduce-scatter and all-to-all included, which its CUDA side lacks), so
one path serves all of them; CPU tensors go to gloo as they are.

It is a process group written in Python (``torch.distributed.ProcessGroup``, registered
under ``NAME`` with ``dist.Backend.register_backend``), so ``torch.distributed``'s own
functions, and everything built on them, reach it unchanged. It is for running and
testing many ranks on one GPU, not for speed: each collective waits for the stream and
crosses the host bus twice. ``launch(backend=None)`` picks it only where the ranks on a
machine outnumber its GPUs (``pick_backend``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

logger = logging.getLogger("gridtrain")

NAME = "staged"
_Copies = list[tuple[Tensor, Tensor]]  # (where the result goes, the host buffer it is in)


class StagedWork(dist.Work):
    """A gloo work on host buffers; ``wait`` waits for it, then copies the results to
    their device tensors (so they are ready on every stream once it returns)."""

    def __init__(self, work: dist.Work, copies: _Copies, result: Any):
        super().__init__()
        self._work, self._copies, self._result = work, copies, result
        self._done = False

    def _finish(self) -> None:
        if not self._done:
            self._done = True
            for device_tensor, host in self._copies:
                device_tensor.copy_(host)  # pinned to device, waited for: ready when it returns
            self._copies = []

    def wait(self, timeout: timedelta | None = None) -> bool:
        if timeout is None or timeout == timedelta(0):
            self._work.wait()
        else:
            self._work.wait(timeout)
        self._finish()
        return True

    def is_completed(self) -> bool:
        if not self._done and self._work.is_completed():
            self._finish()
        return self._done

    def is_success(self) -> bool:
        return self._work.is_success()

    def exception(self) -> Any:
        return self._work.exception()

    def get_future(self) -> torch.futures.Future:
        self.wait()
        future: torch.futures.Future = torch.futures.Future()
        future.set_result(self._result)
        return future

    def result(self) -> Any:
        self.wait()
        return self._result

    def _source_rank(self) -> int:  # recv_anysource: the rank the message came from
        return self._work._source_rank()


class _Works(dist.Work):
    """Several gloo works as one (a coalesced collective run one tensor at a time)."""

    def __init__(self, works: list[dist.Work]):
        super().__init__()
        self._works = works

    def wait(self, timeout: timedelta | None = None) -> bool:
        for work in self._works:
            work.wait() if timeout is None else work.wait(timeout)
        return True

    def is_completed(self) -> bool:
        return all(work.is_completed() for work in self._works)

    def is_success(self) -> bool:
        return all(work.is_success() for work in self._works)

    def exception(self) -> Any:
        return next((w.exception() for w in self._works if not w.is_success()), None)


def _one_by_one(gloo: dist.ProcessGroup, base: str) -> Callable:
    """A coalesced collective as gloo's ``base`` on each (output, input) pair: gloo's own
    coalesced methods are named differently across torch releases (2.11 has none under
    ``all_gather_single_coalesced``), and gloo gains nothing by coalescing."""

    def run(outputs: list[Tensor], inputs: list[Tensor], opts: Any) -> dist.Work:
        op = getattr(gloo, base)
        return _Works([op(out, inp, opts) for out, inp in zip(outputs, inputs, strict=True)])

    return run


_ONE_BY_ONE = {
    "all_gather_single_coalesced": "_allgather_base",
    "reduce_scatter_single_coalesced": "_reduce_scatter_base",
}


def _staged(op: str, roles: tuple[str, ...]) -> Callable:
    """The process group's ``op``: gloo's ``op`` on host copies of its tensor arguments.
    ``roles`` says, per tensor argument, whether it is read ("in"), written ("out") or
    both ("inout"): only what is read is copied to the host, only what is written back."""

    def run(self: StagedProcessGroup, *args: Any) -> dist.Work:
        staged, copies = list(args), []
        for i, role in enumerate(roles):
            staged[i] = self._stage(args[i], role != "out", copies if role != "in" else None)
        base = _ONE_BY_ONE.get(op)
        gloo_op = _one_by_one(self._gloo, base) if base else getattr(self._gloo, op)
        return StagedWork(gloo_op(*staged), copies, args[0])

    run.__name__ = op
    run.__doc__ = f"gloo's ``{op}`` on host copies of the CUDA tensors ({', '.join(roles)})."
    return run


class StagedProcessGroup(dist.ProcessGroup):
    """A process group whose collectives run in a gloo group on host copies of the tensors
    of the ``staged`` device types (CUDA; tests add the CPU to prove the staging)."""

    def __init__(
        self, store: dist.Store, rank: int, size: int, timeout: timedelta, staged: Sequence[str]
    ):
        super().__init__(rank, size)
        self._gloo = dist.ProcessGroupGloo(store, rank, size, timeout)
        # what torch asks a group's backend (batch_isend_irecv: does it coalesce?) gloo
        # answers; the collectives themselves reach this class's methods first
        for device in ("cpu", "cuda"):
            self._register_backend(torch.device(device), self.BackendType.GLOO, self._gloo)
        self._staged = frozenset(staged)
        self._name, self._desc = "", ""

    # torch keeps a group's name in its backends; this group has none of torch's kind
    def getBackendName(self) -> str:  # noqa: N802 - torch's names, called from C++
        return NAME

    def setGroupName(self, name: str) -> None:  # noqa: N802
        self._name = name

    def getGroupName(self) -> str:  # noqa: N802
        return self._name

    def setGroupDesc(self, desc: str) -> None:  # noqa: N802
        self._desc = desc

    def getGroupDesc(self) -> str:  # noqa: N802
        return self._desc

    def _stage(self, x: Any, copy_in: bool, copies: _Copies | None) -> Any:
        """Host buffers for the tensors in ``x`` (a tensor, or lists of them, nested):
        filled from the device where ``copy_in``; each noted in ``copies`` to be copied
        back where the collective writes it (``copies`` given)."""
        if isinstance(x, list | tuple):
            return type(x)(self._stage(t, copy_in, copies) for t in x)
        if not isinstance(x, Tensor) or x.device.type not in self._staged:
            return x
        host = torch.empty(x.shape, dtype=x.dtype, pin_memory=x.is_cuda)
        if copy_in:
            host.copy_(x)  # device to pinned host, waited for: the stream's work is in it
        if copies is not None:
            copies.append((x, host))
        return host

    # every collective torch.distributed calls on a process group, by torch's method name
    allreduce = _staged("allreduce", ("inout",))
    allreduce_coalesced = _staged("allreduce_coalesced", ("inout",))
    broadcast = _staged("broadcast", ("inout",))
    reduce = _staged("reduce", ("inout",))
    allgather = _staged("allgather", ("out", "in"))
    allgather_coalesced = _staged("allgather_coalesced", ("out", "in"))
    all_gather_single = _staged("all_gather_single", ("out", "in"))
    _allgather_base = _staged("_allgather_base", ("out", "in"))
    all_gather_single_coalesced = _staged("all_gather_single_coalesced", ("out", "in"))
    allgather_into_tensor_coalesced = _staged("all_gather_single_coalesced", ("out", "in"))
    reduce_scatter = _staged("reduce_scatter", ("out", "in"))
    reduce_scatter_single = _staged("reduce_scatter_single", ("out", "in"))
    _reduce_scatter_base = _staged("_reduce_scatter_base", ("out", "in"))
    reduce_scatter_single_coalesced = _staged("reduce_scatter_single_coalesced", ("out", "in"))
    reduce_scatter_tensor_coalesced = _staged("reduce_scatter_single_coalesced", ("out", "in"))
    alltoall = _staged("alltoall", ("out", "in"))
    all_to_all_single = _staged("all_to_all_single", ("out", "in"))
    alltoall_base = _staged("alltoall_base", ("out", "in"))
    gather = _staged("gather", ("out", "in"))
    scatter = _staged("scatter", ("out", "in"))
    send = _staged("send", ("in",))
    recv = _staged("recv", ("out",))
    recv_anysource = _staged("recv_anysource", ("out",))

    def barrier(self, opts: Any = None) -> dist.Work:
        """gloo's barrier (no tensors to stage)."""
        return self._gloo.barrier(opts) if opts is not None else self._gloo.barrier()

    def monitored_barrier(self, timeout: timedelta | None = None, wait_all_ranks: bool = False):
        """gloo's monitored barrier: names the ranks that did not arrive."""
        return self._gloo.monitored_barrier(timeout, wait_all_ranks)


def register(staged: Sequence[str] = ("cuda",)) -> None:
    """Register ``NAME`` with torch.distributed; its groups stage the tensors of the
    ``staged`` device types. Registering again replaces the policy for later groups."""

    def create(store, rank, size, timeout):
        return StagedProcessGroup(store, rank, size, timeout, staged)

    dist.Backend.register_backend(NAME, create, devices=["cpu", "cuda"])


def ensure_registered() -> None:
    """Register ``NAME`` (staging CUDA tensors) unless it already is."""
    if NAME not in dist.Backend.backend_list:
        register()


def ranks_per_gpu_notice(local_world_size: int, gpus: int) -> str:
    """The one line a rank logs when ``pick_backend`` chose this backend."""
    return (
        f"{local_world_size} ranks on this machine and {gpus} GPU(s): the ranks share them "
        f"through backend '{NAME}' (collectives via gloo in host memory; NCCL takes one GPU "
        "per rank)"
    )


def pick_backend(requested: str | None, local_world_size: int | None, gpus: int) -> str:
    """The backend ``launch`` uses: ``requested``, or for None nccl with a GPU per rank on
    this machine, ``NAME`` with fewer GPUs than ranks, gloo without a GPU.
    ``local_world_size`` is None where it is not known (ranks spread over machines that
    did not say): then one GPU per rank is assumed, as torch does. Asking for nccl with
    fewer GPUs than ranks is an error naming this backend, before NCCL would refuse."""
    crowded = gpus > 0 and local_world_size is not None and local_world_size > gpus
    if requested is None:
        if gpus == 0:
            return "gloo"
        return NAME if crowded else "nccl"
    if requested == "nccl" and crowded:
        raise ValueError(
            f"backend 'nccl' needs one GPU per rank, but {local_world_size} ranks share "
            f"{gpus} GPU(s) on this machine: use backend '{NAME}' (or None, which picks it) "
            "or start fewer ranks per node"
        )
    return requested
