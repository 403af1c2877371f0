"""The stage table: which layers each pipeline stage holds and what it costs (printable).

``engine.plan`` prints it after the layers; ``build_stage`` sets it on every stage module
(``engine.model.stage_table``), the same table on every rank.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from gridtrain.parallel.pipeline.balance import LayerCosts


@dataclass(frozen=True)
class StageRow:
    """One stage: its chunks' layer names, the parameters it holds (a weight tied to another
    stage counted here too) and its share of the estimated compute."""

    stage: int
    chunks: tuple[tuple[str, ...], ...]
    params: int
    compute: float


@dataclass(frozen=True)
class StageTable:
    """Every stage of one cut (``rows``), the method and the model's parameter count."""

    method: str
    total_params: int  # the dense model's parameters, a tied weight once
    rows: tuple[StageRow, ...]

    def share(self, stage: int) -> float:
        """The stage's parameters over the model's."""
        return self.rows[stage].params / (self.total_params or 1)

    def __str__(self) -> str:
        head = (
            f"pipeline stages: {len(self.rows)}, partition {self.method!r}; share of the model's "
            f"{self.total_params:,} parameters (a tied weight counts on each stage holding it) "
            "and of its compute (multiplied weights)"
        )
        rows = [("stage", "layers", "parameters", "share", "compute")]
        for r in self.rows:
            layers = " | ".join(compress(c) for c in r.chunks)
            share = f"{self.share(r.stage):.2f}"
            rows.append((str(r.stage), layers, f"{r.params:,}", share, f"{r.compute:.2f}"))
        widths = [max(len(r[i]) for r in rows) for i in range(5)]
        just = (str.ljust, str.ljust, str.rjust, str.rjust, str.rjust)
        lines = [
            "  " + "  ".join(j(c, w) for c, w, j in zip(r, widths, just, strict=True)) for r in rows
        ]
        return "\n".join([head, *lines])


def stage_table(
    method: str, bounds: list[tuple[int, int]], names: list[str], costs: LayerCosts, stages: int
) -> StageTable:
    """The table of a cut: part ``c * stages + s`` is chunk ``c`` of stage ``s``."""
    total_compute = costs.span_compute(0, len(names)) or 1
    rows = []
    for s in range(stages):
        spans = bounds[s::stages]
        held: dict[int, int] = {}
        for start, end in spans:
            for layer in costs.params[start:end]:
                held.update(layer)
        compute = sum(costs.span_compute(a, b) for a, b in spans) / total_compute
        chunks = tuple(tuple(names[a:b]) for a, b in spans)
        rows.append(StageRow(s, chunks, sum(held.values()), compute))
    return StageTable(method, costs.total_params, tuple(rows))


_NUMBERED = re.compile(r"^(.*\.)?(\d+)$")  # "blocks.3" or a Sequential's "3"


def compress(names: tuple[str, ...]) -> str:
    """``a, b.0, b.1, b.2, c`` as ``a, b.0-2, c`` (runs of consecutive numbered siblings)."""
    out: list[str] = []
    run: tuple[str, int, int] | None = None  # prefix, first, last
    for name in (*names, None):
        m = _NUMBERED.match(name) if name is not None else None
        prefix = (m.group(1) or "") if m else ""
        if run and m and prefix == run[0] and int(m.group(2)) == run[2] + 1:
            run = (run[0], run[1], run[2] + 1)
            continue
        if run:
            out.append(f"{run[0]}{run[1]}" + (f"-{run[2]}" if run[2] > run[1] else ""))
            run = None
        if m:
            run = (prefix, int(m.group(2)), int(m.group(2)))
        elif name is not None:
            out.append(name)
    return ", ".join(out)
