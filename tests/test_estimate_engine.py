"""``gridtrain estimate`` against ``engine.memory()``: 17 layouts on gloo, per rank, at the peak of
a step.

The estimator's model (``gridtrain.estimate.skeleton.Decoder``) is trained through
``gt.initialize`` under each layout for two optimizer steps inside
``engine.track_memory()``; ``engine.memory()`` then gives the second step's peak of each
category, on the device and in host memory, and the estimate for the same config must give:

* ``parameters``, ``masters``, ``gradients``, ``optimizer_state``: within 2 % (both count
  the same storages; the slack is for tensors of a few bytes: the loss scaler's, a
  router's);
* ``activations`` (saved tensors at once, the schedule's peak): within 15 %: the
  inventory lists the big tensors op by op and leaves out small ones (masks of a few
  bytes per row, the indices of a gather).

Layouts (4 ranks unless said): data 4 under no ZeRO, ZeRO 1, 2, 3 and Gemini, each with
gradient accumulation 1 and 4, and Gemini in bf16 with accumulation 4; pipeline 2 x data 2 under ZeRO 1 and 2 with 8
micro-batches; 1d 2 x data 2 under ZeRO 2; 2d 4; sequence 2 x data 2; MoE with experts
spread over 2 ranks. ZeRO 1-2 buckets are 0.1 MB here (about half a block), so buckets
in flight are a few of many, as at scale.
"""

from __future__ import annotations

import functools

import pytest
import torch
from helpers.harness import run_distributed

import gridtrain as gt
from gridtrain.config import Config
from gridtrain.estimate import Scenario, estimate, get_device
from gridtrain.estimate.models import ModelSpec
from gridtrain.estimate.skeleton import Decoder

GPT = ModelSpec("tiny-gpt", layers=2, hidden=64, heads=8, vocab=128, seq_len=16, positions=16)
MOE = ModelSpec("tiny-moe", layers=2, hidden=64, heads=8, vocab=128, seq_len=16, experts=4,
                top_k=2, ffn=64, norm="rms", bias=False, tied=False)  # fmt: skip
MICRO = 4  # sequences per micro-batch
WORLD = 4
STATES = ("parameters", "masters", "gradients", "optimizer_state")
BUCKET = 0.1  # MB: ZeRO 1-2 buckets of about half a block


def _zero(stage, **kw):
    if stage == "gemini":
        return {"zero": {"stage": 3, "offload": True, **kw}}
    if stage in (1, 2):
        kw = {"bucket_size_mb": BUCKET, **kw}
    return {"zero": {"stage": stage, **kw}} if stage else {}


def _layouts() -> dict[str, tuple[ModelSpec, dict, int]]:
    out: dict[str, tuple[ModelSpec, dict, int]] = {}
    for stage in (0, 1, 2, 3, "gemini"):
        for acc in (1, 4):
            out[f"dp4-zero{stage}-acc{acc}"] = (
                GPT, {**_zero(stage), "gradient_accumulation": acc}, WORLD
            )  # fmt: skip
    # Gemini's bf16 host link: gradients cross in bf16 into bf16 staging buffers, the masters
    # are cast into bf16 upload buffers (memory_rules.gemini_link_bytes)
    out["dp4-zerogemini-bf16-acc4"] = (
        GPT, {**_zero("gemini"), "fp16": {"mode": "bf16"}, "gradient_accumulation": 4}, WORLD
    )  # fmt: skip
    for stage in (1, 2):
        out[f"pp2-dp2-zero{stage}-m8"] = (
            GPT, {"parallel": {"pipeline": 2}, "num_microbatches": 8, **_zero(stage)}, WORLD
        )  # fmt: skip
    out["1d2-dp2-zero2"] = (GPT, {"parallel": {"tensor": {"size": 2, "mode": "1d"}}, **_zero(2)},
                            WORLD)  # fmt: skip
    out["2d4"] = (GPT, {"parallel": {"tensor": {"size": 4, "mode": "2d"}}}, WORLD)
    out["sequence2-dp2"] = (GPT, {"parallel": {"tensor": {"size": 2, "mode": "sequence"}}}, WORLD)
    out["moe-ep2"] = (MOE, {"moe": {"expert_parallel_size": 2}}, WORLD)
    return out


LAYOUTS = _layouts()


