"""The tensor-parallel plan: which style each layer of a model gets, and why.

A plan maps module paths to styles (``config_names.STYLES``). It comes from, in order
of precedence, the config (``parallel.tensor.plan``: patterns such as
``"blocks.*.attn.qkv"``, ``*`` standing for one name part, as in Hugging
Face's ``tp_plan``), hints on ``gt.nn`` layers (``gt.nn.Linear(split="row")``),
the model's own plan (Hugging Face's ``_tp_plan``), and for every layer left
the model's data flow, traced once on the meta device (``trace.py``):

* 1d: a Linear that reads column-parallel outputs is row-parallel; a Linear on
  replicated activations is column-parallel when every Linear reading its
  output can be row-parallel, else it gathers its output (an LM head, a
  projection into a norm); embeddings split the vocabulary when it divides;
* 2d / 2.5d: every Linear is a SUMMA Linear, except one whose output is a model
  output (a head): the mode's Classifier, logits gathered;
* 3d: as 2d, and each layer's orientation follows the data flow (a Linear
  flips it, embeddings start at 0).

``print(plan)`` lists every layer with its style and this rank's shard shapes.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from gridtrain.config_names import STYLES
from gridtrain.parallel.tags import get_shard_spec
from gridtrain.parallel.tensor.base import is_conv1d
from gridtrain.parallel.tensor.norm import norm_kind
from gridtrain.parallel.tensor.trace import FRESH, PASS, SELF, Flow
from gridtrain.parallel.tensor.trace import OPAQUE as OPAQUE_HOW

LINEAR, EMBEDDING, NORM, DROPOUT, PATCH, OPAQUE = (
    "linear",
    "embedding",
    "norm",
    "dropout",
    "patch",
    "opaque",
)
COL_SHARDED = ("colwise", "packed_colwise")  # output left sharded for a row-parallel reader
ROW = ("rowwise",)
HEAD_STYLES = ("gather_output", "colwise_gather_output", "vocab_parallel")
KIND_STYLES = {
    LINEAR: (
        "colwise",
        "rowwise",
        "colwise_gather_output",
        "rowwise_split_input",
        "packed_colwise",
        "vocab_parallel",
        "gather_output",
        "auto",
        "replicate",
    ),
    EMBEDDING: ("embedding_rowwise", "embedding_colwise", "colwise", "replicate"),
    NORM: ("norm", "replicate"),
    DROPOUT: ("replicate",),
    PATCH: ("colwise", "replicate"),
    OPAQUE: ("replicate",),
}


class PlanError(ValueError):
    """A plan that does not fit the model: names the module, the dims and the divisor."""


def kind_of(module: nn.Module) -> str | None:
    """The planner's name for what ``module`` is, or None for a module it looks inside."""
    if getattr(module, "gt_parallel", False) or any(
        get_shard_spec(p) for p in module.parameters(recurse=False)
    ):
        return OPAQUE  # already parallel (a gridtrain layer, or sharded by hand with tags)
    if isinstance(module, nn.Linear) or is_conv1d(module):
        return LINEAR
    if isinstance(module, nn.Embedding):
        return EMBEDDING
    if type(module).__name__ == "PatchEmbedding" and hasattr(module, "cls_token"):
        return PATCH
    if norm_kind(module) is not None:
        return NORM
    if isinstance(module, nn.Dropout):
        return DROPOUT
    return None


TRACE_HOW = {
    LINEAR: SELF,
    EMBEDDING: FRESH,
    PATCH: FRESH,
    OPAQUE: OPAQUE_HOW,
    NORM: PASS,
    DROPOUT: PASS,
}


def model_adapter(model: nn.Module):
    """The adapter of the library ``model`` comes from, or None: ``gridtrain.hf`` for Hugging
    Face ``transformers`` models (their plans, head checks, attention and pipeline layers).

    An adapter module provides ``plan_model(model, ctx, example) -> (plan, example)``,
    ``after_apply(model, plan, ctx)`` and ``pipeline_layers(model)``. Imported only for
    such models, so gridtrain never imports ``transformers`` on its own.
    """
    if any(c.__module__.startswith("transformers.") for c in type(model).__mro__):
        import gridtrain.hf

        return gridtrain.hf
    return None


def tracked_modules(model: nn.Module) -> dict[str, str]:
    """Module path -> kind, for every module the planner may replace (not inside opaque ones)."""
    out: dict[str, str] = {}
    skip: list[str] = []
    for name, module in model.named_modules():
        if any(name.startswith(p + ".") for p in skip):
            continue
        kind = kind_of(module)
        if kind is None or not name:
            continue
        out[name] = kind
        if kind in (OPAQUE, PATCH) or isinstance(module, nn.MultiheadAttention):
            skip.append(name)
    return out


