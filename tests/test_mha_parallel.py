"""PyTorch's own attention under every tensor mode, with no plan: ``nn.TransformerEncoder``,
``nn.TransformerDecoderLayer`` and torchvision's ViT train as one process does.

Each model is plain torch in float64, trained three AdamW steps through ``gt.initialize``
against the same model in one process: the losses, every parameter's first-step gradient
(read back from the optimizer, so every shard's), the weights from ``gt.full_state_dict``
(the dense keys and shapes), and after training the outputs and input gradients on the
rows this rank's forward saw. Each rank must hold only its share of the packed
``in_proj_weight`` (1d: ``1/2``; 2d/2.5d: ``1/q^2``; 3d: ``1/8``; sequence keeps weights
whole). The encoder attends causally with a key padding mask built inside the model from
its (split) input, so each layout's rows, masks and position offsets are exercised;
attention confined to a rank's rows or positions gives other losses.
"""

from __future__ import annotations

import pytest
import torch
import torchvision
from helpers.harness import run_distributed
from helpers.runs import (
    Ints,
    Normal,
    assert_grads_close,
    batches,
    dense_lm_loss,
    engine_run,
    global_losses,
    lm_loss,
    reference_run,
    seeded,
)
from torch import nn

import gridtrain as gt

STEPS, B, S, F_IN, E, HEADS, FF, CLASSES = 3, 8, 8, 12, 16, 4, 32, 8
PAD = 1.0  # a key is padding where its first feature exceeds this


class Encoder(nn.Module):
    """Features -> Linear -> a 2-layer ``nn.TransformerEncoder`` (causal, key padding) ->
    Linear, as torch builds it (``batch_first`` either way)."""

    def __init__(self, batch_first: bool):
        super().__init__()
        self.batch_first = batch_first
        self.inp, self.head = nn.Linear(F_IN, E), nn.Linear(E, CLASSES)
        layer = nn.TransformerEncoderLayer(E, HEADS, FF, dropout=0.0, batch_first=batch_first)
        self.enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)

    def forward(self, x):
        pad = x[..., 0] > PAD  # this rank's rows or positions: the layer rebuilds the rest
        pad = pad if self.batch_first else pad.t()
        length = x.shape[1 if self.batch_first else 0]
        causal = torch.ones(length, length, dtype=torch.bool).triu(1)  # True = masked
        return self.head(self.enc(self.inp(x), causal, src_key_padding_mask=pad, is_causal=True))


class Decoder(nn.Module):
    """An ``nn.TransformerDecoderLayer`` (causal self-attention, cross-attention to a memory
    with padding) between Linears."""

    def __init__(self):
        super().__init__()
        self.tgt, self.mem = nn.Linear(F_IN, E), nn.Linear(F_IN, E)
        self.dec = nn.TransformerDecoderLayer(E, HEADS, FF, dropout=0.0, batch_first=True)
        self.head = nn.Linear(E, CLASSES)

    def forward(self, x):
        causal = torch.ones(x.shape[1], x.shape[1], dtype=torch.bool).triu(1)
        h = self.dec(
            self.tgt(x),
            self.mem(x.flip(1)),
            tgt_mask=causal,
            tgt_is_causal=True,
            memory_key_padding_mask=x.flip(1)[..., 0] > PAD,
        )
        return self.head(h)


def vit() -> nn.Module:
    """torchvision's ViT, tiny: 8 x 8 images in 4 x 4 patches, 2 layers of 2 heads."""
    return torchvision.models.VisionTransformer(
        image_size=8, patch_size=4, num_layers=2, num_heads=2, hidden_dim=16, mlp_dim=32,
        num_classes=CLASSES,
    )  # fmt: skip


def _features(batch_first: bool):
    """Token batches whose first position is never padding (a causal row keeps a key)."""
    out = []
    for x, y in batches(STEPS, Normal((B, S, F_IN)), Ints(CLASSES, (B, S)), seed=3):
        x = x.double()
        x[:, 0, 0] = 0.0
        out.append((x, y) if batch_first else (x.transpose(0, 1).contiguous(), y.t().contiguous()))
    return out


def _images():
    return [(x.double(), y) for x, y in batches(STEPS, Normal((B, 3, 8, 8)), Ints(CLASSES, (B,)))]


def _ce(logits, labels):
    return gt.nn.CrossEntropyLoss()(logits, labels)


MODELS = {  # name: (build, batches, engine loss, dense loss)
    "encoder": (lambda: Encoder(True), lambda: _features(True), lm_loss, dense_lm_loss),
    "encoder-seq-first": (lambda: Encoder(False), lambda: _features(False), lm_loss, dense_lm_loss),
    "decoder": (Decoder, lambda: _features(True), lm_loss, dense_lm_loss),
    "vit": (vit, _images, _ce, nn.functional.cross_entropy),
}
MODES = {  # name: (world, parallel.tensor, share of in_proj_weight)
    "1d2": (2, dict(size=2, mode="1d"), 1 / 2),
    "2d4": (4, dict(size=4, mode="2d"), 1 / 4),
    "2.5d8": (8, dict(size=8, mode="2.5d", depth=2), 1 / 4),
    "3d8": (8, dict(size=8, mode="3d"), 1 / 8),
    "sequence2": (2, dict(size=2, mode="sequence"), 1.0),
}
CASES = [
    ("encoder-seq-first", "1d2"),  # torch's default layout: [L, B, E]
    ("encoder", "2d4"),
    ("encoder-seq-first", "2d4"),  # rows are positions: keys gathered over the grid column
    ("encoder", "2.5d8"),
    ("encoder-seq-first", "3d8"),
    ("encoder", "sequence2"),  # ring attention over the split positions
    ("encoder-seq-first", "sequence2"),  # dim 1 is the batch: whole sequences per rank
    ("decoder", "1d2"),
    ("vit", "1d2"),
]


