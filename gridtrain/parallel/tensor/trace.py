"""Which layer's output reaches which layer's input: the model's data flow, traced once on meta.

The planner needs, for every Linear, the Linears whose outputs it reads (a
Linear reading a column-parallel Linear's output is row-parallel) and whether
its own output reaches a norm or the model's output (then it cannot stay
sharded); under 3d it needs the same to know each layer's orientation. This
module runs the model's forward once with every parameter, buffer and input
replaced by a meta tensor (``torch.func.functional_call``: no memory, no
compute) under a ``TorchFunctionMode`` that tags every tensor with its
*sources*: the tracked layers whose outputs flowed into it through any chain of
untracked operations (attention, activations, residual adds, reshapes).
A tracked layer's output starts a fresh source set: ``{itself}`` for a Linear,
empty for an embedding, its input's sources for a norm or dropout. The same run
records the shapes reaching ``scaled_dot_product_attention`` and the Linears whose outputs
feed its query, key and value (``AttentionRecorder``), which the sharded shape check
(``local_shapes.py``) compares against and the planner reads fused projections off, and how
the model cuts each Linear's output (``cuts.py``: packed projections).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map

from gridtrain.parallel.tensor.cuts import Cut, CutTracker
from gridtrain.parallel.tensor.meta_memo import MetaMemo

# how a tracked layer's output relates to its input's sources; OPAQUE layers (already
# parallel: collectives, data-dependent routing) are not run on meta: their output is
# taken to have their first input's shape
FRESH, PASS, SELF, OPAQUE = "fresh", "pass", "self", "opaque"


@dataclass(frozen=True)
class AttentionCall:
    """One ``scaled_dot_product_attention`` call: the innermost module that made it, the
    shapes of its query and key (``[..., heads, seq, head_dim]``) and the tracked Linears
    whose outputs reached its query, key and value (traced runs only)."""

    module: str
    q: tuple[int, ...]
    k: tuple[int, ...]
    sources: tuple[frozenset[str], ...] = ()


@dataclass
class Flow:
    """The traced data flow between the tracked layers (names are module paths)."""

    order: list[str] = field(default_factory=list)  # tracked layers in first-call order
    sources: dict[str, set[str]] = field(default_factory=dict)  # layer -> SELF-layers it reads
    output_sources: set[str] = field(default_factory=set)  # SELF-layers reaching the output
    attention: list[AttentionCall] = field(default_factory=list)  # SDPA calls, in call order
    cuts: dict[str, Cut] = field(default_factory=dict)  # Linear -> how its output is cut
    # watched (untracked) module -> the SELF-layers it reads; its output passes them on
    watched: dict[str, set[str]] = field(default_factory=dict)

    def fused(self) -> dict[str, str]:
        """Linears whose one output feeds two or more of an attention's query, key and
        value -> the attention module (fused projections)."""
        out: dict[str, str] = {}
        for call in self.attention:
            seen: dict[str, int] = {}
            for srcs in call.sources:
                for s in srcs:
                    seen[s] = seen.get(s, 0) + 1
            out.update({s: call.module for s, k in seen.items() if k > 1 and s not in out})
        return out

    def consumers(self, name: str) -> list[str]:
        """Tracked layers that read ``name``'s output, in call order."""
        return [m for m in self.order if name in self.sources.get(m, ())]


class _Tagger(TorchFunctionMode):
    """Unions the source sets of every tensor argument into every tensor result."""

    def __init__(self):
        super().__init__()
        self.tags: dict[int, tuple[Tensor, frozenset[str]]] = {}

    def get(self, t: Any) -> frozenset[str]:
        entry = self.tags.get(id(t)) if isinstance(t, Tensor) else None
        return entry[1] if entry is not None and entry[0] is t else frozenset()

    def set(self, t: Tensor, sources: frozenset[str]) -> None:
        self.tags[id(t)] = (t, sources)  # the tensor is kept alive, so ids stay unique

    def sources_of(self, obj: Any) -> frozenset[str]:
        leaves, _ = tree_flatten(obj)
        out: frozenset[str] = frozenset()
        for leaf in leaves:
            out |= self.get(leaf)
        return out

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        sources = self.sources_of((args, kwargs))
        if sources:
            for leaf in tree_flatten(result)[0]:
                if isinstance(leaf, Tensor):
                    self.set(leaf, self.get(leaf) | sources)
        return result


