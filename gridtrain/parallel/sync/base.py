"""The gradient-sync interface: how a configuration makes gradients final before the step.

One object per engine, chosen at build time (``gridtrain.engine.grad_sync``), drives every
way gridtrain syncs gradients: the overlapped data-parallel all-reduce
(``data_parallel.py``), ZeRO 1-2's reduce-scatter (``zero/stage12.py``), FSDP2 (ZeRO 3),
Gemini (ZeRO 3 with offload) and the configured gradient handlers. The engine calls

* ``around_backward(last)`` around each backward (``last``: the accumulation window's last
  micro-step, the one whose gradients are synced; earlier ones accumulate locally);
* ``finish()`` once the window's backwards are done, before the optimizer step: every
  gradient the optimizer reads is then final (averaged, reduce-scattered, tied weights summed);
* ``after_step()`` after the optimizer stepped (ZeRO 1-2 all-gather the updated rows,
  Gemini uploads them).

and, for ``engine.memory()``, ``buffers()`` (the communication buffers held now, by
category) and ``set_probe(fn)`` (``fn`` is called where those buffers are largest).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator

from torch import Tensor


def _no_probe() -> None:
    pass


def bucket_buffers(buckets: Iterable) -> list[tuple[str, Tensor]]:
    """``(category, tensor)`` of what ``buckets`` hold for their collectives now: gradients
    (all-reduce copies, reduce-scatter send and receive buffers) and parameters (all-gather)."""
    out = []
    for b in buckets:
        for attr, category in (("buffer", "gradients"), ("_send", "gradients")):
            t = getattr(b, attr, None)
            if isinstance(t, Tensor):
                out.append((category, t))
        for attr in ("_gathered", "_gather_send"):
            t = getattr(b, attr, None)
            if isinstance(t, Tensor):
                out.append(("parameters", t))
    return out


class GradSync:
    """Does nothing: a layout with no gradient to sync (one data-parallel rank, no handler).

    ``allows_device_skip``: whether a fused optimizer may skip a non-finite step on a device
    flag (``engine.nonfinite``); not over FSDP2's DTensor parameters nor Gemini's host masters.
    """

    allows_device_skip = True
    probe: Callable[[], None] = staticmethod(_no_probe)

    def around_backward(self, last: bool) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def finish(self) -> None:
        pass

    def after_step(self) -> None:
        pass

    def buffers(self) -> list[tuple[str, Tensor]]:
        """``(category, tensor)`` of the communication buffers held now (engine.memory)."""
        return bucket_buffers(getattr(self, "buckets", ()))

    def set_probe(self, probe: Callable[[], None]) -> None:
        """Call ``probe`` (engine.memory's sampler) where this sync's buffers are largest."""
        self.probe = probe
        for bucket in getattr(self, "buckets", ()):
            bucket.probe = probe


class GradSyncs(GradSync):
    """Several syncs in one: ``finish`` runs them in order (tied pipeline weights must sum
    their full gradients before ZeRO takes its rows; after an all-reduce, the order is free)."""

    def __init__(self, parts: Iterable[GradSync]):
        self.parts = list(parts)

    @property
    def allows_device_skip(self) -> bool:
        return all(p.allows_device_skip for p in self.parts)

    @contextlib.contextmanager
    def around_backward(self, last: bool) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            for part in self.parts:
                stack.enter_context(part.around_backward(last))
            yield

    def finish(self) -> None:
        for part in self.parts:
            part.finish()

    def after_step(self) -> None:
        for part in self.parts:
            part.after_step()

    def buffers(self) -> list[tuple[str, Tensor]]:
        return [b for part in self.parts for b in part.buffers()]

    def set_probe(self, probe: Callable[[], None]) -> None:
        for part in self.parts:
            part.set_probe(probe)
