"""Gemini's plan, process-free: chunks from units, which stay on the device, and what moves.

Shared by the runtime (``offload``) and ``benchmarks/offload.py``, so the bytes a run moves
are checked against the formula that predicts them; ``gridtrain estimate``
(``estimate/memory.gemini_states``) counts the same bytes per element.

Per parameter element on a data group of ``n``: the host keeps ``4/n`` bytes of fp32
master, ``4/n`` of gradient, ``8/n`` of Adam moments and, for a streamed chunk whose compute
dtype is narrower, ``c/n`` of compute-dtype copy (``c``: 2 under amp); the device keeps
``c`` bytes where resident. Per optimizer step with ``b`` backwards (micro-steps, pipeline
micro-batches): every chunk sends ``b`` gradient segments (``g s`` bytes each, ``s`` its
row segment, about ``numel / n``; ``g`` = 2 in a bf16 run, else 4:
``memory_rules.gemini_link_bytes``); a resident chunk receives its masters once after the
step, cast to the compute dtype on the host (``c s``); a streamed one is fetched before
every forward and backward (``2 b c s``).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from gridtrain.config import AMP_TYPE
from gridtrain.parallel.context import ParallelContext
from gridtrain.parallel.tags import get_dp_mode
from gridtrain.parallel.zero.memory_rules import gemini_host_buffers, gemini_link_bytes

AUTO_FRACTION = 0.55  # device_param_mb=None on CUDA: this share of the memory limit


def compute_dtype(amp: AMP_TYPE | None, param_dtype: torch.dtype) -> torch.dtype:
    """The dtype the device copy computes in: bf16 under bf16 amp, fp16 under naive and torch
    amp (autocast would cast the matmul weights so anyway), the parameters' own otherwise."""
    if amp is AMP_TYPE.BF16:
        return torch.bfloat16
    if amp in (AMP_TYPE.NAIVE, AMP_TYPE.TORCH):
        return torch.float16
    return param_dtype


def group_units(model: nn.Module, blocks: list[nn.Module], ctx: ParallelContext) -> list:
    """``[(unit, [(name, refs, param), ...]), ...]`` in forward order: unit 0 is the root's own
    parameters, unit i the i-th block's; one entry per unit, data-parallel group and dtype.
    ``refs`` lists every (module, attribute) registering the parameter (ties); a parameter
    registered in two units goes to the root; empty ones are left alone."""
    unit_of = {id(m): i for i, block in enumerate(blocks, start=1) for m in block.modules()}
    found: dict[int, list] = {}
    for prefix, module in model.named_modules(remove_duplicate=False):
        unit = unit_of.get(id(module), 0)
        for attr, p in module._parameters.items():
            if p is None or p.numel() == 0:
                continue
            entry = found.setdefault(id(p), [f"{prefix}.{attr}".lstrip("."), [], p, unit])
            if not any(m is module and a == attr for m, a in entry[1]):
                entry[1].append((module, attr))
            if entry[3] != unit:
                entry[3] = 0
    grouped: dict[tuple, list] = {}
    for name, refs, p, unit in found.values():
        grouped.setdefault((unit, get_dp_mode(p, ctx), p.dtype), []).append((name, refs, p))
    return [(key[0], params) for key, params in sorted(grouped.items(), key=lambda kv: kv[0][0])]


def device_limit(device: torch.device) -> int:
    """Bytes this process may allocate on ``device`` (the per-process fraction applied)."""
    total = torch.cuda.get_device_properties(device).total_memory
    fraction = getattr(torch.cuda, "get_per_process_memory_fraction", None)
    return int(total * (fraction(device) if fraction is not None else 1.0))


def place(
    numels: list[int], dtype: torch.dtype, device: torch.device, device_param_mb: float | None
) -> list[bool]:
    """Which chunks stay resident, in forward order while they fit the budget:
    ``device_param_mb`` MiB, or (None) all on the CPU and ``AUTO_FRACTION`` of the memory
    limit on CUDA."""
    if device_param_mb is None and device.type != "cuda":
        return [True] * len(numels)
    if device_param_mb is None:
        budget = AUTO_FRACTION * device_limit(device)
    else:
        budget = device_param_mb * 2**20
    size = torch.finfo(dtype).bits // 8
    out, used = [], 0
    for n in numels:
        keep = used + n * size <= budget
        out.append(keep)
        used += n * size if keep else 0
    return out


@dataclasses.dataclass(frozen=True)
class ChunkShape:
    """What the formulas need of one chunk: its row segment and residency."""

    segment: int  # this rank's padded rows, elements
    numel: int  # the whole chunk, elements
    resident: bool


def transfer_per_step(
    chunks: list[ChunkShape],
    backwards: int,
    compute_bytes: int,
    master_bytes: int = 4,
    bf16: bool = False,
) -> dict[str, int]:
    """Bytes one optimizer step moves over the host link (``h2d``, ``d2h``), per rank;
    ``bf16``: the run is bf16 (its gradients cross in bf16)."""
    grad, upload = gemini_link_bytes(compute_bytes, master_bytes, bf16)
    d2h = sum(backwards * c.segment * grad for c in chunks)
    h2d = sum(
        c.segment * upload if c.resident else 2 * backwards * c.segment * compute_bytes
        for c in chunks
    )
    return {"h2d": h2d, "d2h": d2h}


def host_bytes(
    chunks: list[ChunkShape], compute_bytes: int, master_bytes: int = 4, bf16: bool = False
) -> int:
    """Host bytes of one rank: masters, gradients, Adam's two moments, streamed copies, and
    the pinned buffers of the link (gradients landing, masters cast for upload)."""
    total = 0
    for c in chunks:
        total += 4 * c.segment * master_bytes
        if not c.resident and compute_bytes < master_bytes:
            total += c.segment * compute_bytes
    largest = max((c.segment for c in chunks), default=0)
    cast = max((c.segment for c in chunks if c.resident), default=0)
    link = gemini_host_buffers(largest, cast, compute_bytes, master_bytes, bf16)
    return total + sum(link.values())


def device_param_bytes(chunks: list[ChunkShape], compute_bytes: int) -> int:
    """Device bytes of parameters: the resident chunks, and two streamed ones at a time (the
    one in use and the one prefetched)."""
    resident = sum(c.numel for c in chunks if c.resident)
    streamed = sorted((c.numel for c in chunks if not c.resident), reverse=True)[:2]
    return (resident + sum(streamed)) * compute_bytes
