"""``fp8``: the chosen nn.Linear layers become torchao Float8Linear (same parameters, so the
optimizer, checkpoints and data parallelism are untouched) and training follows fp32's loss
curve. On CPU torch emulates the float8 GEMMs: these tests check numerics and wiring; the
speed is measured on the H200 (benchmarks/gpt_throughput.py --fast --fp8)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers.harness import run_distributed
from helpers.models import TinyTransformer
from helpers.runs import engine_run

import gridtrain as gt

VOCAB, SEQ, HIDDEN, STEPS = 64, 16, 64, 40
FP8 = dict(fp8=dict(min_features=64))  # the tiny model's Linears are 64 and 256 wide


def _counting_batches(steps: int, batch: int, seed: int = 0):
    """Token t+1 = token t + 1 (mod vocab) from random starts: learnable in a few dozen steps."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        start = torch.randint(0, VOCAB, (batch, 1), generator=g)
        ids = (start + torch.arange(SEQ + 1)) % VOCAB
        out.append((ids[:, :-1].contiguous(), ids[:, 1:].contiguous()))
    return out


def _loss(logits, labels):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def _adamw(model):
    return torch.optim.AdamW(model.parameters(), lr=3e-3)


def _train(ctx, batches):
    from torchao.float8.float8_linear import Float8Linear

    torch.manual_seed(0)
    model = TinyTransformer(vocab=VOCAB, hidden=HIDDEN, heads=4, layers=2, seq=SEQ)
    before = {n: id(p) for n, p in model.named_parameters()}

    def swapped(engine):
        """The Float8Linear layers, and whether the optimizer steps the very parameters."""
        fp8 = sorted(n for n, m in engine.model.named_modules() if isinstance(m, Float8Linear))
        stepped = {id(p) for g in engine.optimizer.param_groups for p in g["params"]}
        same_params = stepped == {id(p) for p in engine.model.parameters()} and before == {
            n: id(p) for n, p in engine.model.named_parameters()
        }
        return fp8, same_params

    run = engine_run(ctx, lambda: model, batches, _loss, _adamw, probe=swapped)
    return *run.probed, run.losses, run.state


@pytest.fixture(scope="module")
def fp32_run():
    ((_, _, losses, _),) = run_distributed(_train, 1, _counting_batches(STEPS, 16))
    return losses


def test_fp8_swaps_the_block_linears_and_keeps_their_parameters():
    ((fp8, same, losses, _),) = run_distributed(_train, 1, _counting_batches(2, 16), config=FP8)
    want = [
        f"blocks.{i}.{n}"
        for i in range(2)
        for n in ("attn.q", "attn.k", "attn.v", "attn.out", "fc", "fc2")
    ]
    assert fp8 == sorted(want), fp8  # the head (fp8.skip) and nothing else stays high precision
    assert same, "the optimizer steps the very parameters the Float8Linears hold"


def test_fp8_follows_the_fp32_loss_curve(fp32_run):
    ((_, _, losses, _),) = run_distributed(_train, 1, _counting_batches(STEPS, 16), config=FP8)
    # e4m3 keeps 3 mantissa bits (~6 % per element, averaged down over K-long dot products):
    # measured 0.005 nat at most over 40 AdamW steps while both curves fall by > 4 nats; the
    # bound leaves 6x that for other CPUs' GEMM orders, far below the 4-nat fall
    assert fp32_run[0] - fp32_run[-1] > 2.0 and losses[0] - losses[-1] > 2.0, (fp32_run, losses)
    gaps = [abs(a - b) for a, b in zip(losses, fp32_run, strict=True)]
    assert 0 < max(gaps) < 0.03, gaps  # 0: nothing ran in float8


def test_fp8_under_data_parallelism_keeps_replicas_equal():
    results = run_distributed(_train, 2, _counting_batches(4, 16), config=FP8)
    (fp8_0, _, _, w0), (fp8_1, _, _, w1) = results
    assert fp8_0 == fp8_1 and len(fp8_0) == 12
    for k in w0:  # averaged gradients, identical fp8 casts of identical weights
        assert torch.equal(w0[k], w1[k]), k


def test_bad_fp8_configs_name_the_key_and_the_allowed_values():
    with pytest.raises(gt.ConfigError, match="fp8.recipe.*tensorwise"):
        gt.Config.from_dict(dict(fp8=dict(recipe="blockwise")))
    with pytest.raises(gt.ConfigError, match="fp16.mode must be 'bf16' or None"):
        gt.Config.from_dict(dict(fp8=True, fp16=dict(mode="naive")))
    with pytest.raises(gt.ConfigError, match="parallel.tensor.mode"):
        gt.Config.from_dict(dict(fp8=True, parallel=dict(tensor=dict(size=2, mode="1d"))))


def test_a_head_tied_to_the_embedding_stays_high_precision_whatever_its_name():
    from gridtrain.amp.fp8 import convert_to_fp8

    options = gt.Config.from_dict(dict(fp8=dict(min_features=64, skip=[]))).fp8
    model = TinyTransformer(vocab=VOCAB, hidden=HIDDEN, seq=SEQ, tie=True)
    chosen = convert_to_fp8(model, options)
    assert "head" not in chosen and type(model.head) is torch.nn.Linear, chosen
    assert "blocks.0.fc" in chosen and model.head.weight is model.embed.tok.weight
