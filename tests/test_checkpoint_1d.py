"""Full (layout-free) state dicts move a 1d model between layouts: TP 4 -> TP 2 -> no parallelism.

The model is written once with ``gt.nn`` (vocab-parallel embedding, a two-Linear MLP,
LayerNorm, vocab-parallel classifier). Trained for one step at TP 4 and saved with
``full_state_dict``, the file has exactly the dense model's keys and shapes, loads at
TP 2 (into a model initialised from another seed) and into the plain dense model, and
all three give the same loss on a held-out batch.
"""

from __future__ import annotations

import torch
from harness import run_distributed
from torch import nn

import gridtrain.nn as gnn
from gridtrain.parallel.sharding import full_state_dict, load_full_state_dict
from gridtrain.parallel.tensor import mode_1d as m1d

VOCAB, HIDDEN = 32, 16


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = gnn.VocabParallelEmbedding(VOCAB, HIDDEN)
        self.fc1 = gnn.Linear(HIDDEN, 4 * HIDDEN)  # column, output sharded
        self.fc2 = gnn.Linear(4 * HIDDEN, HIDDEN)  # row, reduces it
        self.ln = gnn.LayerNorm(HIDDEN)
        self.head = gnn.VocabParallelClassifier(HIDDEN, VOCAB)

    def forward(self, ids):
        x = self.emb(ids)
        return self.head(self.ln(x + self.fc2(torch.relu(self.fc1(x)))))


def _batch(seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (4, 9), generator=torch.Generator().manual_seed(seed))


def _loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    return gnn.CrossEntropyLoss()(model(batch[:, :-1]).flatten(0, 1), batch[:, 1:].flatten())


def _build(ctx, seed: int) -> TinyLM:
    if ctx is not None:
        m1d.reset_alternation(ctx)
    torch.manual_seed(seed)
    return TinyLM()


def _train_and_save(ctx, path: str):
    model = _build(ctx, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _loss(model, _batch(1)).backward()
    opt.step()  # weights now differ from any seeded init
    state = full_state_dict(model)
    if ctx.global_rank == 0:
        torch.save(state, path)
    with torch.no_grad():
        return _loss(model, _batch(2)).item()


def _load_and_eval(ctx, path: str):
    model = _build(ctx, seed=123)  # a different init: the values must come from the file
    state = torch.load(path)
    load_full_state_dict(model, state)
    again = full_state_dict(model)  # cut and re-gathered: bit-identical
    roundtrip = all(torch.equal(again[k], v) for k, v in state.items())
    with torch.no_grad():
        return _loss(model, _batch(2)).item(), roundtrip, type(model.fc2).__name__


def test_tp4_to_tp2_to_dense(tmp_path):
    path = str(tmp_path / "tiny_lm_full.pt")
    cfg = lambda tp: dict(parallel=dict(tensor=dict(size=tp, mode="1d")))  # noqa: E731
    losses_tp4 = run_distributed(_train_and_save, 4, path, config=cfg(4), timeout=300)
    results_tp2 = run_distributed(_load_and_eval, 2, path, config=cfg(2), timeout=300)

    dense = _build(None, seed=7)  # no context: gt.nn builds plain torch layers
    state = torch.load(path)
    assert {k: v.shape for k, v in state.items()} == {
        k: v.shape for k, v in dense.state_dict().items()
    }, "full state dict = the dense model's keys and shapes"
    dense.load_state_dict(state, strict=True)
    with torch.no_grad():
        dense_loss = _loss(dense, _batch(2)).item()

    for loss_tp2, roundtrip, row_kind in results_tp2:
        assert roundtrip and row_kind == "Linear1DRow"
        # float32 reductions reordered by the layout (sharded matmuls, vocab-parallel logsumexp):
        # a few ulps of a loss of ~3.5 (measured <= ~1e-6 absolute)
        assert abs(loss_tp2 - dense_loss) < 1e-5, (loss_tp2, dense_loss)
    for loss_tp4 in losses_tp4:
        assert abs(loss_tp4 - dense_loss) < 1e-5, (loss_tp4, dense_loss)