def _batches(ctx, spec: ModelSpec, sc: Scenario):
    """This data rank's micro-batches of two optimizer steps (ids and labels)."""
    gen = torch.Generator().manual_seed(1)
    per_step = sc.data * sc.micro_batches * MICRO
    ids = torch.randint(0, spec.vocab, (2, per_step, spec.seq_len), generator=gen)
    labels = torch.randint(0, spec.vocab, (2, per_step, spec.seq_len), generator=gen)
    rank = ctx.local_rank(gt.ParallelMode.DATA)
    mine = slice(rank * per_step // sc.data, (rank + 1) * per_step // sc.data)
    return ids[:, mine], labels[:, mine]


def _measure(ctx, spec: ModelSpec, sc: Scenario):
    torch.manual_seed(0)
    model = Decoder(spec)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids, labels = _batches(ctx, spec, sc)
    engine, *_ = gt.initialize(model, opt, gt.nn.CrossEntropyLoss(), example_inputs=ids[0, :MICRO])
    engine.train()
    with engine.track_memory():
        for step in range(2):
            if sc.pipeline > 1:  # one batch of num_microbatches micro-batches
                engine.zero_grad()
                engine.execute_schedule(
                    iter([(ids[step], labels[step])]), return_output_label=False
                )
                engine.step()
                continue
            for x, y in zip(ids[step].split(MICRO), labels[step].split(MICRO), strict=True):
                engine.zero_grad()
                engine.backward(engine.criterion(engine(x), y))
                engine.step()
    report = engine.memory()
    return dict(report.peak_device), dict(report.peak_host)


def _scenario(name: str) -> Scenario:
    spec, config, world = LAYOUTS[name]
    return Scenario.from_config(Config.from_dict(config), world, micro_batch=MICRO)


@functools.cache
def measured(name: str) -> list[tuple[dict, dict]]:
    """Each rank's peaks (device, host) under layout ``name``. One harness call per layout:
    each launches on a port the harness takes just before (ports taken ahead for every
    layout could be bound by another process by the time a late layout used them), and a
    layout that fails fails its own tests, not the first test of the file."""
    spec, config, world = LAYOUTS[name]
    return run_distributed(_measure, world, spec, _scenario(name), config=config, timeout=180)


_RUNS: dict[str, tuple] = {}


def run(name: str):
    """A layout's estimate and each rank's measured peaks on the device and the host."""
    if name not in _RUNS:
        spec = LAYOUTS[name][0]
        ranks = measured(name)
        _RUNS[name] = (estimate(spec, _scenario(name), get_device("cpu")), ranks)
    return _RUNS[name]


def _stage(est, rank: int) -> int:
    sc = est.scenario
    return (rank // sc.tensor) % sc.pipeline


def table(names) -> str:
    """Layout x category: estimated / measured MiB on rank 0 (the report's table)."""
    cats = (*STATES, "activations")
    lines = ["| layout | " + " | ".join(cats) + " |", "|---" * (len(cats) + 1) + "|"]
    for name in names:
        est, ranks = run(name)
        st = est.stages[_stage(est, 0)]
        dev, host = ranks[0]
        cells = []
        for c in cats:
            want = st.activations.in_flight if c == "activations" else (
                st.states.device[c] + st.states.host[c]
            )  # fmt: skip
            got = dev.get(c, 0) + host.get(c, 0)
            cells.append(f"{want / 2**20:.3f} / {got / 2**20:.3f}")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_model_states_within_2_percent(name):
    """Each category on the device and in host memory, every rank."""
    est, ranks = run(name)
    for rank, (dev, host) in enumerate(ranks):
        st = est.stages[_stage(est, rank)].states
        for where, got, want in (("device", dev, st.device), ("host", host, st.host)):
            for c in STATES:
                assert got.get(c, 0) == pytest.approx(want[c], rel=0.02, abs=256), (
                    f"{name} rank {rank} {where} {c}: measured {got.get(c, 0)}, "
                    f"estimated {want[c]:.0f}\n{table([name])}"
                )


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_activation_peak_within_15_percent(name):
    """Saved tensors at once: one micro-batch's, or the micro-batches 1F1B keeps in flight."""
    est, ranks = run(name)
    for rank, (dev, host) in enumerate(ranks):
        want = est.stages[_stage(est, rank)].activations.in_flight
        got = dev.get("activations", 0) + host.get("activations", 0)
        assert got == pytest.approx(want, rel=0.15), f"{name} rank {rank}: {got} vs {want:.0f}"
