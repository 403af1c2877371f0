"""``activation_checkpoint``: each block keeps only its input for the backward and recomputes
the rest, and training is unchanged (float64, exact up to summation order) in one process,
under 1d tensor parallelism (the block's collectives run again in the backward), pipeline
stages and compiled, and with an ``attention`` kernel preference (the recompute runs in the
backward, outside the engine's forward context, and must pick the forward's SDPA kernel);
ZeRO 3 (FSDP2's gathers outside the recomputed region): test_zero.py, Gemini:
test_zero_offload.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers.harness import run_distributed
from helpers.layouts import layout
from helpers.models import TinyTransformer
from helpers.runs import (
    assert_grads_close,
    dense_lm_loss,
    engine_run,
    reference_run,
    seeded,
    token_batches,
)

import gridtrain as gt

STEPS, BATCH, SEQ, VOCAB = 3, 8, 16, 64
AC = dict(activation_checkpoint=True)
LAYOUTS = {
    # the forward prefers math, torch's default order takes the CPU's flash kernel first: as
    # cuDNN first (Hopper's default) against flash on a GPU, each saves other tensors
    "one process math-sdpa": layout("one process", attention=dict(backends=["math"])),
    "1d2": layout("1d2"),
    "pp2": layout("pp2", num_microbatches=2),
    "compiled": layout("one process", compile=dict(backend="aot_eager")),
}


def _model():
    return seeded(lambda: TinyTransformer(vocab=VOCAB, seq=SEQ, layers=3), seed=0)


def _loss(logits, labels):
    return gt.nn.CrossEntropyLoss()(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def _adamw(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-2)


def _recomputes(module) -> bool:
    """The block's forward is the checkpoint wrapper (compiled or not)."""
    fn = getattr(module.forward, "_torchdynamo_orig_callable", module.forward)
    return getattr(fn, "__wrapped__", None) is not None


def _train(ctx, batches):
    torch._dynamo.reset()
    model = _model()
    run = engine_run(ctx, lambda: model, batches, _loss, _adamw, example_inputs=batches[0][0])
    wrapped = sorted(
        n
        for n, m in model.named_modules()
        if n.startswith("blocks.") and n.count(".") == 1 and _recomputes(m)
    )
    return run, wrapped


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_recomputed_blocks_train_as_stored_ones(name):
    world, parallel = LAYOUTS[name]
    batches = token_batches(STEPS, BATCH, SEQ, VOCAB, seed=0)
    ref = reference_run(_model, batches, dense_lm_loss, _adamw)
    d_losses, d_final = ref.losses, ref.state
    results = run_distributed(_train, world, batches, config=dict(AC, **parallel), timeout=300)
    for rank, (run, wrapped) in enumerate(results):
        losses, grads, final, held = run.losses, run.grads[0], run.state, run.shares
        if name != "pp2":
            assert wrapped == ["blocks.0", "blocks.1", "blocks.2"], (name, wrapped)
        else:  # each stage checkpoints the blocks it holds, and holds only its part
            assert wrapped and len(held) < len(dict(_model().named_parameters())), wrapped
        if name == "1d2":  # really cut: half of every block matrix on each rank
            mats = [k for k in held if k.startswith("blocks.") and k.endswith("weight")]
            assert all(held[k] == 0.5 for k in mats if "ln" not in k), held
        # float64: recompute repeats the same ops; sharding only reorders sums
        assert losses == pytest.approx(d_losses, rel=1e-10), (name, rank)
        assert_grads_close(grads, ref, msg=name, rtol=1e-8, atol=1e-12)
        for k, v in final.items():  # AdamW on near-zero gradients amplifies rounding
            torch.testing.assert_close(v, d_final[k], rtol=1e-4, atol=1e-8, msg=f"{name} {k}")


def _saved_bytes(ctx, every):
    """Bytes the forward saves for the backward (torch's saved-tensor hooks see each one)."""
    model = _model()
    cfg = dict(activation_checkpoint=dict(every=every)) if every else {}
    ctx.config = gt.Config.from_dict(cfg)
    engine, *_ = gt.initialize(model, _adamw(model), _loss)
    x, y = token_batches(1, BATCH, SEQ, VOCAB, seed=0)[0]
    total = []

    def pack(t):
        total.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = engine.criterion(engine(x), y)
    loss.backward()
    return sum(total)


def _saved_each(ctx):
    return _saved_bytes(ctx, 1), _saved_bytes(ctx, 2), _saved_bytes(ctx, 0)


def test_checkpointed_blocks_save_less_for_the_backward():
    ((full, every2, none),) = run_distributed(_saved_each, 1)
    # 3 blocks: all checkpointed keep about their inputs; every=2 recomputes blocks 0 and 2
    assert full < every2 < none, (full, every2, none)
    assert full < 0.5 * none, (full, none)


def _no_blocks(ctx):
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
    with pytest.raises(ValueError, match="activation_checkpoint"):
        gt.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1))
    return True


def test_a_model_without_blocks_is_an_error_naming_the_key():
    assert run_distributed(_no_blocks, 1, config=AC) == [True]
    with pytest.raises(gt.ConfigError, match="every"):
        gt.Config.from_dict(dict(activation_checkpoint=dict(every=0)))


class _DropBlock(torch.nn.Module):
    """A block whose dropout draws from a per-data-rank stream (``ctx.fork_rng``), as
    sharded tensor-parallel dropout, ring attention and the noisy MoE router do."""

    def __init__(self, ctx):
        from gridtrain.parallel.mode import ParallelMode
        from gridtrain.parallel.tensor.dropout import ParallelDropout

        super().__init__()
        self.fc = torch.nn.Linear(8, 8)
        self.drop = ParallelDropout(torch.nn.Dropout(0.5), ctx, ParallelMode.DATA)
        self.bn = torch.nn.BatchNorm1d(8)

    def forward(self, x):
        return self.bn(self.drop(self.fc(x))).tanh()


class _DropNet(torch.nn.Module):
    def __init__(self, ctx):
        super().__init__()
        self.blocks = torch.nn.ModuleList(_DropBlock(ctx) for _ in range(2))

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


def _replayed(ctx, recompute):
    ctx.config = gt.Config.from_dict(AC if recompute else {})
    torch.manual_seed(0)
    model = _DropNet(ctx)
    engine, *_ = gt.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), _mse)
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(2):  # the second step draws from the streams where the first left them
        x, y = torch.randn(16, 8, generator=g), torch.randn(16, 8, generator=g)
        engine.zero_grad()
        engine.backward(engine.criterion(engine(x), y))
        out.append({n: p.grad.clone() for n, p in model.named_parameters()})
        engine.step()
    bn = model.blocks[0].bn
    return out, (int(bn.num_batches_tracked), bn.running_mean.clone())


def _mse(out, y):
    return F.mse_loss(out, y)


def test_recompute_replays_rng_streams_and_leaves_batchnorm_statistics_alone():
    """The recompute draws the forward's dropout masks from the context's named streams
    (torch's checkpoint restores only the default generator) and does not update
    BatchNorm's running statistics a second time."""
    for plain, recomputed in zip(
        run_distributed(_replayed, 2, False), run_distributed(_replayed, 2, True), strict=True
    ):
        (p_grads, (p_count, p_mean)), (r_grads, (r_count, r_mean)) = plain, recomputed
        for step in range(2):  # the same ops on the same masks: equal to the last bit
            for k, g in p_grads[step].items():
                assert torch.equal(r_grads[step][k], g), (step, k)
        assert r_count == p_count == 2 and torch.equal(r_mean, p_mean)
