"""A 1d model moves between layouts through checkpoints: TP 4 -> TP 2 -> no parallelism.

The model is plain PyTorch written with ``gt.nn`` hints (vocab-parallel embedding, a
two-Linear MLP, LayerNorm, vocab-parallel classifier); the engine shards it. Trained for
one step at TP 4 and saved (dense file or sharded directory), the checkpoint has exactly
the dense model's keys and shapes, loads at TP 2 (into a model initialised from another
seed) and into the plain dense model, and all three give the same loss on a held-out batch.
"""

from __future__ import annotations

import pytest
import torch
from helpers.harness import run_distributed
from torch import nn

import gridtrain as gt
import gridtrain.nn as gnn

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


class LMLoss(nn.Module):
    def __init__(self):
        super().__init__()
        self.ce = gnn.CrossEntropyLoss()

    def forward(self, logits, targets):
        return self.ce(logits.flatten(0, 1), targets.flatten())


def _batch(seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (4, 9), generator=torch.Generator().manual_seed(seed))


def _engine(seed: int):
    torch.manual_seed(seed)
    model = TinyLM()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    engine, *_ = gt.initialize(model, opt, LMLoss(), example_inputs=_batch(0)[:, :-1])
    return engine


def _eval_loss(engine) -> float:
    with torch.no_grad():
        batch = _batch(2)
        return engine.criterion(engine(batch[:, :-1]), batch[:, 1:]).item()


def _train_and_save(ctx, path: str, sharded: bool):
    engine = _engine(seed=0)
    batch = _batch(1)
    engine.zero_grad()
    engine.backward(engine.criterion(engine(batch[:, :-1]), batch[:, 1:]))
    engine.step()  # weights now differ from any seeded init
    gt.save_checkpoint(path, 1, engine.model, engine.optimizer, sharded=sharded)
    return _eval_loss(engine), gt.full_state_dict(engine.model, ctx)


def _load_and_eval(ctx, path: str):
    engine = _engine(seed=123)  # a different init: the values must come from the file
    gt.load_checkpoint(path, engine.model, engine.optimizer)
    return (
        _eval_loss(engine),
        gt.full_state_dict(engine.model, ctx),
        type(engine.model.fc2).__name__,
    )


@pytest.mark.parametrize("sharded", [False, True], ids=["dense-file", "sharded-dir"])
def test_tp4_to_tp2_to_dense(tmp_path, sharded):
    path = str(tmp_path / ("ckpt" if sharded else "ckpt.pt"))
    cfg = lambda tp: dict(parallel=dict(tensor=dict(size=tp, mode="1d")))  # noqa: E731
    saved = run_distributed(_train_and_save, 4, path, sharded, config=cfg(4), timeout=300)
    state = saved[0][1]

    dense = TinyLM()  # no context: gt.nn layers are the plain torch layers
    assert {k: v.shape for k, v in state.items()} == {
        k: v.shape for k, v in dense.state_dict().items()
    }, "checkpoints hold the dense model's keys and shapes"
    if not sharded:
        on_disk = torch.load(path, weights_only=True)["model"]
        assert all(torch.equal(on_disk[k], v) for k, v in state.items())
    dense.load_state_dict(state, strict=True)
    batch = _batch(2)
    with torch.no_grad():
        logits = dense(batch[:, :-1])
        dense_loss = nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())

    for world in (2, 1):
        for loss, got, row_kind in run_distributed(
            _load_and_eval, world, path, config=cfg(world) if world > 1 else None, timeout=300
        ):
            assert all(torch.equal(got[k], v) for k, v in state.items()), "cut and re-gathered"
            assert world == 1 or row_kind == "RowLinear", row_kind
            # float32 reductions reordered by the layout (sharded matmuls, vocab-parallel
            # logsumexp): a few ulps of a loss of ~3.5 (measured <= ~1e-6 absolute)
            assert abs(loss - dense_loss.item()) < 1e-5, (world, loss, dense_loss)
    for loss, _ in saved:
        assert abs(loss - dense_loss.item()) < 1e-5, (loss, dense_loss)