def _adamw(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def _probe(engine, x, y):
    """After training: the output and loss of this rank's forward on ``x``, the rows of ``x``
    the model got, and the gradient of the loss with respect to ``x``."""
    x = x.clone().requires_grad_()
    seen = []
    hook = engine.model.register_forward_pre_hook(lambda m, args: seen.append(args[0].detach()))
    out = engine(x)
    hook.remove()
    loss = engine.criterion(out, y)
    loss.backward()
    return out.detach(), seen[0], x.grad, loss.item()


def _train(ctx, model, batches_):
    build, _, loss, _ = MODELS[model]
    x, y = batches_[0]
    return engine_run(
        ctx,
        lambda: seeded(build),
        batches_,
        loss,
        _adamw,
        probe=lambda engine: _probe(engine, x, y),
        example_inputs=x,
    )


def _block(local: torch.Tensor, whole: torch.Tensor) -> tuple[int, int, int]:
    """(dim, blocks, index): where ``local`` sits in ``whole`` (the engine cuts one dim into
    contiguous blocks)."""
    dims = [d for d in range(whole.dim()) if local.shape[d] != whole.shape[d]]
    if not dims:
        return 0, 1, 0
    (dim,) = dims
    parts = whole.shape[dim] // local.shape[dim]
    index = [torch.equal(b, local) for b in whole.chunk(parts, dim)].index(True)
    return dim, parts, index


@pytest.mark.parametrize(("model", "mode"), CASES, ids=[f"{m}-{n}" for m, n in CASES])
def test_torch_attention_equals_one_process(model, mode):
    build, data, _, dense_loss = MODELS[model]
    world, tensor, share = MODES[mode]
    steps = data()
    ref = reference_run(lambda: seeded(build), steps, dense_loss, _adamw)
    runs = run_distributed(
        _train, world, model, steps, config=dict(parallel=dict(tensor=tensor)), timeout=300
    )
    # float64: sharded matmuls, ring passes and collectives only reorder sums (measured
    # <= 1e-15 relative); attention confined to a rank's block is off by ~3e-3
    assert global_losses(runs) == pytest.approx(ref.losses, rel=1e-12)
    dense = seeded(build)
    dense.load_state_dict(ref.state)
    x, y = (t.clone() for t in steps[0])
    x.requires_grad_()
    want_out = dense(x)
    dense_loss(want_out, y).backward()
    # under sequence the loss's sum all-reduce back-propagates the whole loss on every rank
    # (README, Sequence parallelism), so an input's gradient there is N times the dense one
    scale = world if tensor["mode"] == "sequence" else 1
    for rank, run in enumerate(runs):
        tag = f"{model} {mode} rank {rank}"
        assert set(run.state) == set(ref.state), tag  # gt.full_state_dict: the dense keys
        assert_grads_close(run.grads[0], ref, msg=tag, rtol=1e-10, atol=1e-12)
        for k, v in ref.state.items():
            # AdamW divides by sqrt(v) + 1e-8: a 1e-16 gradient difference moves a weight by
            # up to lr * 1e-8 per step; a wrong shard moves it by O(lr)
            torch.testing.assert_close(run.state[k], v, rtol=1e-6, atol=1e-8, msg=f"{tag} {k}")
        out, seen, grad, loss = run.probed
        dim, parts, index = _block(seen, steps[0][0])
        torch.testing.assert_close(out, want_out.detach().chunk(parts, dim)[index], msg=tag)
        got = grad.chunk(parts, dim)[index]
        torch.testing.assert_close(got, scale * x.grad.chunk(parts, dim)[index], msg=tag)
        attn = [k for k in run.shares if k.endswith("in_proj_weight")]
        assert attn and all(run.shares[k] == pytest.approx(share) for k in attn), run.shares
        assert "heads" in run.plan and "MultiheadAttention" in run.plan, run.plan


def _vit_2d(ctx):
    model = seeded(vit)
    x = _images()[0][0]
    try:
        gt.initialize(model, _adamw(model), _ce, example_inputs=x)
    except gt.PlanError as err:
        return str(err)
    return None


def test_vit_under_2d_is_refused_naming_its_own_parameters():
    """torchvision's ViT reshapes its patch convolution's output by its full ``hidden_dim``
    and adds its class token and position embedding in its own code: under 2d those would
    meet activations split over the grid. The refusal names them and the modes that run
    the model (its attention and MLPs, nearly all of its weights, shard there)."""
    errors = run_distributed(_vit_2d, 4, config=dict(parallel=dict(tensor=dict(size=4, mode="2d"))))
    for err in errors:
        assert err is not None, "ViT under 2d must be refused"
        for name in ("class_token", "conv_proj.weight", "encoder.pos_embedding"):
            assert name in err, err
        assert "tensor mode '1d'" in err and "data parallelism" not in err, err
