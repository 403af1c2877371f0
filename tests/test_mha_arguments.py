"""Every argument of ``nn.MultiheadAttention`` the sharded layer accepts is computed as torch
computes it, and every one it does not is refused at ``gt.initialize``, naming it.

``Zoo`` calls two MHAs with what the Transformer layers never pass: ``kdim``/``vdim`` keys
and values from raw features, ``add_bias_kv``, ``add_zero_attn``, ``bias=False``, a float
2-D ``attn_mask``, a boolean 3-D one and a key padding mask, all built inside the model from
its (split) input (float padding, as the float attention mask wants), and under 1d ``need_weights=True`` (averaged and per head), whose
probabilities feed the output. It trains three AdamW steps in float64 under 1d2 and 2d4 as
one process does. Then: torch's fused inference path is not taken on sharded weights
(``nn.TransformerEncoder`` in eval mode with a padding mask), and the refusals.
"""

from __future__ import annotations

import pytest
import torch
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

STEPS, B, S, F_IN, E, HEADS, KDIM, VDIM, CLASSES = 3, 4, 6, 12, 16, 4, 8, 6, 8


class Zoo(nn.Module):
    """Two MHAs with every constructor option and mask kind (module docstring)."""

    def __init__(self, weights: bool):
        super().__init__()
        self.weights = weights
        self.inp, self.head = nn.Linear(F_IN, E), nn.Linear(E, CLASSES)
        self.cross = nn.MultiheadAttention(
            E, HEADS, add_bias_kv=True, add_zero_attn=True, kdim=KDIM, vdim=VDIM, batch_first=True
        )
        self.plain = nn.MultiheadAttention(E, HEADS, bias=False, batch_first=True)

    def forward(self, x):
        q, length = self.inp(x), x.shape[1]
        pos = torch.arange(length, dtype=x.dtype)
        slope = -0.3 * (pos[:, None] - pos[None, :]).abs()  # a float 2-D mask, ALiBi-like
        pad = torch.zeros_like(x[..., 0]).masked_fill(x[..., 0] > 1.0, float("-inf"))
        a, w = self.cross(
            q,
            x[..., :KDIM],
            x[..., -VDIM:],
            key_padding_mask=pad,
            attn_mask=slope,
            need_weights=self.weights,
        )
        keep = (x[..., 1:2] > x[..., 2:3].transpose(1, 2)) | torch.eye(length, dtype=torch.bool)
        masked = ~keep.repeat_interleave(HEADS, dim=0)  # boolean 3-D [B * heads, L, S]
        b, per_head = self.plain(a, a, a, attn_mask=masked, need_weights=self.weights,
                                 average_attn_weights=False)  # fmt: skip
        out = self.head(b)
        if self.weights:  # the probabilities take part in the loss: their gradients count
            out = out + w.sum(-1, keepdim=True) * per_head.mean((1, 3))[..., None]
        return out


def _data():
    return [(x.double(), y) for x, y in batches(STEPS, Normal((B, S, F_IN)), Ints(CLASSES, (B, S)))]


