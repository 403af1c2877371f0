"""``gridtrain estimate`` against the engine itself, at 8 gloo ranks, for every tensor mode.

The estimator's model (``gridtrain.estimate.skeleton.Decoder``) is trained for one
step through ``gt.initialize``; each rank then reports the bytes it really holds
and sends, and the estimate for the same config must give:

* parameters, gradients, master weights/gradients and optimizer states: exactly
  (both come from the same shard specs; a mismatch is a counting bug);
* activations of one micro-batch: within 20 % of the bytes autograd saved
  (``saved_tensors_hooks``, each storage once, parameters excluded): the
  inventory lists the big tensors op by op and leaves out small ones (masks of
  a few bytes per row, views the kernels keep);
* bytes per collective over the step: within 5 % of ``comm.count_bytes()``
  (they follow the same forward code; the slack is for scalars counted at
  their exact size where the estimate rounds per call).
"""

from __future__ import annotations

import pytest
import torch
from helpers.harness import run_distributed

import gridtrain as gt
from gridtrain.config import Config
from gridtrain.estimate import Scenario, estimate, get_device
from gridtrain.estimate.communication import by_op
from gridtrain.estimate.models import ModelSpec
from gridtrain.estimate.skeleton import Decoder
from gridtrain.parallel import comm

GPT = ModelSpec("tiny-gpt", layers=2, hidden=64, heads=8, vocab=128, seq_len=16, positions=16)
LLAMA = ModelSpec(
    "tiny-llama", layers=2, hidden=64, heads=8, vocab=128, seq_len=16, kv_heads=4, ffn=96,
    gated=True, norm="rms", bias=False, tied=False,
)  # fmt: skip
MICRO = 4  # sequences per micro-batch (divisible by every mode's batch blocks at 8 ranks)


def _tensor(size, mode, **kw):
    return {"parallel": {"tensor": {"size": size, "mode": mode, **kw}}}


LAYOUTS = {  # name: (model, config)
    "1d8": (GPT, _tensor(8, "1d")),
    "dp2-2d4": (GPT, _tensor(4, "2d")),
    "2.5d8-depth2": (GPT, _tensor(8, "2.5d", depth=2)),
    "3d8": (GPT, _tensor(8, "3d")),
    "dp2-sequence4": (GPT, _tensor(4, "sequence")),
    "dp2-1d2-pp2": (
        GPT,
        {"parallel": {"pipeline": 2, "tensor": {"size": 2, "mode": "1d"}}, "num_microbatches": 2},
    ),
    "llama-dp2-1d4-naive": (LLAMA, {**_tensor(4, "1d"), "fp16": {"mode": "naive"}}),
    "llama-dp2-sequence4-bf16": (LLAMA, {**_tensor(4, "sequence"), "fp16": {"mode": "bf16"}}),
    "llama-3d8": (LLAMA, _tensor(8, "3d")),
    "dp8-zero1": (GPT, {"zero": 1}),
    "dp4-1d2-zero2-naive": (
        GPT,
        {**_tensor(2, "1d"), "zero": 2, "fp16": {"mode": "naive", "initial_scale": 1.0}},
    ),
    "dp8-zero3": (GPT, {"zero": 3}),
}
WORLD = 8


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _measure(ctx, spec: ModelSpec, batch: int):
    torch.manual_seed(0)
    model = Decoder(spec)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, spec.vocab, (batch, spec.seq_len), generator=gen)
    labels = torch.randint(0, spec.vocab, (batch, spec.seq_len), generator=gen)
    dp = ctx.world_size(gt.ParallelMode.DATA)
    x = ids.chunk(dp)[ctx.local_rank(gt.ParallelMode.DATA)]
    y = labels.chunk(dp)[ctx.local_rank(gt.ParallelMode.DATA)]
    engine, *_ = gt.initialize(model, opt, gt.nn.CrossEntropyLoss(), example_inputs=x)
    pipeline = ctx.world_size(gt.ParallelMode.PIPELINE) > 1
    engine.train()
    engine.zero_grad()
    peak = _PeakSaved(engine.model.parameters()) if pipeline else None
    with comm.count_bytes() as counted:
        if pipeline:  # the schedule's peak of saved activations: micro-batches in flight
            with torch.autograd.graph.saved_tensors_hooks(peak.pack, peak.unpack):
                engine.execute_schedule(iter([(x, y)]), return_output_label=False)
        else:
            engine.backward(engine.criterion(engine(x), y))
        engine.step()
    if ctx.config.zero is not None:  # what the ZeRO engine measures of itself
        from gridtrain.parallel.zero.memory import memory_report

        held = memory_report(engine.model, engine.optimizer)
        held.pop("total")
        return held, dict(counted), None
    inner = getattr(engine.optimizer, "optim", engine.optimizer)
    params = list({id(p): p for p in engine.model.parameters()}.values())
    masters = [p for g in inner.param_groups for p in g["params"]]
    masters = [p for p in masters if all(p is not q for q in params)]
    states = list(inner.state.values())
    held = {
        "weights": _bytes(params),
        "grads": _bytes(p.grad for p in params if p.grad is not None),
        "master_weights": _bytes(masters),
        "master_grads": _bytes(p.grad for p in masters if p.grad is not None),
        "moments": _bytes(s[k] for s in states for k in ("exp_avg", "exp_avg_sq")),
        "steps": _bytes(s["step"] for s in states),
    }
    saved = peak.peak if pipeline else _saved_bytes(engine, x, y, params + masters)
    return held, dict(counted), saved