def pattern_matches(pattern: str, name: str) -> bool:
    """Hugging Face tp_plan matching: dotted parts, ``*`` stands for any one part."""
    p, n = pattern.split("."), name.split(".")
    return len(p) == len(n) and all(a in ("*", b) for a, b in zip(p, n, strict=True))


def match_patterns(
    patterns: dict[str, str], names: list[str], source: str, strict: bool
) -> dict[str, str]:
    """Module -> style for ``patterns``; with ``strict`` a pattern that matches nothing is an error."""
    out: dict[str, str] = {}
    for pattern, style in patterns.items():
        if style not in STYLES:
            raise PlanError(
                f"{source}: pattern '{pattern}' names style '{style}'; allowed: {', '.join(STYLES)}"
            )
        hits = [n for n in names if pattern_matches(pattern, n)]
        if not hits and strict:
            close = difflib.get_close_matches(pattern, names, n=3, cutoff=0.5)
            hint = f" (closest modules: {', '.join(close)})" if close else ""
            raise PlanError(f"{source}: pattern '{pattern}' matches no layer of the model{hint}")
        for n in hits:
            out.setdefault(n, style)
    return out


@dataclass
class PlanEntry:
    """One layer: what it is, the style it gets and the options its mode needs."""

    name: str
    kind: str
    style: str
    origin: str  # config | hint | model plan | traced | default
    options: dict[str, Any] = field(default_factory=dict)
    shards: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = field(default_factory=dict)
    specs: dict[str, Any] = field(default_factory=dict)  # parameter -> this rank's shard spec
    layer: str = ""  # the class that replaces it ("" = kept as it is)


@dataclass
class Plan:
    """The plan of one model under one layout (printable): every layer's style and shard
    shapes under the tensor mode, the data / pipeline / ZeRO layout around it, and an
    optional pipeline stage table (``stages``, anything printable)."""

    mode: str | None
    size: int
    entries: dict[str, PlanEntry] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    # Linears whose output is a model output: name -> (vocab, logits vocab-split)
    heads: dict[str, tuple[int, bool]] = field(default_factory=dict)
    layout: dict[str, Any] = field(default_factory=dict)  # data, pipeline, zero (see layout_of)
    params: int = 0  # the dense model's parameters (a tied weight once)
    params_sharded: int = 0  # of those, the ones held in shards (see coverage.count_sharded)
    stages: Any = None  # the pipeline stage table, printed after the layers

    def __getitem__(self, name: str) -> PlanEntry:
        return self.entries[name]

    def styles(self) -> dict[str, str]:
        return {n: e.style for n, e in self.entries.items()}

    @property
    def sharded_fraction(self) -> float:
        """The fraction of the dense model's parameters held in shards."""
        return self.params_sharded / self.params if self.params else 0.0

    def __str__(self) -> str:
        lines = [self._layout_line()]
        if self.mode is None:
            lines.append("tensor plan: none (no layer is split over a tensor group)")
        else:
            lines.append(
                f"tensor plan: mode {self.mode!r}, size {self.size}, {len(self.entries)} layers; "
                f"{self.sharded_fraction:.1%} of {self.params:,} parameters sharded"
            )
            lines += self._layer_rows()
        if self.stages is not None:
            lines.append(str(self.stages))
        return "\n".join(lines + [f"  note: {n}" for n in self.notes])

    def _layout_line(self) -> str:
        if not self.layout:
            return f"layout: tensor {self.size} ({self.mode})"
        zero = self.layout.get("zero") or "off"
        return (
            f"layout: data {self.layout['data']} x pipeline {self.layout['pipeline']} x tensor "
            f"{self.size} ({self.mode or 'no tensor mode'}); ZeRO {zero}"
        )

    def _layer_rows(self) -> list[str]:
        rows = [("layer", "style", "from", "becomes", "shard (dense -> this rank)")]
        for e in self.entries.values():
            opts = " ".join(f"{k}={v}" for k, v in e.options.items())
            shards = "; ".join(f"{p} {_shape(d)}->{_shape(s)}" for p, (d, s) in e.shards.items())
            style = e.style + (f" [{opts}]" if opts else "")
            rows.append((e.name, style, e.origin, e.layer or "(kept)", shards))
        widths = [max(len(r[i]) for r in rows) for i in range(4)]
        return [
            "  " + "  ".join(c.ljust(w) for c, w in zip(r[:4], widths, strict=True)) + "  " + r[4]
            for r in rows
        ]


def layout_of(ctx) -> dict[str, Any]:
    """The data / pipeline sizes and the ZeRO stage of ``ctx``'s layout, for ``Plan.layout``."""
    zero = getattr(ctx.config, "zero", None)
    stage = None
    if zero is not None:
        stage = f"stage {zero.stage}" + (" with offload (Gemini)" if zero.offload else "")
    return {"data": ctx.data_parallel_size, "pipeline": ctx.pipeline_parallel_size, "zero": stage}


