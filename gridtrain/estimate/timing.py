"""Step time from FLOPs and an alpha-beta model of each collective on the links its group spans.

A collective over ``n`` ranks costs ``steps(n) x alpha + bytes / bandwidth``, with
``bytes`` what one rank sends (``communication.py``) and the link the group's:
NVLink when every rank of the group sits in one node (``gpus_per_node``
consecutive ranks), the network otherwise. Which ranks a group holds comes from
``topology.build_groups`` on the layout (cut to enough data replicas to see
every node boundary the full world has). Latency steps: ring all-gather /
reduce-scatter ``n - 1``, all-reduce ``2 min(n - 1, log2 n)`` (NCCL's tree when
that is shorter), broadcast / reduce ``log2 n``, a ring pass or send 1.

Compute per micro-batch and stage: matmul FLOPs (forward ``2 x`` multiply-adds,
backward twice that, full recompute one forward more) over the rank's
``efficiency x peak``, plus memory-bound traffic: every saved activation written
and read once and its gradient written and read once (``4 x`` the inventory)
over HBM bandwidth. Tensor-parallel collectives and point-to-point transfers sit
on the critical path; the bucketed data-parallel all-reduce overlaps the last
backward (``parallel/sync/data_parallel.py``), so only what exceeds it shows. The
pipeline runs ``m + (P - 1) / v`` micro-batch slots per flush (1F1B and
interleaved, Narayanan et al. 2021), once per accumulation step. The optimizer
step is memory-bound: weights, gradients and states read and written once.
"""

from __future__ import annotations

import dataclasses
import functools
import math

from gridtrain.config import Config
from gridtrain.estimate.communication import FIRST_LAST, Collective
from gridtrain.estimate.devices import DeviceSpec
from gridtrain.estimate.scenario import Scenario
from gridtrain.parallel.mode import ParallelMode as PM
from gridtrain.parallel.tensor.modes import geometry_of
from gridtrain.parallel.topology import build_groups


def latency_steps(op: str, n: int) -> int:
    if n <= 1:
        return 0
    log = math.ceil(math.log2(n))
    if op == "all_reduce":
        return 2 * min(n - 1, log)
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        return n - 1
    if op in ("broadcast", "reduce"):
        return log
    return 1


@dataclasses.dataclass(frozen=True)
class Link:
    size: int
    internode: bool


@functools.lru_cache(maxsize=1024)
def _links(p: int, t: int, mode: str | None, depth: int, replicas: int, gpn: int):
    """Which groups of a layout cut to ``p`` stages and ``replicas`` data replicas span nodes."""
    tensor: dict = {"size": t, "mode": mode}
    if geometry_of(mode).uses_depth:
        tensor["depth"] = depth
    cfg = Config.from_dict({"parallel": {"pipeline": p, "tensor": tensor}})
    groups = build_groups(cfg, p * t * replicas)
    out = {m: (len(parts[0]), any(min(g) // gpn != max(g) // gpn for g in parts))
           for m, parts in groups.items()}  # fmt: skip
    out[FIRST_LAST] = (2, any(g[0] // gpn != g[-1] // gpn for g in groups[PM.PIPELINE]))
    return out


def group_links(sc: Scenario, gpus_per_node: int) -> dict:
    """Group -> ``Link(size, internode)`` for every group of the layout.

    ``topology.build_groups`` runs on the layout cut to as few pipeline stages and data
    replicas as still cross a node boundary wherever the full world's groups do (a
    group of stride ``s`` spans nodes once it holds ``ceil(gpus_per_node / s) + 1``
    ranks); sizes are the full layout's.
    """
    gpn = gpus_per_node
    p = min(sc.pipeline, math.ceil(gpn / sc.tensor) + 1)  # stride T: reaches past a node
    replicas = min(sc.data, math.ceil(gpn / (p * sc.tensor)) + 1)
    depth = sc.depth if geometry_of(sc.mode).uses_depth else 1
    cut = _links(p, sc.tensor, sc.mode, depth, replicas, gpn)
    full = {
        PM.DATA: sc.data, PM.PIPELINE: sc.pipeline, PM.MODEL: sc.pipeline * sc.tensor,
        PM.GLOBAL: sc.world, FIRST_LAST: 2 if sc.pipeline > 1 else 1,
    }  # fmt: skip
    full[sc.mode_geometry.data_parallel] = sc.zero_group  # DATA, or the mode's (SEQUENCE_DP)
    return {m: Link(full.get(m, size), inter) for m, (size, inter) in cut.items()}


def collective_seconds(c: Collective, links: dict, device: DeviceSpec) -> float:
    """Seconds all ``c.calls`` calls take."""
    link = links.get(c.group)
    n = link.size if link else 2
    if c.op == "send_recv":
        n = 2
    inter = link.internode if link else True
    bw, alpha = (
        (device.internode, device.alpha_inter) if inter else (device.nvlink, device.alpha_intra)
    )
    return c.calls * (latency_steps(c.op, n) * alpha + c.bytes / bw)
