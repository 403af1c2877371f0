"""Gemini's ``delayed_update``: ZeRO-Offload's one-step delayed parameter update (Ren et al.
2021, section 5.3).

The optimizer step of window ``k`` runs on a host thread while the device computes window
``k + 1`` from the weights before that step; its result reaches the device during window
``k + 1``'s last backward, chunk by chunk, once the backward is done with each chunk, so
window ``k + 2`` computes with it. Gradients are thus one step stale. The thread steps the
chunks in the backward's order, and a chunk's next gradient lands in its host buffer only
once its step has read the last one (there is no second gradient buffer: host memory is
what bounds the model size). The first step (no optimizer state yet) runs at once, as the
paper warms up without delay.

The step is the user's own optimizer class run on a private copy of its parameter groups
(hyperparameters read when the engine steps, so an LR scheduler stepping meanwhile does not
race it) over stand-ins of the masters sharing their storage, gradients and state; nothing
the engine touches between steps (``zero_grad`` dropping ``.grad``) reaches the thread.
Reading the masters or the optimizer's state (a state dict, a checkpoint) waits for it.
"""

from __future__ import annotations

import copy
import threading
from concurrent.futures import ThreadPoolExecutor

import torch
from torch.optim import Optimizer


class DelayedStep:
    """Takes over ``optimizer.step`` for the offloaded engine (see the module docstring)."""

    def __init__(self, optimizer: Optimizer, chunks_in_backward_order: list):
        self.optimizer = optimizer
        self.order = chunks_in_backward_order
        self._sync_step = optimizer.step  # the instance's (an LR scheduler may wrap it)
        self._raw_step = type(optimizer).step.__wrapped__  # without hooks: one per chunk
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="gt-delayed-step")
        self._future = None
        self._done: dict[int, threading.Event] = {}
        optimizer.step = self.step
        optimizer.register_state_dict_pre_hook(lambda *_: self.wait())

    @property
    def pending(self) -> bool:
        return self._future is not None

    def step(self, closure=None):
        """The engine's ``optimizer.step()``: delayed once every stepped parameter has state."""
        self.wait()
        opt = self.optimizer
        params = [p for g in opt.param_groups for p in g["params"] if p.grad is not None]
        if closure is not None or any(not opt.state.get(p) for p in params):
            return self._sync_step(closure)  # warm-up: state is made by a step of its own
        proxy, by_chunk = self._proxy()
        self._done = {c.index: threading.Event() for c in self.order}
        self._future = self._pool.submit(self._run, proxy, by_chunk)
        opt._opt_called = True  # what torch's LR scheduler checks for
        return None

    def _proxy(self):
        """A shallow copy of the optimizer over stand-ins (same storage, gradient, state),
        and per chunk (backward order) its stand-ins in each group."""
        opt = self.optimizer
        proxy = copy.copy(opt)
        proxy.state = {}
        groups, pairs = [], []  # pairs: per group, (master, stand-in)
        for group in opt.param_groups:
            members = []
            for p in group["params"]:
                if p.grad is not None:
                    q = p.detach()
                    q.grad = p.grad
                    proxy.state[q] = opt.state[p]  # the same dict: updated in place
                    members.append((p, q))
            pairs.append(members)
            groups.append({**group, "params": [q for _, q in members]})
        by_chunk = []
        for chunk in self.order:
            ids = {id(s.master) for s in chunk.slots}
            by_chunk.append((chunk.index, [[q for p, q in m if id(p) in ids] for m in pairs]))
        proxy.param_groups = groups
        return proxy, by_chunk

    def _run(self, proxy, by_chunk) -> None:
        groups = proxy.param_groups
        try:
            for index, members in by_chunk:
                proxy.param_groups = [
                    {**g, "params": m} for g, m in zip(groups, members, strict=True)
                ]
                with torch.no_grad():
                    self._raw_step(proxy)
                self._done[index].set()
        finally:
            for event in self._done.values():
                event.set()

    def wait_chunk(self, index: int) -> None:
        """Block until the pending step has finished with chunk ``index``."""
        if self._future is not None and index in self._done:
            self._done[index].wait()
            if self._future.done():
                self.wait()

    def wait(self) -> None:
        """Block until the pending step is done (its errors raise here)."""
        if self._future is not None:
            future, self._future = self._future, None
            future.result()