class _PeakSaved:
    """The most bytes autograd holds for backward at once (each storage once, weights
    excluded): a storage counts from its first pack until its last unpack, which is when
    backward releases it."""

    def __init__(self, params):
        self.skip = {p.untyped_storage().data_ptr() for p in params}
        self.refs: dict[int, int] = {}
        self.live = self.peak = 0
        self.held: dict[int, torch.Tensor] = {}

    def pack(self, t):
        ptr = t.untyped_storage().data_ptr()
        if ptr in self.skip:
            return t
        if not self.refs.get(ptr):
            self.live += t.untyped_storage().nbytes()
            self.peak = max(self.peak, self.live)
        self.refs[ptr] = self.refs.get(ptr, 0) + 1
        self.held[id(t)] = t
        return ("saved", id(t), ptr)

    def unpack(self, key):
        if not isinstance(key, tuple):
            return key
        _, tid, ptr = key
        t = self.held.pop(tid)
        self.refs[ptr] -= 1
        if not self.refs[ptr]:
            self.live -= t.untyped_storage().nbytes()
        return t


def _saved_bytes(engine, x, y, params) -> int:
    """Bytes of the storages autograd saves in one forward (each storage once, weights excluded)."""
    skip = {p.untyped_storage().data_ptr() for p in params}
    seen: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in skip:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = engine.criterion(engine(x), y)
    del loss
    return sum(seen.values())


@pytest.fixture(scope="module")
def measured():
    """Every layout run once (each rank: held bytes, bytes per collective, saved bytes)."""
    out = {}
    for name, (spec, config) in LAYOUTS.items():
        sc = Scenario.from_config(Config.from_dict(config), WORLD, micro_batch=MICRO)
        batch = sc.data * sc.micro_batches * MICRO
        ranks = run_distributed(_measure, WORLD, spec, batch, config=config, timeout=300)
        out[name] = (estimate(spec, sc, get_device("cpu")), ranks)
    return out


def _stage(est, rank: int) -> int:
    sc = est.scenario
    return (rank // sc.tensor) % sc.pipeline


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_model_states_equal_the_engine(measured, name):
    est, ranks = measured[name]
    for rank, (held, _, _) in enumerate(ranks):
        st = est.stages[_stage(est, rank)].states
        if est.scenario.zero:  # parallel/zero/memory.py's four sums
            want = {
                "parameters": st.weights,
                "masters": st.master_weights,
                "gradients": st.grads + st.master_grads,
                "optimizer_state": st.moments + st.steps,
            }
            first = rank < est.scenario.pipeline * est.scenario.tensor
            if first:  # the first data-parallel rank owns full chunks of rows: exact
                assert held == want, f"{name} rank {rank}"
            else:  # later ranks may own fewer rows
                assert all(held[k] <= want[k] for k in want), f"{name} rank {rank}"
            continue
        want = {k: getattr(st, k) for k in held}
        assert want == held, f"{name} rank {rank}"


# ZeRO layouts are checked on their model states (above): ZeRO changes no activation
@pytest.mark.parametrize("name", [n for n, (_, c) in LAYOUTS.items() if not c.get("zero")])
def test_activation_bytes_within_20_percent(measured, name):
    """One micro-batch's saved bytes; under a pipeline, the schedule's peak (the micro-batches
    1F1B keeps in flight on each stage, the estimate's ``in_flight``)."""
    est, ranks = measured[name]
    for rank, (_, _, saved) in enumerate(ranks):
        acts = est.stages[_stage(est, rank)].activations
        want = acts.in_flight if est.scenario.pipeline > 1 else acts.per_microbatch
        assert saved == pytest.approx(want, rel=0.20), f"{name} rank {rank}: {saved} vs {want:.0f}"


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_communication_bytes_within_5_percent(measured, name):
    est, ranks = measured[name]
    for rank, (_, counted, _) in enumerate(ranks):
        want = by_op(est.stages[_stage(est, rank)].collectives)
        assert set(want) == set(counted), f"{name} rank {rank}: {want} vs {counted}"
        for op, got in counted.items():
            assert got == pytest.approx(want[op], rel=0.05), f"{name} rank {rank} {op}"
