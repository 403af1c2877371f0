"""Readable views of a layout's rank grid at any scale (``gridtrain topo``): a summary per
mode, one rank's groups, or every group.

Listing every group (``format_topology``) grows with the world: 60 KB at 1024 ranks.
Every mode's groups are translates of one lattice, ``r + s1*i1 + s2*i2 + ...`` with
``0 <= ik < nk`` (innermost first, in local-rank order), so the summary prints each
mode's group count and size, those strides and one example group: a few lines whatever
the world size. ``gridtrain topo --rank N`` lists the groups of one rank in full.
"""

from __future__ import annotations

from gridtrain.parallel.layout import Layout
from gridtrain.parallel.topology import group_of

Axes = list[tuple[int, int]]  # (stride, count), innermost first
EXAMPLE_MAX = 8  # an example group longer than this is shown as its head and its last rank


def stride_axes(group: tuple[int, ...] | list[int]) -> Axes | None:
    """The lattice ``group`` is, ``[(stride, count), ...]`` innermost first, or None.

    ``group == expand(group[0], axes)`` in order; axes whose strides continue each other
    (stride 1 x 2 then stride 2 x 2) are merged, so a run of adjacent ranks is one axis.
    """
    n = len(group)
    if n == 1:
        return []
    step = group[1] - group[0]
    run = 1
    while run < n and group[run] == group[0] + run * step:
        run += 1
    # the innermost axis is an initial run whose length divides the group: try the longest
    for k in range(run, 1, -1):
        if n % k:
            continue
        blocks = [group[i : i + k] for i in range(0, n, k)]
        if all(list(b) == [b[0] + i * step for i in range(k)] for b in blocks):
            rest = stride_axes([b[0] for b in blocks])
            if rest is not None:
                return _merged([(step, k), *rest])
    return None


def _merged(axes: Axes) -> Axes:
    out: Axes = []
    for stride, count in axes:
        if out and stride == out[-1][0] * out[-1][1]:
            out[-1] = (out[-1][0], out[-1][1] * count)
        else:
            out.append((stride, count))
    return out


def expand(first: int, axes: Axes) -> list[int]:
    """The ranks of the lattice starting at ``first`` (the inverse of ``stride_axes``)."""
    ranks = [first]
    for stride, count in axes:
        ranks = [r + i * stride for i in range(count) for r in ranks]
    return ranks


def describe_axes(axes: Axes | None) -> str:
    """``stride 8`` for one axis, ``stride 1 x2, stride 4 x2`` for several, ``-`` for one rank."""
    if axes is None:
        return "irregular"
    if not axes:
        return "-"
    if len(axes) == 1:
        return f"stride {axes[0][0]}"
    return ", ".join(f"stride {s} x{n}" for s, n in axes)


def _short(group: tuple[int, ...]) -> str:
    if len(group) <= EXAMPLE_MAX:
        return "[" + ",".join(map(str, group)) + "]"
    head = ",".join(map(str, group[: EXAMPLE_MAX - 4]))
    return f"[{head},...,{group[-1]}]"


def topology_header(layout: Layout) -> list[str]:
    """The grid's sizes and the rank formula: the first lines of every view."""
    cfg = layout.config
    return [
        f"world {layout.world_size()} = data {layout.data_parallel_size} x pipeline "
        f"{layout.pipeline_parallel_size} x tensor {layout.tensor_parallel_size}"
        f" (tensor mode {layout.tensor_mode}, expert parallel {cfg.moe.expert_parallel_size})",
        "global_rank = ((d * P) + p) * T + t",
    ]


def format_topology(layout: Layout) -> str:
    """Every group of every mode in full (``gridtrain topo --full``)."""
    lines = topology_header(layout)
    for mode, parts in layout.partitions.items():
        shown = " ".join("[" + ",".join(map(str, g)) + "]" for g in parts)
        lines.append(f"{mode.name:<28} {len(parts):>5} groups of {len(parts[0]):<5} {shown}")
    return "\n".join(lines)


def summarize_topology(layout: Layout) -> str:
    """Per mode: group count, size, stride pattern and rank 0's group (``gridtrain topo``)."""
    lines = topology_header(layout)
    lines.append(f"{'mode':<28} {'groups':>6} {'size':>5}  {'ranks of a group':<32} rank 0's group")
    for mode, parts in layout.partitions.items():
        each = [stride_axes(g) for g in parts]
        axes = each[0] if all(a == each[0] for a in each) else None
        lines.append(
            f"{mode.name:<28} {len(parts):>6} {len(parts[0]):>5}  {describe_axes(axes):<32} "
            f"{_short(group_of(parts, 0))}"
        )
    lines += [
        "stride S: ranks r, r+S, r+2S, ... from the group's first rank r",
        "stride S xN, stride U xM: N ranks S apart, M such runs U apart",
        "--rank R: every group of rank R; --full: every group of every mode",
    ]
    return "\n".join(lines)


def format_rank(layout: Layout) -> str:
    """Every group of the layout's rank, in local-rank order (``gridtrain topo --rank R``)."""
    d, p, t = layout.coordinates
    lines = topology_header(layout)
    lines.append(f"rank {layout.global_rank}: d={d}, p={p}, t={t}")
    lines.append(f"{'mode':<28} {'local rank':>12}  group")
    for mode in layout.partitions:
        local = f"{layout.local_rank(mode)} of {layout.world_size(mode)}"
        lines.append(f"{mode.name:<28} {local:>12}  {_runs(layout.ranks(mode))}")
    return "\n".join(lines)


def _runs(group: tuple[int, ...]) -> str:
    """``[0-7,16-23]``: every rank in order, three or more adjacent ones as ``first-last``."""
    parts, start = [], 0
    for i in range(1, len(group) + 1):
        if i == len(group) or group[i] != group[i - 1] + 1:
            run = group[start:i]
            parts += [f"{run[0]}-{run[-1]}"] if len(run) >= 3 else list(map(str, run))
            start = i
    return "[" + ",".join(parts) + "]"
