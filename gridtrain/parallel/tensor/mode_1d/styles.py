"""Which style each layer gets under 1d, read off the data flow, and the checks on a given plan.

A Linear that reads column-parallel outputs is row-parallel; a Linear on replicated
activations is column-parallel when every Linear reading its output can be row-parallel,
else it gathers its output (an LM head, a projection into a norm); embeddings split the
vocabulary when it divides, else the embedding dim. Styles given by the config, hints or
the model's plan are kept, and checked against the same flow: a column layer must be read
by row layers, a row layer must read column layers. A norm given
``replicated_with_grad_allreduce`` (a per-head norm) may read column-parallel outputs; where
its input turns out whole, it is kept ``replicate`` (summing whole gradients would multiply
them).
"""

from __future__ import annotations

from torch import nn

from gridtrain.parallel.tensor.base import linear_dims
from gridtrain.parallel.tensor.flow_rules import check_columns, column_style
from gridtrain.parallel.tensor.plan import PlanError
from gridtrain.parallel.tensor.style import (
    ATTENTION,
    COLWISE,
    COLWISE_GATHER_OUTPUT,
    DROPOUT,
    EMBEDDING,
    EMBEDDING_COLWISE,
    EMBEDDING_ROWWISE,
    GRAD_SUMMED,
    HEADS,
    LINEAR,
    NORM,
    PATCH,
    REPLICATE,
    ROWWISE,
    of,
    styles_where,
)
from gridtrain.parallel.tensor.trace import Flow

# the kinds that may read a column-parallel (still split) output: a row-parallel Linear,
# and a dropout, which passes it on; every other layer needs the whole activation
_SPLIT_READERS = (LINEAR, DROPOUT)


def styles_1d(
    kinds: dict[str, str],
    given: dict[str, tuple[str, str]],
    flow: Flow | None,
    modules: dict[str, nn.Module],
    n: int,
) -> tuple[dict[str, str], dict[str, str]]:
    """Every tracked layer's style and origin under 1d (module docstring)."""
    inferred = _Inference(kinds, flow, modules, n).run({m: s for m, (s, _) in given.items()})
    origin = {m: given[m][1] if m in given else inferred[m][1] for m in kinds}
    styles = {m: s for m, (s, _) in inferred.items()}
    if flow is not None:
        _whole_inputs_replicate(styles, origin, kinds, flow)
        check_flow(styles, kinds, flow)
        check_columns(styles, kinds, flow, modules, styles_where(lambda s: s.column))
    return styles, origin


def _whole_inputs_replicate(styles, origin, kinds, flow: Flow) -> None:
    """A ``replicated_with_grad_allreduce`` norm whose input is whole stays ``replicate``."""
    for name, kind in kinds.items():
        if kind != NORM or styles[name] != GRAD_SUMMED.name:
            continue
        srcs = flow.sources.get(name, ())
        if not any(of(styles.get(s)).column for s in srcs):
            styles[name], origin[name] = REPLICATE.name, f"{origin[name]}; input whole under 1d"


def needs_flow(kinds: dict[str, str], given: dict) -> bool:
    """Only a Linear whose style is not given needs the flow to be planned."""
    return any(k == LINEAR and m not in given for m, k in kinds.items())


def dropout_options(kinds, styles, flow: Flow | None) -> dict[str, dict]:
    """A dropout on a column-parallel output draws a different mask on each rank."""
    out = {}
    for name, kind in kinds.items():
        if kind == DROPOUT:
            srcs = flow.sources.get(name, ()) if flow else ()
            out[name] = {"sharded": any(of(styles.get(s)).column for s in srcs)}
    return out


def split_sinks(kinds: dict[str, str], flow: Flow | None, styles: dict | None = None) -> set[str]:
    """Linears whose output reaches a norm (but a per-head one, ``styles``), an opaque layer,
    an embedding or the model output."""
    if flow is None:
        return set()
    bad = set(flow.output_sources)
    for m, srcs in flow.sources.items():
        if not _split_reader(m, kinds, styles or {}):
            bad |= srcs
    return bad


def _split_reader(name: str, kinds: dict[str, str], styles: dict[str, str]) -> bool:
    kind = kinds.get(name, LINEAR)
    return kind in _SPLIT_READERS or (kind == NORM and styles.get(name) == GRAD_SUMMED.name)


