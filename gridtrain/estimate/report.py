"""Text for ``gridtrain estimate``: memory per rank, communication per group, step time, MFU."""

from __future__ import annotations

import json
from typing import Any

from gridtrain.estimate.communication import Collective
from gridtrain.estimate.devices import GiB
from gridtrain.estimate.estimator import Estimate, StageEstimate
from gridtrain.parallel.mode import ParallelMode as PM


def _gib(x: float) -> str:
    return f"{x / GiB:.2f}"


def _bytes(x: float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if x >= size:
            return f"{x / size:.1f} {unit}"
    return f"{x:.0f} B"


def _secs(x: float) -> str:
    return f"{x * 1e3:.1f} ms" if x < 1 else f"{x:.2f} s"


def _layers(stage: StageEstimate) -> str:
    lay = stage.layers
    parts = (["embed"] if lay.embed else []) + ([f"{lay.blocks} blocks"] if lay.blocks else [])
    return " + ".join(parts + (["head"] if lay.head else []))


def format_estimate(e: Estimate) -> str:
    sc, dev, spec = e.scenario, e.device, e.spec
    lines = [
        f"model   {spec.describe()}",
        f"layout  {sc.describe()}",
        f"device  {dev.name} x {sc.world} ({dev.gpus_per_node} per node): "
        f"{dev.peak_for(sc.amp) / 1e12:.0f} TFLOP/s {'bf16/fp16' if sc.amp else 'fp32'} peak, "
        f"{dev.memory / GiB:.1f} GiB, NVLink {dev.nvlink / 1e9:.0f} GB/s, "
        f"network {dev.internode / 1e9:.0f} GB/s per GPU",
        "",
    ]
    lines += _memory(e)
    lines += [""] + _stages_table(e) if sc.pipeline > 1 else []
    lines += [""] + _communication(e)
    lines += [""] + _timing(e)
    return "\n".join(lines)


def _state_rows(e: Estimate) -> list[tuple[str, str, float]]:
    """(category, how it is made, device bytes at its peak): ``engine.memory()``'s categories."""
    sc, w = e.scenario, e.worst
    st, d, r = w.states, w.states.device, sc.rules
    zero = f", ZeRO-{sc.zero} over {sc.zero_group}" if sc.zero else ""
    wdt = f"{8 * r.w}-bit"
    extra = st.part("in_flight")
    if sc.gemini:
        params = f"{w.params / 1e9:.3f}B on the stage, {8 * r.c}-bit copies, all resident"
        grads = "a chunk's fp32 send buffer and its gradients, while reduced"
    elif sc.zero == 3:
        params = f"fp32 rows{zero} + units gathered ({8 * r.c}-bit) {_gib(st.part('gathered'))}"
        grads = f"fp32 rows {_gib(st.part('grads'))} + unsharded {_gib(extra)}"
        if sc.keep_unsharded_grads:
            grads = "full fp32, kept unsharded across micro-steps (keep_unsharded_grads)"
    else:
        params = f"{w.params / 1e9:.3f}B x {r.w} B ({wdt})"
        if st.part("gather"):
            params += f" + all-gather buffers {_gib(st.part('gather'))}"
        kept = "fp32 row accumulators" if sc.zero == 2 else f"full {wdt}"
        sent = "buckets in flight" if sc.zero == 2 else "reduce buffers"
        grads = f"{kept} {_gib(st.part('grads'))} + {sent} {_gib(extra)}"
    masters = "fp32 copies" + (" of this rank's rows" if sc.zero else "")
    if not d["masters"]:
        masters = "none: the optimizer steps the model's own" + (" rows" if sc.zero else "")
        masters += " (host)" if st.host["masters"] else ""
    return [
        ("parameters", params, d["parameters"]),
        ("masters", masters, d["masters"]),
        ("gradients", grads, d["gradients"]),
        ("optimizer_state", "Adam moments + step" + zero, d["optimizer_state"]),
    ]


def _memory(e: Estimate) -> list[str]:
    sc, w = e.scenario, e.worst
    st, act = w.states, w.activations
    where = (
        f"stage {w.layers.stage} of {sc.pipeline}: {_layers(w)}" if sc.pipeline > 1 else _layers(w)
    )
    rows = _state_rows(e)
    flight = {"1f1b": "1F1B", "gpipe": "GPipe"}.get(sc.schedule, sc.schedule)
    how = (
        f"{_gib(act.per_microbatch)} GiB per micro-batch x {act.microbatches_in_flight:g} in flight ({flight})"
        if sc.pipeline > 1
        else f"one micro-batch of {sc.micro_batch} x {e.spec.seq_len} tokens"
    )
    if sc.checkpointed(w.layers.blocks):
        how += f", {sc.checkpointed(w.layers.blocks)} of {w.layers.blocks} blocks recomputed"
    rows.append(("activations", how, act.in_flight))
    if e.reserved:
        rows.append(("reserved", "CUDA context, NCCL buffers, allocator", e.reserved))
    out = [f"memory per rank at the peak of a step ({where}; categories of engine.memory())"]
    out += [f"  {name:<18} {what:<58} {_gib(b):>8} GiB" for name, what, b in rows]
    if st.host_total:
        held = ", ".join(f"{k} {_gib(v)}" for k, v in st.host.items() if v)
        out.append(f"  {'(host memory)':<18} {held:<58} {_gib(st.host_total):>8} GiB")
    if st.part("pcie_d2h"):
        link = f"host link per step: {st.part('pcie_h2d') / 1e9:.2f} GB to the device, "
        link += f"{st.part('pcie_d2h') / 1e9:.2f} GB back"
        out.append(f"  {'(PCIe)':<18} {link:<58}")
    total, cap = e.memory, e.device.memory
    verdict = (
        f"fits ({_gib(cap - total)} GiB free)"
        if e.fits
        else f"DOES NOT FIT (over by {_gib(total - cap)} GiB)"
    )
    out.append(f"  {'total':<18} {f'of {_gib(cap)} GiB: {verdict}':<58} {_gib(total):>8} GiB")
    out += [f"  not modelled: {key}" for key in sc.unmodelled]
    return out


def _stages_table(e: Estimate) -> list[str]:
    out = [
        "per stage      layers                      params   states GiB   activations GiB   total GiB"
    ]
    for s in e.stages:
        out.append(
            f"  stage {s.layers.stage:<5} {_layers(s):<26} {s.params / 1e9:7.3f}B {_gib(s.states.total):>11} "
            f"{_gib(s.activations.in_flight):>17} {_gib(s.memory + e.reserved):>11}"
        )
    return out


def aggregate(collectives: list[Collective]) -> list[tuple[str, str, float, float, list[str]]]:
    """(group, op, total bytes, calls, sources) per group and collective, largest first."""
    rows: dict[tuple[str, str], list] = {}
    for c in collectives:
        row = rows.setdefault((c.group_name, c.op), [0.0, 0.0, []])
        row[0] += c.total
        row[1] += c.calls
        source = c.what.split(":")[0]
        if source not in row[2]:
            row[2].append(source)
    out = [(g, op, b, n, src) for (g, op), (b, n, src) in rows.items()]
    return sorted(out, key=lambda r: -r[2])


def _communication(e: Estimate) -> list[str]:
    w = max(e.stages, key=lambda s: sum(c.total for c in s.collectives))
    from gridtrain.estimate.timing import collective_seconds

    seconds: dict[tuple[str, str], float] = {}
    for c in w.collectives:
        key = (c.group_name, c.op)
        seconds[key] = seconds.get(key, 0.0) + collective_seconds(c, e.links, e.device)
    where = f" (stage {w.layers.stage})" if e.scenario.pipeline > 1 else ""
    out = [
        f"communication per step, one rank{where}",
        f"  {'group':<26} {'ranks':>5} {'link':<7} {'collective':<15} {'calls':>7} "
        f"{'bytes sent':>11} {'time':>9}  issued by",
    ]
    if not w.collectives:
        out.append("  (none: one rank)")
    for group, op, total, calls, sources in aggregate(w.collectives):
        link = _link(e, group)
        srcs = ", ".join(sources[:3]) + (", ..." if len(sources) > 3 else "")
        out.append(
            f"  {group:<26} {link[0]:>5} {link[1]:<7} {op:<15} {calls:>7.0f} {_bytes(total):>11} "
            f"{_secs(seconds[(group, op)]):>9}  {srcs}"
        )
    return out


def _link(e: Estimate, group: str) -> tuple[str, str]:
    for key, link in e.links.items():
        name = key.name if isinstance(key, PM) else key
        if name == group:
            return str(link.size), "network" if link.internode else "NVLink"
    if group == "PIPELINE (first, last)":
        return "2", "network"
    return "?", "?"


def _timing(e: Estimate) -> list[str]:
    sc = e.scenario
    pace = max(e.stages, key=lambda s: s.compute_s + (s.tensor_comm_s + s.p2p_s) / sc.micro_batches)
    tail = max(e.stages, key=lambda s: s.tail_s)
    m = sc.micro_batches
    slots = (
        f"{sc.accumulation} x ({sc.pipeline_micro} + {sc.pipeline - 1}/{sc.chunks}) slots"
        if sc.pipeline > 1
        else f"{m} micro-batch{'es' if m > 1 else ''}"
    )
    rows = [
        ("compute", f"{_secs(pace.compute_s)} per micro-batch (FLOPs at "
         f"{e.device.efficiency:.0%} of peak + activation traffic)", pace.compute_s * m),
        ("tensor-parallel comm", "exposed: on the critical path", pace.tensor_comm_s),
    ]  # fmt: skip
    if sc.pipeline > 1:
        rows.append(("pipeline send/recv", "activations and gradients between stages", pace.p2p_s))
        bubble = e.schedule_s - m * (pace.compute_s + (pace.tensor_comm_s + pace.p2p_s) / m)
        rows.append(("pipeline bubble", f"(p-1)/(v m + p-1) = {e.bubble:.1%}", bubble))
    rows.append(("data parallel", f"{_secs(tail.overlapped_s)} of gradient collectives overlap "
                 "backward; exposed", tail.exposed_dp_s))  # fmt: skip
    rows.append(("after backward", "Adam step (memory-bound), ZeRO gathers, flags and norms",
                 tail.tail_s - tail.exposed_dp_s))  # fmt: skip
    out = [f"step time (estimated; schedule {slots})"]
    out += [f"  {name:<22} {what:<66} {_secs(s):>9}" for name, what, s in rows]
    out.append(f"  {'step':<22} {'':<66} {_secs(e.step_s):>9}")
    out.append(
        f"  throughput {e.tokens_per_s:,.0f} tokens/s ({e.tokens_per_s / sc.world:,.0f} per GPU), "
        f"{e.tflops_per_gpu:.0f} TFLOP/s per GPU, MFU {e.mfu:.1%}"
    )
    return out


def does_not_fit(e: Estimate) -> str:
    w = e.worst
    where = f"stage {w.layers.stage}" if e.scenario.pipeline > 1 else "every rank"
    biggest = max(
        (("activations", w.activations.in_flight), ("model states", w.states.total)),
        key=lambda x: x[1],
    )
    hint = (
        "lower the micro-batch, add pipeline or tensor ranks, or recompute"
        if biggest[0] == "activations"
        else "add tensor or pipeline ranks, or a ZeRO stage"
    )
    return (
        f"does not fit: {where} needs {_gib(e.memory)} GiB per rank, {e.device.name} has "
        f"{_gib(e.device.memory)} GiB: over by {_gib(e.memory - e.device.memory)} GiB "
        f"({biggest[0]} {_gib(biggest[1])} GiB: {hint})"
    )


def as_dict(e: Estimate) -> dict[str, Any]:
    """Machine-readable summary (``--json``)."""
    w = e.worst
    return {
        "model": e.spec.name,
        "params": e.spec.num_params(),
        "layout": e.scenario.config_dict(),
        "world": e.scenario.world,
        "global_batch": e.scenario.global_batch,
        "micro_batch": e.scenario.micro_batch,
        "memory_bytes": e.memory,
        "fits": e.fits,
        "worst_stage": w.layers.stage,
        "states": w.states.device,
        "host": w.states.host,
        "activations_bytes": w.activations.in_flight,
        "step_s": e.step_s,
        "tokens_per_s": e.tokens_per_s,
        "mfu": e.mfu,
        "unmodelled": list(e.scenario.unmodelled),
        "communication": [
            {"group": g, "op": op, "bytes": b, "calls": n, "issued_by": src}
            for g, op, b, n, src in aggregate(w.collectives)
        ],
    }


def dumps(e: Estimate) -> str:
    return json.dumps(as_dict(e), indent=2, default=str)
