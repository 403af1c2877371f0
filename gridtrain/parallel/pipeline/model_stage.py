"""A pipeline stage that runs the model's own forward, the layers other stages hold skipped.

A model whose forward does more than chain its layers (a Hugging Face model scales its
embedding, soft-caps its logits, builds masks and rotary tables) cannot be cut into a
list of layers without re-writing that forward, and a re-written forward loses whatever a
family adds. So every stage keeps the model and runs its ``forward`` (torchtitan runs its
model's forward with missing layers; Hugging Face's ``_pp_plan`` names the cut points):

* the *units* a cut may fall between (``StageUnit``: embeddings, blocks, final norm, head)
  that other stages hold are replaced by parameter-free stand-ins, so the stage holds, and
  its ``state_dict`` lists under the dense keys, its own units and nothing else;
* before the chunk's first unit, stand-ins return placeholders (``Placeholder``): a unit
  given token ids returns zeros of ``[*ids.shape, width]`` (the width of the activation
  received), any other returns its input. What the model computes from them (masks, rotary
  tables, positions) is computed as in one process, and their values are never used;
* a forward pre-hook on the chunk's first unit puts the activation received from the
  previous stage in place of its input;
* the first unit after the chunk stops the forward (``StopForward``, caught by the stage)
  and its input, the activation, goes to the next stage. On the last stage the forward runs
  to its end and the stage returns the model's output;
* during one chunk of an interleaved schedule, the stage's units of its other chunks are
  stand-ins too.

Whatever the model does between two units (scales, multipliers, soft caps, final norms)
therefore runs, by the model's own code, on the stage holding the unit it follows. A value
computed from a placeholder that reaches a unit the chunk runs, other than the activation
replaced there, or the chunk's output, is refused (``PlanError``): it would be something
other than the activation crossing the cut.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from gridtrain.parallel.tensor.plan import PlanError

__all__ = ["ModelCut", "Placeholder", "StageUnit", "StandIn", "StopForward", "cut_model"]


@dataclass(frozen=True)
class StageUnit:
    """One unit of a model cut: its dotted path, the module, whether a stage may begin with it
    (its first input is the activation; a unit given token ids is not) and the keyword of
    that input when the model passes it by name (the adapter's: ``hidden_states``)."""

    name: str
    module: nn.Module
    cut_before: bool
    arg: str


@dataclass(frozen=True)
class ModelCut:
    """How a model library's adapter cuts a model whose forward every stage runs: its units in
    execution order, the keys a dict batch may hold (they reach every stage's forward), and
    keyword arguments every stage adds to the forward (``use_cache=False``)."""

    units: tuple[StageUnit, ...]
    batch_keys: tuple[str, ...]
    call_kwargs: dict[str, Any] = field(default_factory=dict)


class StopForward(BaseException):  # noqa: N818 - a control-flow signal, not an error
    """Raised by the stand-in after the chunk: the forward stops, the activation leaves.

    A ``BaseException``, so that a model's ``except Exception`` cannot swallow it."""

    def __init__(self, activation: Any):
        super().__init__()
        self.activation = activation


class Placeholder(Tensor):
    """A tensor computed from a stand-in of a unit this chunk does not run; its value is never
    used. ``torch.Tensor``'s default ``__torch_function__`` makes every result computed from
    one a ``Placeholder`` too, which is how a value crossing a cut other than the activation
    is caught."""


class StandIn(nn.Module):
    """Holds the place of a unit this chunk does not run: no parameters, no buffers."""

    def __init__(self, unit: StageUnit, index: int, state: _StageState):
        super().__init__()
        self.unit_name, self.index, self.arg = unit.name, index, unit.arg
        self.__dict__["_state"] = state  # not a submodule

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self._state.stand_in(self, args, kwargs)

    def extra_repr(self) -> str:
        return f"stands for {self.unit_name!r}"


@dataclass
class _Run:
    """One chunk's forward: its units ``first..last``, the activation received (None on the
    model's first part) and what happened."""

    first: int
    last: int
    received: Tensor | None
    substituted: bool = False
    stopped: bool = False


class _StageState:
    """A stage's units, stand-ins and chunks, and the chunk running now."""

    def __init__(self, model: nn.Module, cut: ModelCut, owned: set[int], chunks, stage: int):
        self.cut, self.stage, self.chunks = cut, stage, chunks
        self.owned = owned
        self.names = [u.name for u in cut.units]
        self.model_name = type(model).__name__
        self.slots = [_parent_and_leaf(model, u.name) for u in cut.units]
        self.modules = [u.module if i in owned else None for i, u in enumerate(cut.units)]
        self.stand_ins = [StandIn(u, i, self) for i, u in enumerate(cut.units)]
        self.run: _Run | None = None

    # ---- which module sits in each unit's place ----------------------------------------------
    def place(self, first: int | None = None, last: int | None = None) -> None:
        """Units ``first..last`` in place (None: every unit this stage holds), stand-ins elsewhere."""
        for i, (parent, leaf) in enumerate(self.slots):
            runs = i in self.owned if first is None else first <= i <= last
            module = self.modules[i] if runs else self.stand_ins[i]
            if parent._modules[leaf] is not module:
                parent._modules[leaf] = module

    @contextlib.contextmanager
    def running(self, chunk: int, received: Tensor | None) -> Iterator[_Run]:
        first, last = self.chunks[chunk]
        run = _Run(first, last, received)
        self.place(first, last)
        self.run = run
        try:
            yield run
        finally:
            self.run = None
            self.place()

    # ---- stand-ins and hooks -----------------------------------------------------------------
    def stand_in(self, stand_in: StandIn, args: tuple, kwargs: dict) -> Any:
        run = self.run
        name = stand_in.unit_name
        if run is None:
            raise PlanError(
                f"'{name}' of {self.model_name} is held by another pipeline stage: run the "
                "model through engine.execute_schedule"
            )
        if stand_in.index > run.last:
            run.stopped = True
            raise StopForward(self._activation(name, stand_in.arg, args, kwargs))
        x = next((t for t in (*args, *kwargs.values()) if isinstance(t, Tensor)), None)
        if x is None:
            raise PlanError(f"pipeline: '{name}' of {self.model_name} was called with no tensor")
        if x.is_floating_point():
            return x  # an activation: the stand-in passes it on (a placeholder already)
        width = run.received.shape[-1]  # token ids: what an embedding would return
        out = torch.zeros((*x.shape, width), dtype=run.received.dtype, device=x.device)
        return out.as_subclass(Placeholder)

    def pre_hook(self, index: int):
        def hook(module: nn.Module, args: tuple, kwargs: dict):
            run = self.run
            if run is None:
                return None
            name = self.names[index]
            if index == run.first and run.received is not None and not run.substituted:
                run.substituted = True
                arg = self.cut.units[index].arg
                self._activation(name, arg, args, kwargs)  # it must be there
                if args:
                    args = (run.received, *args[1:])
                else:
                    kwargs = {**kwargs, arg: run.received}
            _refuse_placeholders((args, kwargs), f"'{name}' is given", self.model_name)
            return args, kwargs

        return hook

    def _activation(self, name: str, arg: str, args: tuple, kwargs: dict) -> Any:
        if args:
            return args[0]
        if arg in kwargs:
            return kwargs[arg]
        raise PlanError(
            f"pipeline: {self.model_name} calls '{name}' without its activation (positional, "
            f"or '{arg}='); a stage cannot begin or end there"
        )

    def finish(self, run: _Run, out: Any, last_part: bool) -> Any:
        """The chunk's output, once checked: the activation, or on the last part the model's."""
        if run.received is not None and not run.substituted:
            raise PlanError(
                f"pipeline: {self.model_name}'s forward never called "
                f"'{self.names[run.first]}', where this stage begins"
            )
        if not last_part and not run.stopped:
            raise PlanError(
                f"pipeline: {self.model_name}'s forward returned without calling "
                f"'{self.names[run.last + 1]}', where the next stage begins"
            )
        what = (
            "the model's output" if last_part else f"the activation after '{self.names[run.last]}'"
        )
        _refuse_placeholders(out, what + " is", self.model_name)
        return out


class RunsModelForward:
    """Mixed into the class of a model cut by ``cut_model``: calling the stage runs one chunk.

    ``stage(*inputs, chunk=c, batch=None, **kwargs)``: on the model's first part ``inputs`` /
    ``kwargs`` are the (micro-)batch; elsewhere ``inputs`` is the activation received and
    ``batch`` the micro-batch, which the model's forward gets again (masks, positions)."""

    def __call__(self, *inputs: Any, chunk: int = 0, batch: Any = None, **kwargs: Any) -> Any:
        state: _StageState = self.__dict__["gt_stage"]
        received = None
        if batch is not None:
            (received,) = inputs  # one activation crosses a cut
            inputs, kwargs = _as_call(batch)
        with state.running(chunk, received) as run:
            out = super().__call__(*inputs, **{**state.cut.call_kwargs, **kwargs})
        last_part = run.last == len(state.names) - 1
        return state.finish(run, out, last_part)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().forward(*args, **kwargs)
        except StopForward as stop:  # inside forward: the module's hooks see a normal return
            return stop.activation

    def check_stage_inputs(self, data: Any) -> None:
        """Refuse a batch the stages cannot all run (``PlanError``), before any transfer."""
        state: _StageState = self.__dict__["gt_stage"]
        if not isinstance(data, dict):
            return
        allowed = state.cut.batch_keys
        unknown = sorted(k for k in data if k not in allowed)
        if unknown:
            raise PlanError(
                f"pipeline: batch keys {unknown} cannot be given to {state.model_name} under "
                f"pipeline parallelism; a dict batch may hold {list(allowed)} (each reaches "
                "every stage's forward) and 'labels' (the criterion's)"
            )
        odd = sorted(k for k, v in data.items() if not isinstance(v, Tensor))
        if odd:
            raise PlanError(f"pipeline: batch keys {odd} must be tensors (batch first)")


def cut_model(
    model: nn.Module, cut: ModelCut, owner: list[int], chunks: list[tuple[int, int]], stage: int
) -> nn.Module:
    """Keep ``stage``'s units of ``model`` in place (``owner[i]``: the stage of unit ``i``;
    ``chunks``: this stage's ``[start, end)`` unit ranges, one per chunk); returns ``model``,
    its class now mixing in ``RunsModelForward``."""
    owned = {i for i, s in enumerate(owner) if s == stage}
    state = _StageState(model, cut, owned, [(a, b - 1) for a, b in chunks], stage)
    for i in owned:
        cut.units[i].module.register_forward_pre_hook(state.pre_hook(i), with_kwargs=True)
    state.place()  # other stages' units leave: their parameters are freed
    cls = type(model)
    model.__class__ = type(cls.__name__, (RunsModelForward, cls), {"__module__": cls.__module__})
    model.gt_stage = state
    return model


def _parent_and_leaf(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    *path, leaf = name.split(".")
    parent = model.get_submodule(".".join(path)) if path else model
    return parent, leaf


def _as_call(batch: Any) -> tuple[tuple, dict]:
    if isinstance(batch, dict):
        return (), dict(batch)
    if isinstance(batch, tuple | list):
        return tuple(batch), {}
    return (batch,), {}


def _refuse_placeholders(obj: Any, what: str, model_name: str) -> None:
    path = _find_placeholder(obj, "")
    if path is not None:
        raise PlanError(
            f"pipeline: {what} a value ({path or 'itself'}) computed from layers of other "
            f"stages; in {model_name} more than the activation would cross a stage boundary, "
            "so the model cannot be cut there"
        )


def _find_placeholder(obj: Any, path: str) -> str | None:
    if isinstance(obj, Placeholder):
        return path
    if isinstance(obj, dict):
        items = obj.items()
    elif isinstance(obj, tuple | list):
        items = enumerate(obj)
    else:
        return None
    for key, value in items:
        found = _find_placeholder(value, f"{path}[{key!r}]")
        if found is not None:
            return found
    return None