class _Inference:
    """One pass over the Linears in flow order, then defaults for everything else."""

    def __init__(self, kinds, flow: Flow | None, modules, n: int):
        self.kinds, self.flow, self.modules, self.n = kinds, flow, modules, n
        self.out: dict[str, tuple[str, str]] = {}
        self.fixed: dict[str, str] = {}
        self.bad_sinks: set[str] = set()

    def run(self, fixed: dict[str, str]) -> dict[str, tuple[str, str]]:
        self.out = {name: (style, "given") for name, style in fixed.items()}
        self.fixed, self.bad_sinks = fixed, split_sinks(self.kinds, self.flow, fixed)
        flow, kinds = self.flow, self.kinds
        linears = [m for m in (flow.order if flow else kinds) if kinds.get(m) == LINEAR]
        if flow is not None:
            linears += [m for m in kinds if kinds[m] == LINEAR and m not in flow.sources]
        for name in linears:
            if name not in self.out:
                self.out[name] = self._linear(name)
        for name, kind in kinds.items():
            if name not in self.out:
                self.out[name] = (self._default(kind, self.modules[name]), "default")
        return self.out

    def _sharded(self, name: str) -> bool:
        return of(self.out.get(name, ("", ""))[0]).column

    def _linear_sources(self, name: str) -> set[str]:
        srcs = self.flow.sources.get(name, ()) if self.flow else ()
        return {s for s in srcs if self.kinds.get(s) == LINEAR}

    def _linear(self, name: str) -> tuple[str, str]:
        if self.flow is None or name not in self.flow.sources:
            return self._head_style(name), "default: not traced"
        srcs = self._linear_sources(name)
        if any(self._sharded(s) for s in srcs):
            if not all(self._sharded(s) for s in srcs):
                mixed = sorted(s for s in srcs if not self._sharded(s))
                raise PlanError(
                    f"1d: '{name}' reads column-parallel outputs mixed with replicated ones "
                    f"(from {mixed}); give its style in parallel.tensor.plan"
                )
            return ROWWISE.name, "traced: reads column-parallel outputs"
        if self._can_pair(name):
            style = column_style(name, self.flow, self.modules, COLWISE.name)
            if style is not None:
                return style, "traced: read by row-parallel layers"
            why = "its output packs blocks no column split keeps whole"
            return self._head_style(name), f"traced: {why}: gathered"
        why = "feeds a norm or the output" if name in self.bad_sinks else "no row-parallel reader"
        return self._head_style(name), f"traced: {why}"

    def _head_style(self, name: str) -> str:
        out_features = linear_dims(self.modules[name])[1]
        return (COLWISE_GATHER_OUTPUT if out_features % self.n == 0 else REPLICATE).name

    def _can_pair(self, name: str) -> bool:
        """Whether ``name`` can be column-parallel: its readers all Linears that can be
        row-parallel (or dropouts), each reading only column-parallel Linears."""
        readers = self.flow.consumers(name)
        if name in self.bad_sinks or not readers:
            return False
        for reader in readers:
            kind = self.kinds.get(reader)
            if kind == NORM and _split_reader(reader, self.kinds, self.fixed):
                continue  # a per-head norm passes the split on
            if kind != DROPOUT and (
                kind != LINEAR or not of(self.out.get(reader, (ROWWISE.name,))[0]).row
            ):
                return False
            for other in self._linear_sources(reader) - {name}:
                done = self.out.get(other)
                if done is not None and not of(done[0]).column:
                    return False
                if done is None and other in self.bad_sinks:
                    return False
        return linear_dims(self.modules[name])[1] % self.n == 0

    def _default(self, kind: str, module: nn.Module) -> str:
        if kind == EMBEDDING:
            if module.num_embeddings % self.n == 0:
                return EMBEDDING_ROWWISE.name
            return (EMBEDDING_COLWISE if module.embedding_dim % self.n == 0 else REPLICATE).name
        return {PATCH: COLWISE, ATTENTION: HEADS}.get(kind, REPLICATE).name


def check_flow(styles: dict[str, str], kinds: dict[str, str], flow: Flow) -> None:
    """Column layers must be read by row layers, and row layers must read column layers."""
    bad = split_sinks(kinds, flow, styles)
    for name in flow.order:
        style = styles.get(name)
        if kinds.get(name) != LINEAR:
            continue
        srcs = {s for s in flow.sources.get(name, ()) if kinds.get(s) == LINEAR}
        if of(style).column:
            if name in bad:
                raise PlanError(
                    f"1d: '{name}' is {style} but its sharded output reaches a norm, a head or "
                    "the model output without a row-parallel layer; make it "
                    "colwise_gather_output or pair it with a rowwise layer"
                )
            for reader in flow.consumers(name):
                if kinds.get(reader) == LINEAR and not of(styles.get(reader)).row:
                    raise PlanError(
                        f"1d: two column layers in a row: '{name}' ({style}) is read by "
                        f"'{reader}' ({styles.get(reader)}); the reader must be rowwise"
                    )
        if of(style).row and srcs and not all(of(styles.get(s)).column for s in srcs):
            raise PlanError(
                f"1d: '{name}' is rowwise but reads replicated outputs of "
                f"{sorted(s for s in srcs if not of(styles.get(s)).column)}; "
                "use rowwise_split_input or make those colwise"
            )
