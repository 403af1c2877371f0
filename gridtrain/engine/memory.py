"""``engine.memory()``: the bytes this rank holds, by category, now and at the peak of the last
step; ``engine.track_memory()`` records the peaks.

Categories and what each counts: ``gridtrain.parallel.zero.memory_rules`` (the names
``gridtrain estimate`` reports under too). Each ZeRO runtime lists its tensors
(``memory_sources``), the gradient sync its buffers in flight (``buffers``); every storage
counts once, whole, on the device or in host memory (Gemini's masters, gradients and
moments, ZeRO 1-2's with ``offload``, are host memory even in a CPU run).

Peaks are the most each category held at any of these points of a step, sampled only
inside ``with engine.track_memory():`` (each sample walks every tensor, so steps there
are slower): every forward of the model (each micro-batch, each pipeline chunk); under
ZeRO 3 and Gemini, before every unit's forward and backward (parameters gathered); where a
gradient sync's buffers are largest (a bucket's send buffer just allocated, its gradients
not yet dropped; every bucket in flight before the overlapped all-reduce waits; the
all-gathers after a ZeRO 1-2 step); and before and after the optimizer's step.
Activations are counted as autograd saves them (``saved_tensors_hooks``): the distinct
storages held for backward, parameters and their views excluded, from their save until
backward releases them; the peak is the most at once. A step runs from the first forward
after an ``engine.step()`` that stepped (or skipped a window) to the next.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn
from torch.autograd.graph import register_multi_grad_hook
from torch.utils._pytree import tree_flatten

from gridtrain.parallel.rows import local
from gridtrain.parallel.zero.memory import Source, count, model_sources
from gridtrain.parallel.zero.memory_rules import ACTIVATIONS, CATEGORIES, MASTERS, PARAMETERS


@dataclass(frozen=True)
class MemoryReport:
    """Bytes one rank holds, by category (``memory_rules.CATEGORIES``).

    ``device`` / ``host``: now (activations: 0, as none are held between steps);
    ``peak_device`` / ``peak_host``: the most each category held during the last step run
    inside ``engine.track_memory()`` (empty before one); categories peak at different
    moments, so their sum bounds the step's peak from above.
    """

    device: dict[str, int]
    host: dict[str, int]
    peak_device: dict[str, int] = field(default_factory=dict)
    peak_host: dict[str, int] = field(default_factory=dict)

    def __str__(self) -> str:
        rows = [f"{'MiB':<16}{'device':>10}{'host':>10}{'peak dev':>10}{'peak host':>10}"]
        for c in CATEGORIES:
            cells = (d.get(c, 0) / 2**20 for d in (self.device, self.host))
            peaks = (d.get(c, 0) / 2**20 for d in (self.peak_device, self.peak_host))
            rows.append(f"{c:<16}" + "".join(f"{v:>10.2f}" for v in (*cells, *peaks)))
        return "\n".join(rows)


class _Saved:
    """What autograd keeps of a counted saved tensor; releasing it uncounts the storage."""

    __slots__ = ("key", "meter", "tensor")

    def __init__(self, tensor: Tensor, key: tuple, meter: _Activations):
        self.tensor, self.key, self.meter = tensor, key, meter

    def __del__(self) -> None:
        self.meter.release(self.key)


class _Activations:
    """Bytes of distinct storages saved for backward, now and at most (device, host)."""

    def __init__(self, device: torch.device, skip: set[tuple]):
        self.device, self.skip = device, skip
        self.refs: dict[tuple, int] = {}
        self.size: dict[tuple, tuple[int, bool]] = {}
        self.live = [0, 0]  # device, host
        self.peak = [0, 0]

    def pack(self, t: Tensor):
        if isinstance(t, nn.Parameter) or isinstance(t._base, nn.Parameter):
            return t
        try:
            inner = local(t)
            st = inner.untyped_storage()
            key, nbytes = (inner.device, st.data_ptr()), st.nbytes()
        except (RuntimeError, NotImplementedError):  # no plain storage: not counted
            return t
        if key in self.skip or nbytes == 0:
            return t
        if not self.refs.get(key):
            host = inner.device.type == "cpu" and self.device.type != "cpu"
            self.size[key] = (nbytes, host)
            self.live[host] += nbytes
            self.peak[host] = max(self.peak[host], self.live[host])
        self.refs[key] = self.refs.get(key, 0) + 1
        return _Saved(t, key, self)

    @staticmethod
    def unpack(packed):
        return packed.tensor if isinstance(packed, _Saved) else packed

    def release(self, key: tuple) -> None:
        self.refs[key] -= 1
        if not self.refs[key]:
            del self.refs[key]
            nbytes, host = self.size.pop(key)
            self.live[host] -= nbytes

    def restart(self) -> None:
        self.peak = list(self.live)


class MemoryMeter:
    """Counts what one engine holds (``report``) and, while tracking, the peaks of each step."""

    def __init__(self, model: nn.Module, optimizer, grad_sync, zero, device: torch.device):
        self.model, self.optimizer, self.grad_sync = model, optimizer, grad_sync
        self.zero, self.device = zero, device
        self._tracking = False
        self._stepped = False
        self._current: tuple[dict, dict] = ({}, {})
        self._last: tuple[dict, dict] | None = None
        self._acts: _Activations | None = None

    def sources(self) -> list[Source]:
        if self.zero is not None and hasattr(self.zero, "memory_sources"):
            out = self.zero.memory_sources(self.model, self.optimizer)
        else:
            out = model_sources(self.model, self.optimizer)
        return out + [(c, [t], None) for c, t in self.grad_sync.buffers()]

    def now(self) -> tuple[dict[str, int], dict[str, int]]:
        return count(self.sources(), self.device)

    def report(self) -> MemoryReport:
        device, host = self.now()
        device[ACTIVATIONS] = host[ACTIVATIONS] = 0
        self._fold_activations()
        peak = self._last if self._last is not None and not self._stepped else self._current
        return MemoryReport(device, host, dict(peak[0]), dict(peak[1]))

    # ---- peaks ---------------------------------------------------------------------------
    def sample(self) -> None:
        if not self._tracking:
            return
        for seen, peak in zip(self.now(), self._current, strict=True):
            for k, v in seen.items():
                peak[k] = max(peak.get(k, 0), v)

    def _fold_activations(self) -> None:
        if self._acts is not None:
            for i, peak in enumerate(self._current):
                peak[ACTIVATIONS] = max(peak.get(ACTIVATIONS, 0), self._acts.peak[i])

    def _on_forward(self, *_) -> None:
        if self._stepped:  # the first forward of a new step: the last one's peaks are final
            self._fold_activations()
            self._last, self._current, self._stepped = self._current, ({}, {}), False
            if self._acts is not None:
                self._acts.restart()
        self.sample()

    def step_ended(self) -> None:
        """Called by ``engine.step()`` at a window's end."""
        if self._tracking:
            self.sample()
            self._fold_activations()
            self._stepped = True

    @contextlib.contextmanager
    def track(self) -> Iterator[None]:
        """Record each step's peaks inside; see the module docstring."""
        if self._tracking:
            yield
            return
        handles = self._hooks()
        skip = {
            (local(t).device, local(t).untyped_storage().data_ptr())
            for c, ts, _ in self.sources()
            if c in (PARAMETERS, MASTERS)
            for t in ts
        }
        self._acts = _Activations(self.device, skip)
        self._tracking, self._stepped, self._current, self._last = True, False, ({}, {}), None
        self.grad_sync.set_probe(self.sample)
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._acts.pack, self._acts.unpack):
                yield
        finally:
            self._fold_activations()
            self._tracking = False
            self.grad_sync.set_probe(lambda: None)
            for h in handles:
                h.remove()

    def _hooks(self) -> list:
        handles = [self.model.register_forward_pre_hook(self._on_forward)]
        inner = getattr(self.optimizer, "optim", self.optimizer)
        handles.append(inner.register_step_pre_hook(lambda *_: self.sample()))
        handles.append(inner.register_step_post_hook(lambda *_: self.sample()))
        for unit in getattr(self.zero, "units", ()):  # ZeRO 3, Gemini: gathered parameters
            handles.append(unit.register_forward_pre_hook(lambda *_: self.sample()))
            handles.append(unit.register_forward_hook(self._before_backward))
        return handles

    def _before_backward(self, module, args, output) -> None:
        if not torch.is_grad_enabled():
            return
        outs = [t for t in tree_flatten(output)[0] if isinstance(t, Tensor) and t.requires_grad]
        if outs:
            register_multi_grad_hook(outs, lambda _: self.sample(), mode="any")
