"""torch.compile's AOTAutograd cache under autocast: keyed by the autocast dtype, or skipped.

Before pytorch#181564 (in torch 2.12) that on-disk cache keyed a graph by whether autocast was
on, not by its dtype. A graph compiled under bf16 autocast was then loaded by a later process
running fp16 autocast, and back: the model trained in the other precision, with losses close
enough to pass unnoticed. An H100 with torch 2.11 showed it: a ``bf16`` run gave fp16 outputs
after a ``torch`` fp16 run on the same machine, and only with that cache on. Where this torch's
key lacks the dtype, gridtrain's compiled calls made under autocast skip that one cache;
inductor's FX graph cache stays on (its key is the traced graph, casts included).
"""

from __future__ import annotations

import contextlib
import functools
import inspect

import torch

from gridtrain.parallel.tensor.meta_memo import any_autocast


@functools.cache
def keys_autocast_dtype() -> bool:
    """Whether this torch's AOTAutograd cache keys a graph by the ambient autocast dtype
    (read from its source; no source to read counts as the old key)."""
    try:
        from torch._functorch._aot_autograd import autograd_cache

        source = inspect.getsource(autograd_cache)
    except (ImportError, OSError, TypeError):
        return False
    return "get_autocast_dtype" in source


def autocast_safe_cache() -> contextlib.AbstractContextManager:
    """The context for one compiled call: the AOTAutograd cache off while autocast is on and
    this torch keys that cache without the autocast dtype; otherwise nothing changes."""
    config = getattr(torch._functorch, "config", None)
    if config is None or not hasattr(config, "enable_autograd_cache") or keys_autocast_dtype():
        return contextlib.nullcontext()
    if not any_autocast():
        return contextlib.nullcontext()
    return config.patch(enable_autograd_cache=False)