def _shape(shape: tuple[int, ...]) -> str:
    return "[" + ",".join(str(s) for s in shape) + "]"


# ---- inference from the data flow --------------------------------------------------------
def infer_1d(
    kinds: dict[str, str],
    fixed: dict[str, str],
    flow: Flow | None,
    modules: dict[str, nn.Module],
    n: int,
) -> dict[str, tuple[str, str]]:
    """Style and origin of every layer under 1d (see the module docstring)."""
    out = {name: (style, "given") for name, style in fixed.items()}
    linears = [m for m in (flow.order if flow else kinds) if kinds.get(m) == LINEAR]
    if flow is not None:
        linears += [m for m in kinds if kinds[m] == LINEAR and m not in flow.sources]
    bad_sinks = _bad_sinks(kinds, flow)

    def sharded(name: str) -> bool:
        return out.get(name, ("", ""))[0] in COL_SHARDED

    def lin_sources(name: str) -> set[str]:
        return {s for s in (flow.sources.get(name, ()) if flow else ()) if kinds.get(s) == LINEAR}

    for name in linears:
        if name in out:
            continue
        if flow is None or name not in flow.sources:
            out[name] = (_head_style(modules[name], n), "default: not traced")
            continue
        srcs = lin_sources(name)
        if any(sharded(s) for s in srcs):
            if not all(sharded(s) for s in srcs):
                mixed = sorted(s for s in srcs if not sharded(s))
                raise PlanError(
                    f"1d: '{name}' reads column-parallel outputs mixed with replicated ones "
                    f"(from {mixed}); give its style in parallel.tensor.plan"
                )
            out[name] = ("rowwise", "traced: reads column-parallel outputs")
            continue
        if _can_pair(name, flow, kinds, out, bad_sinks, lin_sources, n, modules):
            out[name] = ("colwise", "traced: read by row-parallel layers")
        else:
            why = "feeds a norm or the output" if name in bad_sinks else "no row-parallel reader"
            out[name] = (_head_style(modules[name], n), f"traced: {why}")
    for name, kind in kinds.items():
        if name in out:
            continue
        if kind == EMBEDDING:
            emb = modules[name]
            style = "replicate"
            if emb.num_embeddings % n == 0:
                style = "embedding_rowwise"
            elif emb.embedding_dim % n == 0:
                style = "embedding_colwise"
            out[name] = (style, "default")
        elif kind == PATCH:
            out[name] = ("colwise", "default")
        else:
            out[name] = ("replicate", "default")
    return out


def _head_style(linear: nn.Module, n: int) -> str:
    from gridtrain.parallel.tensor.base import linear_dims

    return "colwise_gather_output" if linear_dims(linear)[1] % n == 0 else "replicate"


def _bad_sinks(kinds: dict[str, str], flow: Flow | None) -> set[str]:
    """Linears whose output reaches a norm, an opaque layer, a head or the model output."""
    if flow is None:
        return set()
    bad = set(flow.output_sources)
    for m, srcs in flow.sources.items():
        if kinds.get(m) in (NORM, OPAQUE, EMBEDDING, PATCH):
            bad |= srcs
    return bad


def _can_pair(name, flow, kinds, out, bad_sinks, lin_sources, n, modules) -> bool:
    """Whether ``name`` can be column-parallel: its readers all Linears that can be row-parallel."""
    if name in bad_sinks:
        return False
    readers = flow.consumers(name)
    if not readers:
        return False
    for reader in readers:
        if kinds.get(reader) != LINEAR or out.get(reader, ("rowwise",))[0] not in ROW:
            if kinds.get(reader) != DROPOUT:
                return False
        for other in lin_sources(reader):
            if other == name:
                continue
            done = out.get(other)
            if done is not None and done[0] not in COL_SHARDED:
                return False
            if done is None and other in bad_sinks:
                return False
    from gridtrain.parallel.tensor.base import linear_dims

    return linear_dims(modules[name])[1] % n == 0


def orientations(kinds: dict[str, str], flow: Flow) -> dict[str, int]:
    """3d: the orientation of each layer's activations (a Linear's input; see ``mode_3d.cube``)."""
    out_orient: dict[str, int] = {}
    result: dict[str, int] = {}
    for name in flow.order:
        srcs = sorted(s for s in flow.sources.get(name, ()) if s in out_orient)
        seen = {out_orient[s] for s in srcs}
        if len(seen) > 1:
            by = {o: [s for s in srcs if out_orient[s] == o] for o in seen}
            raise PlanError(
                f"3d: '{name}' reads activations of both orientations (orientation 0 from "
                f"{by[0]}, 1 from {by[1]}): every path between two layers must pass an equal "
                "parity of Linears"
            )
        orient = seen.pop() if seen else 0
        result[name] = orient
        if kinds.get(name) == LINEAR:
            out_orient[name] = 1 - orient
    return result
