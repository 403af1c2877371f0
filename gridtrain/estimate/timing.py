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
backward (``engine/data_parallel.py``), so only what exceeds it shows. The
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


@functools.lru_cache(maxsize=512)
def _links(p: int, t: int, mode: str | None, depth: int, replicas: int, data: int, gpn: int):
    tensor: dict = {"size": t, "mode": mode}
    if mode == "2.5d":
        tensor["depth"] = depth
    cfg = Config.from_dict({"parallel": {"pipeline": p, "tensor": tensor}})
    groups = build_groups(cfg, p * t * replicas)
    out: dict = {}
    for mode_, parts in groups.items():
        inter = any(min(g) // gpn != max(g) // gpn for g in parts)
        out[mode_] = Link(len(parts[0]), inter)
    scale = data // replicas  # the data axis was cut to ``replicas``: restore the true sizes
    for mode_ in (PM.DATA, PM.EXPERT_DATA, PM.GLOBAL, PM.SEQUENCE_DP):
        if mode_ in out:
            out[mode_] = Link(out[mode_].size * scale, out[mode_].internode)
    pipe = [g for g in groups[PM.PIPELINE]]
    out[FIRST_LAST] = Link(2 if p > 1 else 1, any(g[0] // gpn != g[-1] // gpn for g in pipe))
    return out


def group_links(sc: Scenario, gpus_per_node: int) -> dict:
    """Group -> ``Link(size, internode)`` for every group of the layout."""
    span = sc.pipeline * sc.tensor
    replicas = min(sc.data, 2 * math.ceil(gpus_per_node / span) + 1)
    while sc.data % replicas:  # keep the cut a divisor, so the sizes scale back exactly
        replicas += 1
    depth = sc.depth if sc.mode == "2.5d" else 1
    return _links(sc.pipeline, sc.tensor, sc.mode, depth, replicas, sc.data, gpus_per_node)


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
