"""``attention``: the scaled-dot-product-attention kernels a forward may use.

torch picks SDPA's kernel per call from a fixed priority (flash, memory-efficient,
math, with cuDNN last on most builds). On Hopper the cuDNN kernel is the fastest for
training-sized heads, so an unset ``attention`` puts it first there (``attention_for``);
below compute capability 9.0 torch's own order already starts with its fastest kernel.
The kernel is chosen in the forward and its backward follows, so the forward region is
all that needs the context, except where the forward runs again in the backward
(``activation_checkpoint``): there the engine's context is gone, so the recompute re-enters
the preference the forward had (``replay_kernels``). Torch falls back along the list when a
kernel cannot take an input.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
from torch.nn.attention import SDPBackend, _cur_sdpa_kernel_backends, sdpa_kernel

from gridtrain.config.attention import HOPPER_ORDER, AttentionConfig

_BACKENDS = {
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "math": SDPBackend.MATH,
}
HOPPER = (9, 0)


def capability_of(device: torch.device) -> tuple[int, int] | None:
    """The CUDA compute capability of ``device``; None for any other device."""
    if device.type != "cuda":
        return None
    return torch.cuda.get_device_capability(device)


def attention_for(
    option: AttentionConfig | bool | None,
    device: torch.device,
    capability: tuple[int, int] | None = None,
) -> AttentionConfig | None:
    """The ``attention`` section a forward on ``device`` uses: the config's own when given,
    None (torch's order) for ``False``; unset, cuDNN first on a CUDA device of compute
    capability 9.0 or more (``capability``: that of ``device`` unless given)."""
    if option is False:
        return None
    if option is not None:
        return option
    if device.type != "cuda":
        return None
    if (capability or capability_of(device)) < HOPPER:
        return None
    return AttentionConfig(backends=list(HOPPER_ORDER))


def sdpa_context(options) -> contextlib.AbstractContextManager:
    """The forward's kernel preference from the ``attention`` section (None: torch's own)."""
    if not options:
        return contextlib.nullcontext()
    return sdpa_kernel([_BACKENDS[b] for b in options.backends], set_priority=True)


def replay_kernels() -> Callable[[], contextlib.AbstractContextManager]:
    """Called in a forward: a factory of SDPA's kernel preference now (the ``attention``
    section, or a user's own ``sdpa_kernel``), for a recompute of that forward in the backward.

    A recompute under torch's default order would pick another kernel (flash where the
    forward ran cuDNN's, on Hopper by default), which saves other tensors for its backward
    (cuDNN's log-sum-exp and RNG state differ from flash's in shape and dtype), and torch's
    checkpoint refuses them. ``_cur_sdpa_kernel_backends`` is what ``sdpa_kernel`` itself
    saves and restores."""
    backends = _cur_sdpa_kernel_backends(with_priority=True)
    return lambda: sdpa_kernel(backends, set_priority=True)
