"""Which orientation each layer's activations arrive in under 3d, read off the data flow.

A Linear flips the orientation (its output's hidden and row axes swap, see ``cube.py``);
every other layer keeps it; embeddings start at 0. Every path between two layers must
therefore pass an equal parity of Linears.
"""

from __future__ import annotations

from gridtrain.parallel.tensor.plan import DROPOUT, LINEAR, PlanError
from gridtrain.parallel.tensor.trace import Flow


def orientations(kinds: dict[str, str], flow: Flow) -> dict[str, int]:
    """The orientation of each layer's input (module docstring)."""
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


def orientation_options(kinds: dict[str, str], styles, flow: Flow) -> dict[str, dict]:
    """Every layer but a dropout is built for the orientation of its input."""
    orient = orientations(kinds, flow)
    return {n: {"orientation": orient.get(n, 0)} for n, k in kinds.items() if k != DROPOUT}