def _adamw(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def _train(ctx, weights, steps):
    return engine_run(
        ctx,
        lambda: seeded(lambda: Zoo(weights)),
        steps,
        lm_loss,
        _adamw,
        example_inputs=steps[0][0],
    )


@pytest.mark.parametrize(
    ("world", "tensor", "weights", "share"),
    [(2, dict(size=2, mode="1d"), True, 1 / 2), (4, dict(size=4, mode="2d"), False, 1 / 4)],
    ids=["1d2-need-weights", "2d4"],
)
def test_every_mha_argument_equals_one_process(world, tensor, weights, share):
    steps = _data()
    ref = reference_run(lambda: seeded(lambda: Zoo(weights)), steps, dense_lm_loss, _adamw)
    runs = run_distributed(
        _train, world, weights, steps, config=dict(parallel=dict(tensor=tensor)), timeout=300
    )
    # float64: only summation order differs (measured <= 1e-15 relative)
    assert global_losses(runs) == pytest.approx(ref.losses, rel=1e-12)
    for rank, run in enumerate(runs):
        tag = f"{tensor['mode']} rank {rank}"
        assert_grads_close(run.grads[0], ref, msg=tag, rtol=1e-10, atol=1e-12)
        for k, v in ref.state.items():  # AdamW: see test_mha_parallel for the tolerance
            torch.testing.assert_close(run.state[k], v, rtol=1e-6, atol=1e-8, msg=f"{tag} {k}")
        for k in ("cross.k_proj_weight", "cross.bias_k", "plain.in_proj_weight"):
            assert run.shares[k] == pytest.approx(share), (k, run.shares)


class Padded(nn.Module):
    """``nn.TransformerEncoder`` as torch builds it by default for ``batch_first`` (nested
    tensors on), given only a key padding mask: in eval mode without gradients torch would
    take its fused path, which reads ``in_proj_weight`` directly."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(F_IN, E)
        layer = nn.TransformerEncoderLayer(E, HEADS, 32, dropout=0.0, batch_first=True)
        self.enc = nn.TransformerEncoder(layer, 2)

    def forward(self, x):
        return self.enc(self.inp(x), src_key_padding_mask=x[..., 0] > 1.0)


def _eval(ctx, x):
    model = seeded(Padded)
    engine, *_ = gt.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1))
    engine.eval()
    with torch.no_grad():
        return engine(x)


def test_fused_inference_path_is_not_taken_on_sharded_weights():
    x = _data()[0][0]
    x[:, 0, 0] = 0.0  # every sequence keeps a key
    dense = seeded(Padded).eval()
    with torch.no_grad():
        want = dense(x)  # torch's fused path: padded positions come out as zeros
    cfg = dict(parallel=dict(tensor=dict(size=2, mode="1d")))
    got = run_distributed(_eval, 2, x, config=cfg, timeout=120)
    kept = ~(x[..., 0] > 1.0)
    for out in got:  # the fused path on shards fails in torch, or computes garbage
        torch.testing.assert_close(out[kept], want[kept], rtol=1e-9, atol=1e-12)


class Refused(nn.Module):
    """One MHA call a layout does not compute, as ``kind`` says."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind, self.inp = kind, nn.Linear(F_IN, E)
        cls = Custom if kind == "subclass" else nn.MultiheadAttention
        self.mha = cls(E, HEADS, batch_first=True, add_bias_kv=kind == "bias_kv")

    def forward(self, x):
        h = self.inp(x)
        if self.kind == "weights":
            return self.mha(h, h, h)[0]  # need_weights defaults to True
        mask = torch.zeros(x.shape[1], x.shape[1], dtype=x.dtype)  # a float mask, not causal
        return self.mha(h, h, h, attn_mask=mask if self.kind == "mask" else None,
                        need_weights=False)[0]  # fmt: skip


class Custom(nn.MultiheadAttention):
    def forward(self, query, key, value, **kwargs):
        return super().forward(query, key, value, **kwargs)


REFUSALS = {  # kind: (tensor config, what the error names)
    "weights": (dict(size=4, mode="2d"), "need_weights=True"),
    "mask": (dict(size=2, mode="sequence"), "attn_mask (of shape [3, 3]) without is_causal"),
    "bias_kv": (dict(size=2, mode="sequence"), "add_bias_kv=True is not supported"),
    "subclass": (dict(size=2, mode="1d"), "overrides nn.MultiheadAttention.forward"),
}


def _refusal(ctx, kind):
    model = Refused(kind).double()
    x = torch.zeros(B, S, F_IN, dtype=torch.float64)
    try:
        gt.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), example_inputs=x)
    except gt.PlanError as err:
        return str(err)
    return None


@pytest.mark.parametrize("kind", list(REFUSALS))
def test_refused_at_initialize_naming_the_argument(kind):
    tensor, what = REFUSALS[kind]
    size = tensor["size"]
    errors = run_distributed(_refusal, size, kind, config=dict(parallel=dict(tensor=tensor)))
    for err in errors:
        assert err is not None and "'mha'" in err and what in err, err
