"""``attention``: the scaled-dot-product-attention kernels a forward may use.

torch picks SDPA's kernel per call from a fixed priority (flash, memory-efficient,
math, with cuDNN last on most builds). On Hopper the cuDNN kernel is the fastest for
training-sized heads, so the config can put it first. The kernel is chosen in the
forward and its backward follows, so the forward region is all that needs the
context. Torch falls back along the list when a kernel cannot take an input.
"""

from __future__ import annotations

import contextlib

from torch.nn.attention import SDPBackend, sdpa_kernel

_BACKENDS = {
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "math": SDPBackend.MATH,
}


def sdpa_context(options) -> contextlib.AbstractContextManager:
    """The forward's kernel preference from the ``attention`` section (None: torch's own)."""
    if options is None:
        return contextlib.nullcontext()
    return sdpa_kernel([_BACKENDS[b] for b in options.backends], set_priority=True)
