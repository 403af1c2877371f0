"""What building Gemini does to the user's objects, and how a failed allocation is reported.

Optimizer state loaded before ``initialize`` keeps this rank's rows; Adam and AdamW switch
to torch's fused CPU kernel; running out of device or host memory while the chunks are
made names the setting that fits, in the bytes ``offload_plan`` (and so ``gridtrain
estimate``) counts.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.optim import Optimizer

from gridtrain.parallel.zero.offload_chunk import Chunk


def device_full(built: list[Chunk]) -> MemoryError:
    placed = sum(c.param_bytes() for c in built if c.resident) / 2**20
    return MemoryError(
        f"zero offload (Gemini): out of device memory placing chunk {len(built)} after "
        f"{placed:.0f} MiB of resident parameters; set zero.device_param_mb to at most "
        f"{0.8 * placed:.0f} so the rest streams (`gridtrain estimate --zero 3 --offload` "
        "gives the device bytes of every setting)"
    )


def host_full(built: list[Chunk], groups) -> MemoryError:
    done = sum(c.segment * c.masters.element_size() * 2 for c in built) / 1e9
    params = sum(p.numel() for _, ps in groups for _, _, p in ps)
    n = max((c.n for c in built), default=1)
    need = 16 * params / n / 1e9  # masters, gradients, two Adam moments (offload_plan)
    fits = done * 1e9 * n / 16  # parameters whose 16 / n bytes the allocated memory holds
    return MemoryError(
        f"zero offload (Gemini): out of host memory after {done:.1f} GB of the {need:.1f} GB "
        f"this rank keeps for {params / 1e9:.2f}B parameters (16 bytes each over {n} data "
        f"ranks: fp32 master, gradient, two Adam moments); this host holds about "
        f"{fits / 1e9:.2f}B parameters per data rank: more data ranks or a smaller model "
        "(`gridtrain estimate --zero 3 --offload` counts the same host bytes)"
    )


def move_state(optimizer: Optimizer, p: Tensor, slot) -> None:
    """Optimizer state loaded before ``initialize``: keep this rank's rows, on the host."""
    state = optimizer.state.pop(p, None)
    if state is not None:
        optimizer.state[slot.master] = slot.shard.owned_state(state, torch.device("cpu"))


def fuse_on_cpu(optimizer: Optimizer) -> None:
    """torch's fused CPU kernel for Adam and AdamW groups (vectorised and multi-threaded)."""
    if not isinstance(optimizer, torch.optim.Adam | torch.optim.AdamW):
        return
    for group in optimizer.param_groups:
        if group.get("differentiable") or group.get("capturable"):
            continue
        if all(p.device.type == "cpu" and p.is_floating_point() for p in group["params"]):
            group["fused"], group["foreach"] = True, False
