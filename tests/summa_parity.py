"""Per-rank parity checks of the SUMMA layer set (2d and 2.5d) against dense twins.

Shared by test_mode_2d.py and test_mode_2p5d.py; each function runs on every rank
(``run_distributed``) and returns measured errors, the tests assert on them.
Every rank also builds the dense twin itself, from the same full state dict, and
feeds it the whole batch, so the comparison needs no extra communication.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import gridtrain as gt
import gridtrain.nn as gnn
from gridtrain.parallel import comm
from gridtrain.parallel.pipeline.partition import _materialise
from gridtrain.parallel.sharding import (
    full_state_dict,
    get_shard_spec,
    load_full_state_dict,
    shard_tensor,
)
from gridtrain.parallel.tensor import dense
from gridtrain.parallel.tensor.summa import SummaGrid
from gridtrain.parallel.tensor.summa_loss import split_batch

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
B, S, H, V = 8, 3, 8, 16  # batch divisible by depth x q = 4; hidden and vocab by q^2 = 4


def block(x, ctx, hidden=True):
    """This rank's block of a full activation: batch block, then (optionally) hidden block j."""
    x = split_batch(x, ctx)
    return x.chunk(SummaGrid.of(ctx).q, dim=-1)[SummaGrid.of(ctx).j] if hidden else x


def _err(a, b):
    """Max abs error, relative to the reference's magnitude where that exceeds 1."""
    a, b = a.detach().float(), b.detach().float()
    return ((a - b).abs().max() / b.abs().max().clamp(min=1.0)).item()


# (name, parallel factory, dense factory, input maker, input blocked on hidden, output blocked)
def _cases():
    ids = lambda: torch.randint(0, V, (B, S))  # noqa: E731
    act = lambda: torch.randn(B, S, H)  # noqa: E731
    return [
        ("Linear", lambda L: L.Linear(H, 2 * H), act, True, True),
        ("Linear-full-width-input", lambda L: L.Linear(H, 2 * H), act, False, True),
        ("Linear-no-bias", lambda L: L.Linear(H, 6, bias=False), act, True, True),
        ("LayerNorm", lambda L: L.LayerNorm(H), act, True, True),
        ("Embedding", lambda L: L.Embedding(V, H, padding_idx=1), ids, None, True),
        ("VocabParallelEmbedding", lambda L: L.VocabParallelEmbedding(V, H, 1), ids, None, True),
        ("Classifier", lambda L: L.Classifier(H, 5), act, True, False),
        ("VocabParallelClassifier", lambda L: L.VocabParallelClassifier(H, V), act, True, True),
        (
            "PatchEmbedding",
            lambda L: L.PatchEmbedding(4, 2, 3, H),
            lambda: torch.randn(B, 3, 4, 4),
            False,
            True,
        ),
    ]


def layer_parity(ctx):
    """Every layer: output, input gradient and each shard's weight gradient vs the dense twin."""
    results = {}
    for name, make, make_input, in_hidden, out_hidden in _cases():
        torch.manual_seed(0)
        par = make(gnn)
        ref = make(dense)
        # random full weights (not the init's ones/zeros), loaded into both
        full = {k: torch.randn_like(v) for k, v in ref.state_dict().items()}
        ref.load_state_dict(full)
        load_full_state_dict(par, full, ctx)
        errs = {"state_round_trip": max(_err(v, full[k]) for k, v in full_state_dict(par).items())}

        x = make_input()
        grad_x = x.is_floating_point()
        x_ref = x.clone().requires_grad_(grad_x)
        y_ref = ref(x_ref)
        g = torch.randn_like(y_ref)
        (y_ref * g).sum().backward()

        x_par = block(x, ctx, hidden=bool(in_hidden)).clone().requires_grad_(grad_x)
        y_par = par(x_par)
        y_par.backward(block(g, ctx, hidden=out_hidden))
        errs["out"] = _err(y_par, block(y_ref, ctx, hidden=out_hidden))
        if grad_x:
            errs["dx"] = _err(x_par.grad, block(x_ref.grad, ctx, hidden=bool(in_hidden)))
        ref_grads = dict(ref.named_parameters())
        for pname, p in par.named_parameters():
            want = shard_tensor(ref_grads[pname].grad, get_shard_spec(p), ctx)
            assert ref_grads[pname].grad.abs().max() > 0, f"{name}.{pname}: vacuous zero gradient"
            errs[f"grad.{pname}"] = _err(p.grad, want)
        results[name] = errs
    return results


