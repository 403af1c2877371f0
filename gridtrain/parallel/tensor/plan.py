"""The tensor-parallel plan's data model: layer kinds, the plan and its printing.

A plan maps module paths to style names (each style defined once, in ``style.py``). It comes
from, in order of precedence, the config (``parallel.tensor.plan``: patterns such as
``"blocks.*.attn.qkv"``, ``*`` standing for one name part, as in Hugging Face's
``tp_plan``), hints on ``gt.nn`` layers (``gt.nn.Linear(split="row")``),
the model's own plan (Hugging Face's ``_tp_plan``), and for every layer left
the model's data flow, traced once on the meta device (``trace.py``) and read by
the tensor mode's spec (``spec.py``; 1d: ``mode_1d/styles.py``, 2d/2.5d/3d:
``blocked.py``). ``parallelize.py`` builds and applies it.

``print(plan)`` lists every layer with its style and this rank's shard shapes.
"""

from __future__ import annotations

import difflib
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, Protocol

from torch import nn

from gridtrain.parallel.tags import get_shard_spec
from gridtrain.parallel.tensor.base import is_transposed_linear
from gridtrain.parallel.tensor.none.layers import PatchEmbedding
from gridtrain.parallel.tensor.norm import norm_kind
from gridtrain.parallel.tensor.probe import computes_linear
from gridtrain.parallel.tensor.style import (  # the kinds, re-exported for the planner's users
    ATTENTION,
    DROPOUT,
    EMBEDDING,
    LINEAR,
    NORM,
    OPAQUE,
    PATCH,
    STYLES,
)
from gridtrain.parallel.tensor.trace import FRESH, PASS, SELF
from gridtrain.parallel.tensor.trace import OPAQUE as OPAQUE_HOW


class PlanError(ValueError):
    """A plan that does not fit the model: names the module, the dims and the divisor."""


def kind_of(module: nn.Module) -> str | None:
    """The planner's name for what ``module`` is, or None for a module it looks inside."""
    if getattr(module, "gt_parallel", False) or any(
        get_shard_spec(p) for p in module.parameters(recurse=False)
    ):
        return OPAQUE  # already parallel (a gridtrain layer, or sharded by hand with tags)
    if isinstance(module, nn.MultiheadAttention):
        return ATTENTION
    if (isinstance(module, nn.Linear) and computes_linear(module)) or is_transposed_linear(module):
        return LINEAR
    if isinstance(module, nn.Embedding):
        return EMBEDDING
    if isinstance(module, PatchEmbedding):
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
    ATTENTION: PASS,  # its in_proj and out_proj: layout (and 3d orientation) in = out
}


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
        if kind in (OPAQUE, PATCH, ATTENTION):
            skip.append(name)
    return out


def pattern_matches(pattern: str, name: str) -> bool:
    """Hugging Face tp_plan matching: dotted parts, ``*`` stands for any one part."""
    p, n = pattern.split("."), name.split(".")
    return len(p) == len(n) and all(a in ("*", b) for a, b in zip(p, n, strict=True))


def match_patterns(
    patterns: dict[str, str], names: list[str], source: str, strict: bool, known: bool = True
) -> dict[str, str]:
    """Module -> style for ``patterns``; with ``strict`` a pattern that matches nothing is an
    error; with ``known`` a style gridtrain does not implement is one (else the caller
    decides, per module)."""
    out: dict[str, str] = {}
    for pattern, style in patterns.items():
        if known and style not in STYLES:
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
    experts: Any = None  # the expert layout (an adapter's, e.g. gridtrain.hf.moe), printed last

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
        if self.experts is not None:
            lines.append(str(self.experts))
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


class ModelAdapter(Protocol):
    """What a model library adds to planning, for the models it defines: ``gridtrain.hf``
    for Hugging Face ``transformers`` models. Chosen above ``parallel/`` (``gridtrain.adapters``)
    and handed in, so the planner never imports a library's support. ``own_plan_name``:
    optional, what messages call the model's own plan (``"_tp_plan"``)."""

    def plan_model(self, model: nn.Module, ctx, example: Any) -> tuple[dict[str, str], Any]:
        """The model's plan (module pattern -> style) and the example to trace it with."""

    def after_apply(self, model: nn.Module, plan: Plan, ctx) -> None:
        """Fixes the model's own code needs once its layers are sharded (local head counts)."""

    def local_view(self, model: nn.Module, plan: Plan, ctx) -> AbstractContextManager:
        """The same fixes, undone on exit: the planner's forward on this rank's shapes runs
        the model's code as it will run once sharded."""

    def pipeline_layers(self, model: nn.Module) -> list[tuple[str, nn.Module]]:
        """The model's layers in execution order, for a pipeline to cut between."""

    def prepare_model(self, model: nn.Module, ctx) -> tuple[dict[int, nn.Parameter], Any]:
        """Optional, before planning, in every layout: e.g. spread the model's experts over
        EXPERT; returns old parameter id -> new parameter and a printable expert layout
        (``Plan.experts``, None for none)."""

    def example_input(self, model: nn.Module) -> Any:
        """Optional: an input to trace the model with when the user gave none and there is no
        batch (Hugging Face: the model's ``dummy_inputs``); None for none."""


def layout_of(ctx) -> dict[str, Any]:
    """The data / pipeline sizes and the ZeRO stage of ``ctx``'s layout, for ``Plan.layout``."""
    zero = getattr(ctx.config, "zero", None)
    stage = None
    if zero is not None:
        stage = f"stage {zero.stage}" + (" with offload (Gemini)" if zero.offload else "")
    return {"data": ctx.data_parallel_size, "pipeline": ctx.pipeline_parallel_size, "zero": stage}


def _shape(shape: tuple[int, ...]) -> str:
    return "[" + ",".join(str(s) for s in shape) + "]"
