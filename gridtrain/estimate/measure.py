"""``gridtrain estimate --measure``: one rank of the layout run for real on this machine's GPU.

The rank joins torch's fake process group (``torch.testing._internal.distributed.fake_pg``:
``FakeStore`` and the ``"fake"`` backend, as torchtitan's memory estimation runs one rank):
every collective and every pipeline transfer returns at once without moving data. The rank
therefore holds and computes exactly what it would in the full world (its tensor shard, its
pipeline stage, its ZeRO rows, its buffers) at its own speed and memory, with meaningless
values and no communication time. It trains the estimate's own model
(``skeleton.Decoder``, the ``ModelSpec``'s shapes) with AdamW through the engine's ``initialize`` under
the config the scenario describes, on the rank of the stage the estimate finds fullest.

Measured: the compute time of one optimizer step (the median of ``steps`` after ``warmup``,
compilation included in the warm-up), the allocator's peak (``torch.cuda.max_memory_allocated``)
and ``engine.memory()``'s peaks by category over one more step run inside
``engine.track_memory()``. The model is built whole on the host before the engine shards it,
so the host must hold one full copy.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

from gridtrain.config import Config
from gridtrain.engine.initialize import initialize
from gridtrain.estimate.estimator import Estimate
from gridtrain.estimate.scenario import EstimateError
from gridtrain.launch import destroy
from gridtrain.nn import CrossEntropyLoss

NO_GPU = (
    "--measure runs one rank on a GPU (the others replaced by a fake process group); "
    "this machine has none (torch.cuda.is_available() is False)"
)


@dataclasses.dataclass(frozen=True)
class Measured:
    """What one rank did: seconds per optimizer step, the allocator's peak, and
    ``engine.memory()``'s peaks by category on the device."""

    rank: int
    steps: int  # optimizer steps run (warm-up, timed, tracked)
    skipped: int  # of them, skipped for a non-finite loss (fake data): no optimizer step
    step_s: float
    peak_allocated: int
    peak_reserved: int
    categories: dict[str, int]


def run_config(est: Estimate, cfg: Config | None = None) -> dict[str, Any]:
    """The config the measured rank runs: ``cfg``'s keys with the scenario's layout over them."""
    base = cfg.model_dump(exclude_unset=True, exclude={"source"}) if cfg is not None else {}
    # the fake collectives' outputs are uninitialised memory: a non-finite loss is not an error
    return _merge(base, {**est.scenario.config_dict(), "max_nonfinite_steps": 0})


def _merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def measure(
    est: Estimate, cfg: Config | None = None, steps: int = 5, warmup: int = 3, device: str = "cuda"
) -> Measured:
    """Run the fullest stage's first rank of ``est``'s layout for ``warmup + steps + 1`` steps.

    ``device="cuda"`` needs a GPU (``EstimateError`` otherwise, before anything starts);
    ``"cpu"`` runs the same rank on the host (times and the allocator's peak are then 0).
    """
    if device == "cuda" and not torch.cuda.is_available():
        raise EstimateError(NO_GPU)
    if dist.is_initialized():
        raise EstimateError("--measure starts its own (fake) process group; one is running")
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from gridtrain.parallel.context import ParallelContext, set_context
    from gridtrain.parallel.random import seed_everything

    sc = est.scenario
    rank = est.worst.layers.stage * sc.tensor  # ranks run tensor-fastest, then stage
    config = Config.from_dict(run_config(est, cfg))
    dev = torch.device(device, 0) if device == "cuda" else torch.device("cpu")
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=sc.world)
    try:
        seed_everything(0)
        set_context(ParallelContext(config, dev, 0))
        return _train(est, rank, dev, steps, warmup)
    finally:
        destroy()


def _train(est: Estimate, rank: int, dev: torch.device, steps: int, warmup: int) -> Measured:
    from gridtrain.estimate.skeleton import Decoder

    spec, sc = est.spec, est.scenario
    model = Decoder(spec)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, spec.vocab, (sc.micro_batch, spec.seq_len), generator=gen).to(dev)
    labels = torch.roll(ids, -1, 1)
    engine, *_ = initialize(model, opt, CrossEntropyLoss(), example_inputs=ids)
    engine.train()

    stepped = []

    def step() -> None:
        if sc.pipeline > 1:
            batch = (ids.repeat(sc.pipeline_micro, 1), labels.repeat(sc.pipeline_micro, 1))
            engine.zero_grad()
            engine.execute_schedule(iter([batch]), return_output_label=False)
            stepped.append(engine.step())
            return
        for i in range(sc.accumulation):
            engine.zero_grad()
            engine.backward(engine.criterion(engine(ids), labels))
            done = engine.step()
            if i == sc.accumulation - 1:
                stepped.append(done)

    for _ in range(warmup):
        step()
    cuda = dev.type == "cuda"
    if cuda:
        torch.cuda.synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        if cuda:
            torch.cuda.synchronize(dev)
        times.append(time.perf_counter() - start)
    allocated = torch.cuda.max_memory_allocated(dev) if cuda else 0
    reserved = torch.cuda.max_memory_reserved(dev) if cuda else 0
    with engine.track_memory():
        step()
        step()  # the peaks of a complete step are final at the next one's first forward
    peaks = dict(engine.memory().peak_device)
    median = statistics.median(times) if cuda else 0.0
    skipped = stepped.count(False)
    return Measured(rank, len(stepped), skipped, median, allocated, reserved, peaks)


def format_measured(est: Estimate, m: Measured) -> str:
    """The measured rank beside the estimate: compute time and memory, by category."""
    st = est.worst
    lines = [
        f"measured: rank {m.rank} run on this GPU, the other {est.scenario.world - 1} ranks a "
        "fake process group (no communication)",
        *(
            [
                f"  {m.skipped} of {m.steps} steps skipped: the fake collectives' data was not "
                "finite (no optimizer step, no Adam state in them)"
            ]
            if m.skipped
            else []
        ),
        f"  {'':<18}{'estimated':>12}{'measured':>12}{'ratio':>8}",
        _row("compute s/step", compute_s(est), m.step_s),
        _row("peak GiB", est.memory, m.peak_reserved, 2**30),
    ]
    for c in ("parameters", "masters", "gradients", "optimizer_state"):
        lines.append(_row(f"  {c}", st.states.device[c], m.categories.get(c, 0), 2**30))
    lines.append(_row("  activations", st.activations.in_flight,
                      m.categories.get("activations", 0), 2**30))  # fmt: skip
    return "\n".join(lines)


def compute_s(est: Estimate) -> float:
    """The estimate's seconds of one step on the fullest stage without communication: its
    micro-batches' compute and the step's tail less the exposed data-parallel traffic."""
    st = est.worst
    return st.micro_batches * st.compute_s + st.tail_s - st.exposed_dp_s


def _row(name: str, want: float, got: float, unit: float = 1.0) -> str:
    ratio = f"{got / want:.2f}" if want else "-"
    return f"  {name:<18}{want / unit:>12.3f}{got / unit:>12.3f}{ratio:>8}"
