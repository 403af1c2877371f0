"""Two CUDA paths of the engine's step: ``fp8`` (torchao float8 GEMMs on Hopper) follows the
bf16 loss curve, and a NaN loss (bf16) or an fp16 overflow (GradScaler) is skipped on the
device by the fused AdamW (no host sync before the step), its count settled a step later."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers.models import TinyTransformer

import gridtrain as gt
from gridtrain.amp import AMP_TYPE

VOCAB, SEQ, HIDDEN = 256, 32, 256  # Linears of 256 and 1024: fp8's default min_features


def _batches(steps: int, batch: int, device):
    """Token t+1 = token t + 1 (mod vocab) from random starts (learnable)."""
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(steps):
        ids = (torch.randint(0, VOCAB, (batch, 1), generator=g) + torch.arange(SEQ + 1)) % VOCAB
        out.append((ids[:, :-1].to(device), ids[:, 1:].to(device)))
    return out


def _loss(logits, labels):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1))


def _engine(device, fused: bool = True):
    torch.manual_seed(0)
    model = TinyTransformer(vocab=VOCAB, hidden=HIDDEN, heads=4, layers=2, seq=SEQ).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, fused=fused)
    engine, *_ = gt.initialize(model, opt, _loss)
    return engine


def _train(engine, data, nan_at=()):
    losses, stepped = [], []
    for step, (x, y) in enumerate(data):
        engine.zero_grad()
        loss = engine.criterion(engine(x), y)
        if step in nan_at:
            loss = loss * float("nan")
        engine.backward(loss)
        stepped.append(engine.step())
        losses.append(loss.detach())
    return [float(v) for v in losses], stepped


def test_fp8_follows_the_bf16_loss_curve(launch, device):
    pytest.importorskip("torchao")
    data = _batches(60, 16, device)
    curves = {}
    for name, extra in {"bf16": {}, "fp8": dict(fp8=True)}.items():
        launch(dict(fp16=dict(mode=AMP_TYPE.BF16), **extra))
        engine = _engine(device)
        kinds = {type(m).__name__ for m in engine.model.modules()}
        assert ("Float8Linear" in kinds) == (name == "fp8"), kinds
        curves[name], _ = _train(engine, data)
        gt.destroy()
    bf16, fp8 = curves["bf16"], curves["fp8"]
    print(f"\nbf16 {bf16[::10]}\nfp8  {fp8[::10]}")
    assert bf16[0] - bf16[-1] > 2.0, bf16  # the task is learnt
    # e4m3 (3 mantissa bits) against bf16 (7): per-step gaps of a few hundredths of a nat
    # on a curve that falls by several nats; 0.1 is far below the fall, above the noise
    gaps = [abs(a - b) for a, b in zip(fp8, bf16, strict=True)]
    assert max(gaps) < 0.1, gaps


@pytest.mark.parametrize("mode", [AMP_TYPE.BF16, AMP_TYPE.TORCH], ids=["bf16", "torch-fp16"])
def test_nan_is_skipped_on_the_device_and_counted_a_step_later(mode, launch, device):
    """bf16: the non-finite flag; torch fp16: GradScaler's overflow flag. Either reaches
    the fused AdamW as found_inf, with no host sync in the step."""
    launch(dict(fp16=dict(mode=mode), max_nonfinite_steps=3))
    engine = _engine(device)
    data = _batches(4, 8, device)
    # a clean first step: the device skip needs every parameter's optimizer state to exist
    # (fused SGD/Adam would create it with garbage on a skipped first step)
    _train(engine, data[:1])
    assert engine.nonfinite.defer == (device.type == "cuda")
    before = {n: p.detach().clone() for n, p in engine.model.named_parameters()}
    _, stepped = _train(engine, data[1:2], nan_at={0})
    for n, p in engine.model.named_parameters():  # the fused AdamW left every weight alone
        assert torch.equal(p.detach(), before[n]), n
    counts = {int(s["step"]) for s in engine.optimizer.state.values()}
    assert counts == {1}, counts  # and did not count the skipped step
    _, more = _train(engine, data[2:])
    assert engine.global_step == 3 and engine.nonfinite_in_a_row == 0
    if device.type == "cuda":  # told True at once (unknown yet), corrected at the next step
        assert stepped == [True] and more == [True, True]