def _to_meta(obj: Any) -> Any:
    return tree_map(
        lambda t: t.to("meta") if isinstance(t, Tensor) else t,
        obj,
    )


def trace_flow(
    model: nn.Module,
    example: Any,
    tracked: dict[str, str],
    watch: tuple[str, ...] = (),
) -> Flow:
    """Run ``model`` on ``example`` (args tuple, kwargs dict or one tensor) on meta.

    ``tracked`` maps module path -> FRESH | PASS | SELF (how its output's sources are set);
    ``watch``: modules whose sources ``Flow.watched`` records. Raises RuntimeError (with the
    model's error) when the forward cannot run on meta.
    """
    flow, tagger, cuts, modules = Flow(), _Tagger(), CutTracker(), dict(model.named_modules())
    hooks = []

    def pre(name: str) -> Callable:
        def hook(module, args, kwargs):
            if name not in flow.sources:
                flow.order.append(name)
                flow.sources[name] = set()
            flow.sources[name] |= set(tagger.sources_of((args, kwargs)))

        return hook

    def post(name: str, how: str) -> Callable:
        def hook(module, args, kwargs, output):
            fresh = {FRESH: frozenset(), OPAQUE: frozenset(), SELF: frozenset({name})}
            sources = fresh.get(how, tagger.sources_of((args, kwargs)))
            for leaf in tree_flatten(output)[0]:
                if isinstance(leaf, Tensor):
                    tagger.set(leaf, sources)
            if how == SELF:
                cuts.watch(name, output)

        return hook

    for name, how in tracked.items():
        hooks.append(modules[name].register_forward_pre_hook(pre(name), with_kwargs=True))
        hooks.append(modules[name].register_forward_hook(post(name, how), with_kwargs=True))
    hooks += [
        modules[name].register_forward_pre_hook(_seen(flow, tagger, name), with_kwargs=True)
        for name in watch
    ]
    opaque = {name: first_input_shape for name, how in tracked.items() if how == OPAQUE}
    recorder = AttentionRecorder(model, tagger)
    try:
        with ModuleTrail(model) as trail:
            out = run_on_meta(model, example, opaque, (tagger, recorder, cuts))
        flow.output_sources = set(tagger.sources_of(out))
    except Exception as err:  # noqa: BLE001 - the model's own error, re-raised with advice
        raise RuntimeError(
            f"tracing {type(model).__name__}'s data flow on the meta device failed in "
            f"{trail.where()} ({type(err).__name__}: {str(err).splitlines()[0][:300]}); give "
            "the layer styles in parallel.tensor.plan instead"
        ) from err
    finally:
        for h in hooks:
            h.remove()
    flow.attention, flow.cuts = recorder.calls, cuts.cuts
    return flow


def _seen(flow: Flow, tagger: _Tagger, name: str) -> Callable:
    """A pre-hook recording what watched module ``name`` reads (``Flow.watched``)."""

    def hook(module, args, kwargs):
        flow.watched.setdefault(name, set()).update(tagger.sources_of((args, kwargs)))

    return hook


def run_on_meta(
    model: nn.Module,
    example: Any,
    forwards: dict[str, Callable] | None = None,
    modes: tuple[TorchFunctionMode, ...] = (),
) -> Any:
    """``model``'s output for ``example`` (args tuple, kwargs dict or one tensor) computed on
    the meta device: every parameter, buffer and input tensor replaced by a meta tensor, under
    ``modes``; ``forwards`` stand in for the named submodules' ``forward`` during the run (their
    hooks still fire). Raises the model's own error."""
    modules = dict(model.named_modules())
    for name, forward in (forwards or {}).items():
        modules[name].forward = forward
    state = {k: v.to("meta") for k, v in _state(model)}
    args, kwargs = _as_call(_to_meta(example))
    try:
        with contextlib.ExitStack() as stack:
            stack.enter_context(MetaMemo())  # first: below every other mode (meta_memo.py)
            stack.enter_context(_no_grad_meta())
            for mode in modes:
                stack.enter_context(mode)
            return torch.func.functional_call(model, state, args, kwargs, strict=False)
    finally:
        for name in forwards or {}:
            del modules[name].forward


