"""``--search``: every layout of a world size and global batch, the ones that fit ranked by speed.

Enumerated: pipeline size ``P`` (a divisor of the world), the tensor mode and size
(1d ``T``, 2d ``q^2``, 2.5d ``depth x q^2``, 3d ``d^3``, sequence ``N``), the data
size that remains, ZeRO stage, interleaved chunks ``v`` and the micro-batch
``b`` (the rest of the data-parallel rank's batch becomes micro-batches:
``num_microbatches`` under a pipeline, gradient accumulation without).

Pruned, cheapest test first, so that 4096 GPUs take seconds:

1. divisibility read off the model (heads over the mode's group, sequence over
   N, batch blocks, layers over ``P x v``) before anything is planned;
2. one tensor plan per (mode, size, depth), shared by every pipeline and data size;
3. model states alone against the device's memory; a ZeRO stage is tried only when
   the one below it cannot hold the largest micro-batch;
4. activations per micro-batch size (largest first) before any time is estimated;
5. best first: candidates are estimated in the order of a lower bound on their
   step time (matmuls and tensor-parallel collectives alone), until the bound cannot
   beat the top results.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
import time

from gridtrain.estimate.calibration import describe, nearest
from gridtrain.estimate.devices import DeviceSpec
from gridtrain.estimate.estimator import RESERVED_GPU, Estimate, estimate, step_bound
from gridtrain.estimate.geometry import Geometry
from gridtrain.estimate.memory import in_flight, stage_activations
from gridtrain.estimate.models import ModelSpec
from gridtrain.estimate.scenario import EstimateError, Scenario
from gridtrain.parallel.tensor.modes import GEOMETRIES, geometry_of, mode_names

MAX_MICRO_BATCH = 64


@dataclasses.dataclass(frozen=True)
class SearchOptions:
    modes: tuple = (None, *mode_names())
    zero_stages: tuple[int, ...] = (0, 1, 2, 3)
    chunks: tuple[int, ...] = (1, 2, 4)
    top: int = 10
    headroom: float = 0.10  # share of device memory a pick leaves free (fragmentation, spikes)


@dataclasses.dataclass
class SearchResult:
    spec: ModelSpec
    device: DeviceSpec
    world: int
    global_batch: int
    ranked: list[Estimate]
    considered: int = 0
    estimated: int = 0
    pruned: int = 0  # fit, but a bound on their step is slower than the top ``top`` found
    rejected: dict[str, int] = dataclasses.field(default_factory=dict)
    best: list[float] = dataclasses.field(default_factory=list)  # min-heap of the top speeds
    seconds: float = 0.0  # wall clock
    cpu_seconds: float = 0.0  # this process's CPU time (what the search costs on a busy machine)
    modes: set = dataclasses.field(default_factory=set)  # tensor modes of the layouts considered
    top: int = 10
    headroom: float = 0.10

    def reject(self, why: str) -> None:
        self.rejected[why] = self.rejected.get(why, 0) + 1

    def keep(self, tokens_per_s: float) -> None:
        heapq.heappush(self.best, tokens_per_s)
        if len(self.best) > self.top:
            heapq.heappop(self.best)

    def beaten(self, tokens_per_s: float) -> bool:
        """Whether ``top`` results already found are faster than ``tokens_per_s``."""
        return len(self.best) >= self.top and tokens_per_s <= self.best[0]


def divisors(n: int) -> list[int]:
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def tensor_layouts(rest: int, spec: ModelSpec, modes) -> list[tuple[str | None, int, int]]:
    """(mode, size, depth) for tensor groups of a divisor of ``rest`` ranks whose heads (or
    sequence) split."""
    kv, out = spec.num_kv_heads, []
    if None in modes:
        out.append((None, 1, 1))
    for t in divisors(rest):
        if t < 2:
            continue
        for mode in modes:
            geometry = GEOMETRIES.get(mode) if mode is not None else None
            if geometry is not None:  # (a name no mode has: nothing to try)
                out += [(mode, t, depth) for depth in geometry.fits(t, kv, spec.seq_len)]
    return out


def _memory(spec, sc: Scenario, device: DeviceSpec, shards, geo) -> float:
    """Bytes of the fullest stage (model states + activations in flight), no timing."""
    reserved = RESERVED_GPU if device.name != "cpu" else 0.0
    worst, seen = 0.0, {}
    for layers in sc.stages(spec):
        key = (layers.embed, layers.blocks, layers.head)
        if key not in seen:
            states = layers.states(shards, sc)
            acts = stage_activations(spec, geo, sc, layers, shards, device.fused_rms_norm)
            block = sum(b for _, b in acts.block) if sc.checkpointed(layers.blocks) else 0.0
            seen[key] = (states.total, acts.per_microbatch, block)
        states, per, block = seen[key]
        worst = max(worst, states + in_flight(sc, layers.stage) * per + block)
    return worst + reserved


def search(
    spec: ModelSpec,
    device: DeviceSpec,
    world: int,
    global_batch: int,
    base: Scenario,
    options: SearchOptions = SearchOptions(),
) -> SearchResult:
    """Rank the layouts of ``world`` ranks that fit (``base`` gives precision, recompute,
    partition and clipping).

    Best first: every candidate that fits in memory gets a lower bound on its step time
    (``estimator.step_bound``: its matmuls and tensor-parallel collectives alone);
    candidates are estimated fastest
    bound first, and the search stops once the next bound cannot beat the ``top``
    estimates already made, so the top ``top`` are the true best of the model's estimates.
    """
    start, cpu = time.perf_counter(), time.process_time()
    result = SearchResult(
        spec, device, world, global_batch, [], top=options.top, headroom=options.headroom
    )
    candidates: list[tuple[float, int, Scenario, object]] = []
    for p in divisors(world):
        if p > spec.layers + 2:
            continue
        for mode, t, depth in tensor_layouts(world // p, spec, options.modes):
            result.considered += 1
            result.modes.add(mode)
            candidates += _candidates(spec, device, world, global_batch, base, options,
                                      p, mode, t, depth, result)  # fmt: skip
    candidates.sort(key=lambda c: (c[0], c[1]))
    tokens = global_batch * spec.seq_len
    found: list[Estimate] = []
    for i, (bound, _, sc, shards) in enumerate(candidates):
        if result.beaten(tokens / bound):
            result.pruned = len(candidates) - i
            break
        result.estimated += 1
        est = estimate(spec, sc, device, shards)
        result.keep(est.tokens_per_s)
        found.append(est)
    found.sort(key=lambda e: -e.tokens_per_s)
    result.ranked = found
    result.seconds = time.perf_counter() - start
    result.cpu_seconds = time.process_time() - cpu
    return result


def _candidates(spec, device, world, batch, base, options, p, mode, t, depth, result) -> list:
    """(step-time bound, order, scenario, shards) of every variant of one layout that fits."""
    data = world // (p * t)
    if batch % data:
        result.reject("global batch does not split over the data ranks")
        return []
    per_dp = batch // data
    rows = geometry_of(mode).batch_split(t, depth)[0]
    micro = [b for b in divisors(per_dp) if b % rows == 0 and b <= MAX_MICRO_BATCH]
    if not micro:
        result.reject("micro-batch does not split into the mode's batch blocks")
        return []
    probe = dataclasses.replace(
        base, world=world, pipeline=p, tensor=t, mode=mode, depth=depth, micro_batch=micro[0],
        pipeline_micro=per_dp // micro[0] if p > 1 else 1,
        accumulation=1 if p > 1 else per_dp // micro[0], chunks=1, zero=0, offload=False,
    )  # fmt: skip
    try:
        shards = probe.check(spec)
    except EstimateError:
        result.reject("the tensor plan does not fit the model")
        return []
    geo = Geometry.of(mode, t, depth)
    budget = device.memory * (1 - options.headroom)
    out: list = []
    for zero in options.zero_stages:
        if zero and probe.zero_group == 1:
            break
        sc0 = dataclasses.replace(probe, zero=zero)
        states = max(st.states(shards, sc0).total for st in sc0.stages(spec))
        if states > budget:
            result.reject("model states exceed the device memory")
            continue
        roomy = False
        for v in options.chunks:
            if v > 1 and (p == 1 or spec.layers + 2 < p * v):
                continue
            for b in sorted(micro, reverse=True):
                m = per_dp // b
                if v > 1 and m % p:
                    continue
                sc = dataclasses.replace(
                    sc0, micro_batch=b, chunks=v, pipeline_micro=m if p > 1 else 1,
                    accumulation=1 if p > 1 else m,
                )  # fmt: skip
                if _memory(spec, sc, device, shards, geo) > budget:
                    result.reject("activations exceed the device memory")
                    continue
                roomy = roomy or b == micro[-1]
                out.append((step_bound(spec, sc, device, shards), len(out), sc, shards))
        if roomy:  # the largest micro-batch fits already: more ZeRO only adds communication
            break
    return out


def format_search(r: SearchResult) -> str:
    tokens = r.global_batch * r.spec.seq_len
    head = (
        f"search: {r.spec.name} on {r.world} x {r.device.name}, global batch {r.global_batch} x "
        f"{r.spec.seq_len} = {tokens:,} tokens per step\n"
        f"  {r.considered} pipeline x tensor layouts, {r.estimated} estimated, {len(r.ranked)} fit, "
        f"{r.pruned} pruned (a bound on their step is slower than the top {r.top}) "
        f"({r.seconds:.2f} s)"
    )
    if r.rejected:
        head += "\n  rejected: " + "; ".join(f"{n} {why}" for why, n in sorted(r.rejected.items()))
    if not r.ranked:
        return head + "\n\nno layout fits: more devices, a smaller batch or --recompute full"
    lines = [
        head,
        "",
        f"  {'#':>3}  {'data x pipeline x tensor':<30} {'micro':>5} {'x m':>5} {'v':>2} {'zero':>4} "
        f"{'GiB/rank':>9} {'step':>9} {'tokens/s':>12} {'MFU':>6}  calibration it rests on",
    ]
    for i, e in enumerate(r.ranked[: r.top], 1):
        sc = e.scenario
        tensor = f"{sc.mode} {sc.tensor}" if sc.mode else "1"
        if geometry_of(sc.mode).uses_depth:
            tensor += f" (depth {sc.depth})"
        layout = f"{sc.data} x {sc.pipeline} x {tensor}"
        step = f"{e.step_s * 1e3:.0f} ms" if e.step_s < 1 else f"{e.step_s:.2f} s"
        lines.append(
            f"  {i:>3}  {layout:<30} {sc.micro_batch:>5} {sc.micro_batches:>5} {sc.chunks:>2} "
            f"{sc.zero:>4} {e.memory / 2**30:>9.1f} {step:>9} {e.tokens_per_s:>12,.0f} "
            f"{e.mfu:>6.1%}  {describe(nearest(r.device.name, r.spec.num_params(), r.world))}"
        )
    lines += [f"  (picks leave {r.headroom:.0%} of each device's memory free: --headroom)"]
    lines += ["", "the best as a config:", config_text(r.ranked[0].scenario, r.global_batch)]
    return "\n".join(lines)


def config_text(sc: Scenario, global_batch: int) -> str:
    """The config file lines of a scenario (``zero`` needs the engine's ZeRO support)."""
    d = sc.config_dict()
    par = d["parallel"]
    pipe = par["pipeline"]
    pipe_s = (
        str(pipe["size"])
        if len(pipe) == 1
        else f"dict(size={pipe['size']}, num_chunks={pipe['num_chunks']})"
    )
    ten = par["tensor"]
    ten_s = ", ".join(f"{k}={v!r}" for k, v in ten.items() if v is not None)
    lines = [f"parallel = dict(pipeline={pipe_s}, tensor=dict({ten_s}))"]
    for key in ("num_microbatches", "gradient_accumulation"):
        if key in d:
            lines.append(f"{key} = {d[key]}")
    if "fp16" in d:
        lines.append(f"fp16 = dict(mode={d['fp16']['mode']!r})")
    for key in ("zero", "activation_checkpoint", "chunked_loss", "moe"):
        value = d.get(key)
        if isinstance(value, dict):
            value = "dict(" + ", ".join(f"{k}={v!r}" for k, v in value.items()) + ")"
        if value is not None:
            lines.append(f"{key} = {value}")
    lines.append(f"GLOBAL_BATCH_SIZE = {global_batch}")
    return "\n".join(lines)
