"""The speed keys' defaults: what ``compile``, ``attention`` and ``fused_optimizer`` mean
on the device a run trains on when the config leaves them unset.

On a CUDA device an unset key takes what ``benchmarks/gpt_throughput.py``'s ``fast``
configuration measured fastest: the blocks (and the loss, where it holds no collectives)
compiled by inductor, cuDNN attention first on Hopper, torch's fused Adam/AdamW/SGD.
On the CPU an unset key changes nothing: no compilation (a C++ build per block would
cost more than it saves on short runs), torch's attention order, the optimizer as built.
A key the config sets wins in both directions: ``False`` turns its part off, a value
turns it on. ``resolve_speed(config, device)`` is all of it, so what a GPU run would
get can be read on any machine.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field

import torch

from gridtrain.config import AttentionConfig, CompileConfig, Config
from gridtrain.engine.sdpa import attention_for, capability_of

TRITON_MIN = (7, 0)  # inductor's GPU kernels are Triton's, which needs Volta or newer


@dataclass
class Speed:
    """What a run's speed keys resolved to (``engine.speed``).

    ``compile``: the section applied (None: eager); ``attention``: SDPA's kernel order
    (None: torch's own); ``fused_optimizer``: whether the optimizer is offered fused
    kernels. ``initialize`` fills in what happened: ``compiled`` (the module names
    compiled, ``''`` for a whole model, ``'criterion'`` for the loss) and ``optimizer``
    (``"fused"``, or ``"as built: <why>"``).
    """

    compile: CompileConfig | None
    attention: AttentionConfig | None
    fused_optimizer: bool
    compiled: list[str] = field(default_factory=list)
    optimizer: str = "as built"


def default_compile(device: torch.device, capability: tuple[int, int] | None = None) -> bool:
    """Whether an unset ``compile`` compiles on ``device``: a CUDA device of compute
    capability 7.0 or more with Triton installed."""
    if device.type != "cuda":
        return False
    return (capability or capability_of(device)) >= TRITON_MIN and _has_triton()


def _has_triton() -> bool:
    return importlib.util.find_spec("triton") is not None


def resolve_speed(
    config: Config, device: torch.device | str, capability: tuple[int, int] | None = None
) -> Speed:
    """``config``'s speed keys on ``device`` (``capability``: a CUDA device's compute
    capability, read from the device unless given), the config's own values first."""
    device = torch.device(device)
    option = config.compile
    if option is None:
        option = CompileConfig() if default_compile(device, capability) else False
    fused = config.fused_optimizer
    if fused is None:
        fused = device.type == "cuda"
    return Speed(
        compile=None if option is False else option,
        attention=attention_for(config.attention, device, capability),
        fused_optimizer=fused,
    )