def shard_fractions(ctx):
    """Local / dense element count of every parameter of every layer, and its shard spec."""
    torch.manual_seed(0)
    out = {}
    for name, make, *_ in _cases():
        par, ref = make(gnn), make(dense)
        dense_sizes = {k: v.numel() for k, v in ref.state_dict().items()}
        for pname, p in par.named_parameters():
            out[f"{name}.{pname}"] = (p.numel() / dense_sizes[pname], bool(get_shard_spec(p)))
    return out


def bad_inputs(ctx):
    """The error message of each bad argument, raised before any collective."""
    msgs = {}
    for key, fn in {
        "linear_in": lambda: gnn.Linear(5, 8),
        "linear_bias": lambda: gnn.Linear(8, 6),
        "embedding_dim": lambda: gnn.Embedding(10, 6),
        "split_batch": lambda: split_batch(torch.zeros(5, 2), ctx),
        "width": lambda: gnn.Linear(8, 8)(torch.zeros(2, 3)),
        "tied": lambda: gnn.Classifier(H, V, weight=gnn.VocabParallelEmbedding(V, H).weight),
    }.items():
        try:
            fn()
            msgs[key] = None
        except ValueError as err:
            msgs[key] = str(err)
    return msgs


# ---- a small transformer-ish model trained with AdamW -------------------------------------
class TinyLM(nn.Module):
    """Embedding -> LayerNorm -> 2-Linear MLP (residual) -> LayerNorm -> tied classifier."""

    def __init__(self, L, vocab_parallel: bool):
        super().__init__()
        self.embed = (L.VocabParallelEmbedding if vocab_parallel else L.Embedding)(V, H)
        self.norm1 = L.LayerNorm(H)
        self.fc1 = L.Linear(H, 2 * H)
        self.fc2 = L.Linear(2 * H, H)
        self.norm2 = L.LayerNorm(H)
        head = L.VocabParallelClassifier if vocab_parallel else L.Classifier
        self.head = head(H, V, weight=self.embed.weight)

    def forward(self, ids):
        h = self.embed(ids)
        h = h + self.fc2(F.gelu(self.fc1(self.norm1(h))))
        return self.head(self.norm2(h))


def _batches(steps, seed=2):
    gen = torch.Generator().manual_seed(seed)
    return [
        (torch.randint(0, V, (B, S), generator=gen), torch.randint(0, V, (B, S), generator=gen))
        for _ in range(steps)
    ]


