"""A small GPT (``demos/gpt``) trained by plain PyTorch (the reference) or by the engine."""

from __future__ import annotations

import torch
from torch import Tensor

import gridtrain as gt
from demos.gpt import model as gpt_model
from gridtrain.parallel.sharding import unwrap

# 2 blocks of 4 heads x 16: big enough for real kernels, small enough for CPU debugging
CFG = gpt_model.preset("tiny", n_layer=2, n_head=4, n_embd=64, block_size=32, vocab_size=128)
STEPS, BATCH, SEQ = 4, 8, 32


def batches(steps: int = STEPS, seed: int = 0) -> list[tuple[Tensor, Tensor]]:
    """(ids, next-token labels) pairs from a fixed seed, on the CPU."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        ids = torch.randint(0, CFG.vocab_size, (BATCH, SEQ + 1), generator=g)
        out.append((ids[:, :-1].contiguous(), ids[:, 1:].contiguous()))
    return out


def sgd(params):
    """Momentum SGD: the update is proportional to the gradients, so weight errors measure
    gradient errors (Adam's normalised step would hide them)."""
    return torch.optim.SGD(params, lr=0.5, momentum=0.9)


def reference(data, dtype=torch.float64):
    """Plain PyTorch on the CPU (no gridtrain context): losses and named parameters after
    each step is taken, in ``dtype``."""
    model = gpt_model.GPT(CFG).to(dtype)
    opt, loss_fn = sgd(model.parameters()), gpt_model.GPTLoss()
    losses = []
    for x, y in data:
        opt.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def initial_params() -> dict[str, Tensor]:
    return {n: p.detach().double() for n, p in gpt_model.GPT(CFG).named_parameters()}


def make_engine(model=None, **init_kw):
    """``gt.initialize`` of ``model`` (default: the fp32 GPT) with momentum SGD and the GPT's
    loss, on the current context."""
    model = gpt_model.GPT(CFG) if model is None else model
    engine, *_ = gt.initialize(model, sgd(model.parameters()), gpt_model.GPTLoss(), **init_kw)
    return engine


def train(engine, data, device):
    """Train through the engine; per step: (loss, stepped, output dtype)."""
    record = []
    for x, y in data:
        x, y = x.to(device), y.to(device)
        engine.zero_grad()
        out = engine(x)
        loss = engine.criterion(out, y)
        engine.backward(loss)
        stepped = engine.step()
        record.append((loss.item(), stepped, getattr(out, "dtype", None)))
    return record


def train_with_grads(engine, data, device):
    """Train through the engine; returns the losses, the first step's gradients by name (as
    backward left them, before the step) and each step's forward output."""
    losses, grads, outs = [], None, []
    for x, y in data:
        x, y = x.to(device), y.to(device)
        engine.zero_grad()
        out = engine(x)
        outs.append(out)
        loss = engine.criterion(out, y)
        engine.backward(loss)
        if grads is None:
            named = unwrap(engine.model).named_parameters()
            grads = {n: p.grad.detach().float().cpu().clone() for n, p in named}
        assert engine.step(), "every step is taken"
        losses.append(loss.item())
    return losses, grads, outs


def params(engine) -> dict[str, Tensor]:
    """The trained weights by dense name: the fp32 masters under naive fp16, else the model's."""
    model = unwrap(engine.model)
    masters = getattr(engine.optimizer, "masters", None)
    by_id = {id(p): m for p, m in masters()} if masters else {}
    return {n: by_id.get(id(p), p).detach().cpu().clone() for n, p in model.named_parameters()}
