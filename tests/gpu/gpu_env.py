"""What the one-GPU tests share: the device they run on, how errors are measured, and the small
GPT most of them train (with the parity harness, ``helpers/runs.py``)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
from torch import Tensor

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # demos.gpt
    sys.path.insert(0, str(REPO))

from helpers.runs import token_batches  # noqa: E402

from demos.gpt import model as gpt_model  # noqa: E402

DEVICE_ENV = "GT_TEST_DEVICE"
# a GPT of 2 blocks of 4 heads x 16: big enough for real kernels, small enough for CPU debugging
CFG = gpt_model.preset("tiny", n_layer=2, n_head=4, n_embd=64, block_size=32, vocab_size=128)
STEPS, BATCH, SEQ = 4, 8, 32


def gpt(dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """The GPT (its own seeded init), in ``dtype``."""
    return gpt_model.GPT(CFG).to(dtype)


def gpt_batches(steps: int = STEPS) -> list[tuple[Tensor, Tensor]]:
    """(ids, next-token labels) pairs from a fixed seed, on the CPU."""
    return token_batches(steps, BATCH, SEQ, CFG.vocab_size, seed=0)


def sgd(model: torch.nn.Module):
    """Momentum SGD: the update is proportional to the gradients, so weight errors measure
    gradient errors (Adam's normalised step would hide them)."""
    return torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)


def device_kind() -> str:
    """'cuda' (the default) or 'cpu' (``GT_TEST_DEVICE=cpu``: debugging without a GPU)."""
    kind = os.environ.get(DEVICE_ENV, "cuda").lower()
    if kind not in ("cuda", "cpu"):
        raise ValueError(f"{DEVICE_ENV} must be 'cuda' or 'cpu', got {kind!r}")
    return kind


ON_CUDA = device_kind() == "cuda"


def is_hopper() -> bool:
    """CUDA compute capability >= 9.0 (H100/H200): where ``torch._grouped_mm`` runs."""
    return ON_CUDA and torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)


def rel_err(got: Tensor, want: Tensor) -> float:
    """``||got - want|| / ||want||`` in float64 on the CPU (0 when both are 0)."""
    got, want = got.detach().double().cpu(), want.detach().double().cpu()
    assert got.shape == want.shape, (tuple(got.shape), tuple(want.shape))
    den = want.norm().item()
    num = (got - want).norm().item()
    return num / den if den > 0 else num


def max_abs(got: Tensor, want: Tensor) -> float:
    """Largest absolute difference, in float64 on the CPU."""
    got, want = got.detach().double().cpu(), want.detach().double().cpu()
    assert got.shape == want.shape, (tuple(got.shape), tuple(want.shape))
    return (got - want).abs().max().item()


def rel_errs(got: dict[str, Tensor], want: dict[str, Tensor], floor: float = 1e-6) -> dict:
    """``rel_err`` per key, each relative to at least ``floor`` x the norm of all of ``want``.

    A tensor whose exact value is zero holds only rounding noise in both runs (the key
    projection's bias: softmax ignores a constant added to a row of scores, so its gradient
    is 0), and its own norm would divide noise by noise.
    """
    total = torch.cat([w.detach().double().cpu().flatten() for w in want.values()]).norm().item()
    out = {}
    for k, w in want.items():
        g, w = got[k].detach().double().cpu(), w.detach().double().cpu()
        assert g.shape == w.shape, (k, tuple(g.shape), tuple(w.shape))
        out[k] = (g - w).norm().item() / max(w.norm().item(), floor * total)
    return out


def assert_runs_close(name, losses, ref_losses, loss_tol, grads, ref_grads, grad_tol) -> None:
    """Every step's loss within ``loss_tol`` of the reference run's, every gradient within
    ``grad_tol`` of its reference (relative norm); the worst gradient error is printed."""
    for step, (got, want) in enumerate(zip(losses, ref_losses, strict=True)):
        assert abs(got - want) < loss_tol, (name, step, got, want)
    assert grads.keys() == ref_grads.keys()
    errs = rel_errs(grads, ref_grads)
    worst = max(errs, key=errs.get)
    print(f"  worst gradient error {worst}: {errs[worst]:.2e}")
    for k, err in errs.items():
        assert err < grad_tol, (name, "grad", k, err, max_abs(grads[k], ref_grads[k]))
