"""``engine.memory()``: this rank's bytes by category, now and at the peak of a tracked step,
against counts made independently of the engine: what each layout must hold, derived from
the dense model's shapes (fp32 weights 4 bytes, AdamW's two fp32 moments and a step count
per parameter, 1/dp of the rows under ZeRO), and the activations plain PyTorch saves for
the same forward."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers.harness import run_distributed
from helpers.models import TinyTransformer
from helpers.runs import data_rows, lm_loss, seeded, token_batches

import gridtrain as gt

BATCH, SEQ, VOCAB, HIDDEN = 8, 8, 32, 16


def _model():
    return seeded(lambda: TinyTransformer(VOCAB, HIDDEN, 4, 2, SEQ), 0, torch.float32)


def _saved_bytes(model, x, y) -> int:
    """Distinct storages plain PyTorch saves for backward in one forward and loss (parameters
    excluded): all of them are alive when the loss is made, the peak of one micro-batch."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        lm_loss(model(x), y)
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in saved}
    return sum(n for ptr, n in storages.items() if ptr not in params)


def _measure(ctx, batch, accumulation):
    model = _model()
    plain = copy.deepcopy(model)
    dense = sum(p.numel() for p in model.parameters())
    count = len(list(model.parameters()))
    engine, *_ = gt.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3), lm_loss)
    x, y = data_rows(batch, ctx)
    with engine.track_memory():
        engine.zero_grad()
        for xm, ym in zip(x.chunk(accumulation), y.chunk(accumulation), strict=True):
            engine.backward(engine.criterion(engine(xm), ym))
        engine.step()
    report = engine.memory()
    acts = _saved_bytes(plain, x.chunk(accumulation)[0], y.chunk(accumulation)[0])
    return report, dense, count, acts


# name: (config, gradient accumulation)
LAYOUTS = {
    "dp2": (dict(), 1),
    "dp2-zero1": (dict(zero=1), 1),
    "dp2-zero2-accumulate2": (dict(zero=2, gradient_accumulation=2), 2),
    "dp2-zero2-naive-fp16": (dict(zero=2, fp16=dict(mode="naive")), 1),
    "dp2-zero2-offload": (dict(zero=dict(stage=2, offload=True)), 1),
    "dp2-zero3-accumulate2": (dict(zero=3, gradient_accumulation=2), 2),
    "dp2-gemini": (dict(zero=dict(stage=3, offload=True)), 1),
}


def _expected(name: str, dense: int, count: int) -> tuple[dict, dict, dict]:
    """(device now, host now, device peak) from the dense model: P parameters in ``count``
    tensors, every dim 0 even, so each of the 2 data ranks owns exactly half the rows."""
    full, rows = 4 * dense, 4 * dense // 2
    state = 2 * rows + 4 * count  # AdamW: two fp32 moments of this rank's rows, a step each
    if name == "dp2":  # replicated; the overlapped all-reduce copies the one bucket
        return dict(parameters=full, masters=0, gradients=full, optimizer_state=2 * full + 4 * count), {}, dict(gradients=2 * full)  # fmt: skip
    if name == "dp2-zero1":  # full gradients kept, the rows reduce-scattered beside them;
        # at the reduce-scatter: the gradients, the send buffer (full) and the receive (rows)
        return dict(parameters=full, masters=0, gradients=full + rows, optimizer_state=state), {}, dict(gradients=2 * full + rows)  # fmt: skip
    if name == "dp2-zero2-accumulate2":  # rows only; the second backward's bucket launch
        # holds the rows accumulated, its gradients and the send buffer
        return dict(parameters=full, masters=0, gradients=rows, optimizer_state=state), {}, dict(gradients=rows + 2 * full)  # fmt: skip
    if name == "dp2-zero2-naive-fp16":  # fp16 model, fp32 masters and gradients of the rows
        return dict(parameters=full // 2, masters=rows, gradients=rows, optimizer_state=state), {}, dict(gradients=full // 2 + full // 2)  # fmt: skip
    if name == "dp2-zero2-offload":  # masters, their gradients and the state in host memory
        host = dict(masters=rows, gradients=rows, optimizer_state=state)
        return dict(parameters=full, gradients=0), host, dict(gradients=2 * full)
    if name == "dp2-zero3-accumulate2":  # everything sharded; gathered units freed at rest
        return dict(parameters=rows, gradients=rows, optimizer_state=state), {}, {}
    if name == "dp2-gemini":  # fp32 compute copies on the device (all resident on a CPU run);
        # host rows of masters, gradients (+ two staging segments) and state
        host = dict(masters=rows, optimizer_state=state, parameters=0)
        return dict(parameters=full, gradients=0, masters=0, optimizer_state=0), host, {}
    raise KeyError(name)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_memory_report_equals_an_independent_count(name):
    config, accumulation = LAYOUTS[name]
    batch = token_batches(1, BATCH, SEQ, VOCAB, seed=0)[0]
    for rank, (report, dense, count, acts) in enumerate(
        run_distributed(_measure, 2, batch, accumulation, config=config, timeout=300)
    ):
        device, host, peak = _expected(name, dense, count)
        where = f"{name} rank {rank}:\n{report}"
        for k, v in device.items():  # exact: same tensors, counted another way
            assert report.device[k] == v, (k, where)
        for k, v in host.items():
            assert report.host[k] == v, (k, where)
        for k, v in peak.items():
            assert report.peak_device[k] == v, (k, where)
        for k in ("parameters", "masters", "gradients", "optimizer_state"):  # peak >= now
            assert report.peak_device[k] >= report.device[k], (k, where)
        if "gemini" in name:  # the host keeps the gradient rows and two staging segments
            assert 4 * dense // 2 < report.host["gradients"] < 4 * dense, where
        # the activations of one micro-batch, as plain PyTorch saves them; ZeRO changes none
        # (Gemini casts nothing here: fp32 compute copies), and each backward frees its own
        # before the next forward, so the step's peak is one micro-batch's. Naive fp16
        # computes in fp16: its activations are half, but for the fp32 loss it returns
        saved = report.peak_device["activations"]
        if "naive" in name:
            assert acts / 2 < saved < acts, where
        else:
            assert saved == acts, where
        assert report.device["activations"] == 0, where