class ModuleTrail:
    """The modules whose forward is running, kept when one raises: ``where()`` then names the
    innermost, the one that failed."""

    def __init__(self, model: nn.Module):
        self.model, self.stack, self._hooks = model, [], []

    def __enter__(self) -> ModuleTrail:
        for name, module in self.model.named_modules():
            self._hooks.append(module.register_forward_pre_hook(self._push(name)))
            self._hooks.append(module.register_forward_hook(self._pop))
        return self

    def __exit__(self, *exc) -> None:
        for h in self._hooks:
            h.remove()

    def _push(self, name: str) -> Callable:
        def hook(module, args):
            self.stack.append(name)

        return hook

    def _pop(self, module, args, output) -> None:
        self.stack.pop()

    def innermost(self) -> str:
        """The innermost running module's path ('' for the model itself)."""
        return self.stack[-1] if self.stack else ""

    def where(self) -> str:
        """The innermost running module, in words."""
        if not self.stack or not self.stack[-1]:
            return f"{type(self.model).__name__}'s own forward"
        name = self.stack[-1]
        return f"'{name}' ({type(self.model.get_submodule(name)).__name__})"


class AttentionRecorder(TorchFunctionMode):
    """Records every ``scaled_dot_product_attention`` call (``AttentionCall``) made inside
    ``model``, with the innermost module whose forward was running; with a ``tagger`` (the
    trace's), also the sources of its query, key and value."""

    def __init__(self, model: nn.Module, tagger: _Tagger | None = None):
        super().__init__()
        self.model, self.calls, self._stack = model, [], [""]
        self.tagger = tagger
        self._hooks: list = []

    def __enter__(self):
        for name, module in self.model.named_modules():
            self._hooks.append(module.register_forward_pre_hook(self._push(name)))
            self._hooks.append(module.register_forward_hook(self._pop, always_call=True))
        return super().__enter__()

    def __exit__(self, *exc):
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        return super().__exit__(*exc)

    def _push(self, name: str) -> Callable:
        def hook(module, args):
            self._stack.append(name)

        return hook

    def _pop(self, module, args, output) -> None:
        if len(self._stack) > 1:
            self._stack.pop()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            q = kwargs.get("query", args[0] if args else None)
            k = kwargs.get("key", args[1] if len(args) > 1 else None)
            v = kwargs.get("value", args[2] if len(args) > 2 else None)
            if isinstance(q, Tensor) and isinstance(k, Tensor):
                srcs = tuple(self.tagger.get(t) for t in (q, k, v)) if self.tagger else ()
                call = AttentionCall(self._stack[-1], tuple(q.shape), tuple(k.shape), srcs)
                self.calls.append(call)
        return func(*args, **kwargs)


def first_input_shape(*args, **kwargs):
    """An opaque layer's output on meta: the shape of its first tensor input."""
    first = next(t for t in tree_flatten((args, kwargs))[0] if isinstance(t, Tensor))
    return torch.empty_like(first)


def _state(model: nn.Module) -> Iterator[tuple[str, Tensor]]:
    yield from model.named_parameters()  # tied weights once: functional_call re-ties them
    yield from model.named_buffers()


def _as_call(example: Any) -> tuple[tuple, dict]:
    if isinstance(example, dict):
        return (), example
    if isinstance(example, tuple | list):
        return tuple(example), {}
    return (example,), {}


@contextlib.contextmanager
def _no_grad_meta() -> Iterator[None]:
    with torch.no_grad(), torch.device("meta"):
        yield