def train_parity(ctx, vocab_parallel: bool, steps: int = 3, data_parallel: bool = False):
    """Losses, accuracies and final weights of AdamW training vs the dense model.

    With ``data_parallel`` every data rank trains on its half of a doubled global
    batch and gradients are averaged over DATA (what the engine's handler does);
    the dense model trains on the whole global batch.
    """
    torch.manual_seed(0)
    par = TinyLM(gnn, vocab_parallel)
    torch.manual_seed(0)
    ref = TinyLM(dense, vocab_parallel)
    init_err = max(_err(v, ref.state_dict()[k]) for k, v in full_state_dict(par).items())
    opt_par = torch.optim.AdamW(par.parameters(), lr=1e-2)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    criterion = gnn.CrossEntropyLoss()
    dp = ctx.data_parallel_size if data_parallel else 1
    losses, accs = [], []
    for ids, labels in _batches(steps):
        if data_parallel:  # the global batch is dp x B; each data rank takes its B rows
            more = _batches(1, seed=100 + len(losses))[0]
            ids, labels = torch.cat([ids, more[0]]), torch.cat([labels, more[1]])
        logits_ref = ref(ids)
        loss_ref = F.cross_entropy(logits_ref.reshape(-1, V), labels.reshape(-1))
        acc_ref = ((logits_ref.argmax(-1) == labels).sum().item(), labels.numel())
        opt_ref.zero_grad()
        loss_ref.backward()
        opt_ref.step()

        if data_parallel:
            r = ctx.local_rank(gt.ParallelMode.DATA)
            ids, labels = ids.chunk(dp)[r], labels.chunk(dp)[r]
        ids, labels = split_batch(ids, ctx), split_batch(labels, ctx)
        logits = par(ids)
        loss = criterion(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
        correct, total = gnn.accuracy(logits, labels)
        opt_par.zero_grad()
        loss.backward()
        if data_parallel:
            loss = loss.detach().clone()
            comm.all_reduce_(loss, ctx.group(gt.ParallelMode.DATA)).div_(dp)
            correct = comm.all_reduce_(correct, ctx.group(gt.ParallelMode.DATA))
            total = comm.all_reduce_(total, ctx.group(gt.ParallelMode.DATA))
            for p in par.parameters():
                comm.all_reduce_(p.grad, ctx.group(gt.ParallelMode.DATA)).div_(dp)
        opt_par.step()
        losses.append((loss.item(), loss_ref.item()))
        accs.append(((correct.item(), total.item()), acc_ref))
    final = full_state_dict(par)
    weight_err = max(_err(v, ref.state_dict()[k]) for k, v in final.items())
    return {"init_err": init_err, "losses": losses, "accs": accs, "weight_err": weight_err}


def lazy_init_matches_dense(ctx):
    """Built on meta (``gt.lazy_init``), then allocated and reset as the engine does:
    the max difference from the eagerly built dense model (same seed)."""
    with gt.lazy_init():
        model = TinyLM(gnn, vocab_parallel=True)
    assert all(p.is_meta for p in model.parameters())
    torch.manual_seed(0)
    _materialise([model], ctx.device)  # what each pipeline stage runs on its layers
    torch.manual_seed(0)
    ref = TinyLM(dense, vocab_parallel=True)
    return max(_err(v, ref.state_dict()[k]) for k, v in full_state_dict(model).items())


class _FlatLoss(nn.Module):
    def __init__(self, L):
        super().__init__()
        self.ce = L.CrossEntropyLoss()

    def forward(self, logits, labels):
        return self.ce(logits.flatten(0, -2), labels.flatten())


def engine_parity(ctx, steps: int = 3):
    """``gt.initialize`` on the mode's model (the engine splits batches and labels itself):
    per-step (loss, dense loss) and the final weights' max error vs dense AdamW training."""
    torch.manual_seed(0)
    model = TinyLM(gnn, vocab_parallel=True)
    torch.manual_seed(0)
    ref = TinyLM(dense, vocab_parallel=True)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    engine, *_ = gt.initialize(model, opt, _FlatLoss(gnn))
    engine.train()
    losses = []
    for ids, labels in _batches(steps):
        loss_ref = _FlatLoss(dense)(ref(ids), labels)
        opt_ref.zero_grad()
        loss_ref.backward()
        opt_ref.step()
        engine.zero_grad()
        loss = engine.criterion(engine(ids), labels)
        engine.backward(loss)
        engine.step()
        losses.append((loss.item(), loss_ref.item()))
    final = full_state_dict(engine.model)
    return losses, max(_err(v, ref.state_dict()[k]) for k, v in final.items())


# ---- cross-mode checkpoint ----------------------------------------------------------------
def probe_loss(model, ctx=None):
    """Loss of ``model`` on a fixed batch (split for the mode when ``ctx`` is given)."""
    ids, labels = _batches(1, seed=7)[0]
    if ctx is not None:
        ids, labels = split_batch(ids, ctx), split_batch(labels, ctx)
        criterion = gnn.CrossEntropyLoss()
    else:
        criterion = nn.CrossEntropyLoss()
    with torch.no_grad():
        logits = model(ids)
        return criterion(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1)).item()


def train_and_save(ctx, path: str):
    """Train one step under this mode, save the full state dict, return its probe loss."""
    torch.manual_seed(3)
    model = TinyLM(gnn, vocab_parallel=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids, labels = (split_batch(t, ctx) for t in _batches(1)[0])
    logits = model(ids)
    gnn.CrossEntropyLoss()(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1)).backward()
    opt.step()
    state = full_state_dict(model)
    if ctx.global_rank == 0:
        torch.save(state, path)
    return probe_loss(model, ctx)


def load_and_probe(ctx, path: str):
    """Load a dense checkpoint into this mode's model; its probe loss and round-trip error."""
    torch.manual_seed(5)  # a different init, overwritten by the checkpoint
    model = TinyLM(gnn, vocab_parallel=True)
    state = torch.load(path)
    load_full_state_dict(model, state, ctx)
    again = full_state_dict(model)
    return probe_loss(model, ctx), max(_err(v, state[k]) for k, v in again.items())
